package cr

import (
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"sort"
	"strings"
)

// SweepOptions says which image directories SweepImages keeps besides
// those of the checkpoints the engine holds or is writing an image of.
type SweepOptions struct {
	// Keep names the checkpoints (ids) whose image directories stay: the
	// ones the caller's records still use.
	Keep map[string]bool
	// Start is set for the sweep at a daemon's start, once its records
	// are loaded and before this engine took any checkpoint: every
	// checkpoint the engine holds then is an image LoadImages found, and
	// those Keep does not name are dropped (their directories removed).
	// A directory Keep names is removed all the same when it holds no
	// metadata file: the dump that wrote it was cut short, or a removal
	// of it was, and LoadImages did not take it (no restore can use it).
	Start bool
}

// SweepResult is what SweepImages removed.
type SweepResult struct {
	// Removed are the checkpoint image directories removed, as
	// "<sandbox>/<checkpoint>" under Config.ImagesDir.
	Removed []string
	// Bytes is what they held.
	Bytes int64
}

// SweepImages removes every checkpoint image directory under
// Config.ImagesDir (<sandbox>/<checkpoint>) that no one uses: not a
// checkpoint the engine holds, not one whose image is being written or
// removed now, and not one opts.Keep names. Such directories are left by
// CRIU-path checkpoints that failed (their directory holds criu's log),
// by a daemon killed while it wrote an image or while it removed one, and
// by checkpoints dropped from the caller's records while the engine did
// not hold them (after a restart). A sandbox's directory left empty is
// removed too, unless an image of that sandbox is being written.
func (e *Engine) SweepImages(opts SweepOptions) (SweepResult, error) {
	var res SweepResult
	if e.cfg.ImagesDir == "" {
		return res, nil
	}
	var errs []error
	keep := make(map[string]bool, len(opts.Keep))
	for id, k := range opts.Keep {
		if k {
			keep[safeName(id)] = true
		}
	}
	if opts.Start {
		e.mu.Lock()
		var drop []string
		for id := range e.ckpts {
			if !opts.Keep[id] {
				drop = append(drop, id)
			}
		}
		e.mu.Unlock()
		sort.Strings(drop)
		for _, id := range drop {
			e.Drop(id) // an image: removes its directory, which the walk below then finds gone
		}
	}
	sbs, err := os.ReadDir(e.cfg.ImagesDir)
	if errors.Is(err, fs.ErrNotExist) {
		return res, nil
	}
	if err != nil {
		return res, err
	}
	for _, sb := range sbs {
		if !sb.IsDir() {
			continue
		}
		sbDir := filepath.Join(e.cfg.ImagesDir, sb.Name())
		cks, err := os.ReadDir(sbDir)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		for _, ck := range cks {
			if !ck.IsDir() {
				continue
			}
			dir := filepath.Join(sbDir, ck.Name())
			if !e.sweepable(ck.Name(), dir, keep[ck.Name()], opts.Start) {
				continue
			}
			n := dirBytes(dir)
			if err := os.RemoveAll(dir); err != nil {
				errs = append(errs, err)
				continue
			}
			e.log.Debug("removed an image no checkpoint uses", "dir", dir, "bytes", n, "start", opts.Start)
			res.Removed = append(res.Removed, sb.Name()+"/"+ck.Name())
			res.Bytes += n
		}
		e.removeSandboxDir(sb.Name(), sbDir)
	}
	return res, errors.Join(errs...)
}

// sweepable reports whether the image directory dir, named name, may go
// (SweepImages): kept says the caller's records use it.
func (e *Engine) sweepable(name, dir string, kept, start bool) bool {
	if e.usesImageDir(name) {
		return false
	}
	if !kept {
		return true
	}
	if !start {
		return false
	}
	_, err := os.Lstat(filepath.Join(dir, metaFile))
	return errors.Is(err, fs.ErrNotExist)
}

// usesImageDir reports whether image directory name (a checkpoint id
// through safeName) is one of a checkpoint the engine holds or is writing
// or removing an image of.
func (e *Engine) usesImageDir(name string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.ckpts[name]; ok {
		return true
	}
	if _, ok := e.writing[name]; ok {
		return true
	}
	if !strings.Contains(name, "_") {
		return false // safeName(id) == name only for id == name
	}
	for id := range e.ckpts {
		if safeName(id) == name {
			return true
		}
	}
	for id := range e.writing {
		if safeName(id) == name {
			return true
		}
	}
	return false
}

// removeSandboxDir removes sandbox sb's image directory if it is empty
// and no image of sb is being written (whose dump would make it again
// under the removal: e.mu is held across it, and writingImage takes e.mu
// before a dump makes its directory).
func (e *Engine) removeSandboxDir(sb, dir string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, w := range e.writing {
		if safeName(w.sandbox) == sb {
			return
		}
	}
	_ = os.Remove(dir) // fails unless empty
}

// dirBytes is the size of the files under dir (0 when unreadable).
func dirBytes(dir string) int64 {
	var n int64
	filepath.WalkDir(dir, func(_ string, d fs.DirEntry, err error) error {
		if err == nil && d.Type().IsRegular() {
			if fi, err := d.Info(); err == nil {
				n += fi.Size()
			}
		}
		return nil
	})
	return n
}
