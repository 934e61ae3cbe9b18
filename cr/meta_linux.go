package cr

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
)

// metaFile describes a checkpoint's images so that an engine started later
// (after a daemon restart) can restore it (LoadImages).
const metaFile = "checkpoint.json"

type metaImage struct {
	Orig    Proc      `json:"orig"`
	Dir     string    `json:"dir"` // relative to the checkpoint's image dir
	Stdio   [3]string `json:"stdio"`
	Stopped bool      `json:"stopped"`
	// Undumpable: the original process was not dumpable.
	Undumpable bool `json:"undumpable,omitempty"`
}

type meta struct {
	Record    Checkpoint  `json:"record"`
	Images    []metaImage `json:"images"`
	StoppedNS []int       `json:"stopped_ns,omitempty"`
}

// writeMeta records c's images next to them (c.image.ImageDir must be set).
func writeMeta(c *ckpt) error {
	m := meta{Record: c.rec}
	for _, im := range c.images {
		rel, err := filepath.Rel(c.image.ImageDir, im.dir)
		if err != nil {
			return err
		}
		m.Images = append(m.Images, metaImage{Orig: im.orig, Dir: rel, Stdio: im.stdio, Stopped: im.stopped, Undumpable: im.undumpable})
	}
	for ns, st := range c.stoppedNS {
		if st {
			m.StoppedNS = append(m.StoppedNS, ns)
		}
	}
	sort.Ints(m.StoppedNS)
	b, err := json.MarshalIndent(m, "", " ")
	if err != nil {
		return err
	}
	p := filepath.Join(c.image.ImageDir, metaFile)
	tmp := p + ".tmp"
	if err := os.WriteFile(tmp, b, 0o600); err != nil {
		return err
	}
	return os.Rename(tmp, p)
}

// LoadImages registers every checkpoint image found under Config.ImagesDir
// that the engine does not hold yet (for example after a daemon restart).
// Loaded checkpoints have an image and no templates: Restore recreates their
// processes with CRIU, into their original sandbox id or any other sandbox.
func (e *Engine) LoadImages() ([]Checkpoint, error) {
	if e.cfg.ImagesDir == "" {
		return nil, errors.New("load images: no ImagesDir configured")
	}
	files, err := filepath.Glob(filepath.Join(e.cfg.ImagesDir, "*", "*", metaFile))
	if err != nil {
		return nil, err
	}
	var out []Checkpoint
	var errs []error
	for _, f := range files {
		b, err := os.ReadFile(f)
		if err != nil {
			errs = append(errs, err)
			continue
		}
		var m meta
		if err := json.Unmarshal(b, &m); err != nil {
			errs = append(errs, fmt.Errorf("%s: %w", f, err))
			continue
		}
		dir := filepath.Dir(f)
		c := &ckpt{rec: m.Record, image: Parts{Image: true, ImageDir: dir}, stoppedNS: map[int]bool{}}
		for _, im := range m.Images {
			if !filepath.IsLocal(im.Dir) {
				errs = append(errs, fmt.Errorf("%s: bad image dir %q", f, im.Dir))
				c = nil
				break
			}
			c.images = append(c.images, image{orig: im.Orig, dir: filepath.Join(dir, im.Dir), stdio: im.Stdio, stopped: im.Stopped, undumpable: im.Undumpable})
		}
		if c == nil {
			continue
		}
		for _, ns := range m.StoppedNS {
			c.stoppedNS[ns] = true
		}
		e.mu.Lock()
		_, have := e.ckpts[c.rec.ID]
		if !have {
			e.clock++
			c.lastUse = e.clock
			c.reachable = true
			e.ckpts[c.rec.ID] = c
		}
		e.mu.Unlock()
		if !have {
			out = append(out, c.rec)
		}
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Taken.Before(out[j].Taken) })
	return out, errors.Join(errs...)
}
