package fs

import (
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// Compact implements layer.FS: it merges the frozen store layers of the
// current stack into one new layer, rewrites every checkpoint whose stack
// starts with that run to use the merged layer instead (their content is
// unchanged), and frees the old layers that nothing references any more.
func (f *FS) Compact() error {
	f.mu.RLock()
	run := append([]*layerDir(nil), f.st.frozen...)
	if len(run) < 2 {
		f.mu.RUnlock()
		return nil
	}
	// The merge reads the run's layers without f.mu: their descriptors
	// must stay open even if a switch leaves them meanwhile.
	f.reg.ref(run...)
	f.mu.RUnlock()
	defer f.reg.release(run...)
	runIDs := make([]string, len(run))
	for i, l := range run {
		runIDs[i] = l.id
	}
	id := layer.NewID()
	tmp := filepath.Join(f.store.WorkDir(), "compact-"+id)
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return fmt.Errorf("compact: %w", err)
	}
	top := slices.Clone(run)
	slices.Reverse(top)
	if err := mergeRun(top, tmp); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("compact: %w", err)
	}
	size, _ := layer.DirSize(tmp)
	if err := f.store.AdoptLayer(id, tmp, layer.LayerMeta{ID: id, Created: time.Now().UTC(), Size: size}); err != nil {
		_ = os.RemoveAll(tmp)
		return fmt.Errorf("compact: %w", err)
	}
	// Records of checkpoints taken before now may still be queued for the
	// background writer: write them first so the rewrite sees them.
	f.flushBG()
	if err := f.rewriteRun(runIDs, id); err != nil {
		return err
	}
	m, err := f.reg.open(id, f.store.LayerPath(id))
	if err != nil {
		return fmt.Errorf("compact: %w", err)
	}
	f.mu.Lock()
	cur := f.st
	if len(cur.frozen) >= len(run) && slices.Equal(cur.frozen[:len(run)], run) {
		frozen := append([]*layerDir{m}, cur.frozen[len(run):]...)
		next := newStack(cur.upper, frozen, cur.lowers, cur.base)
		// next's references: m's from open, its own on the layers it
		// shares with cur (cur's go with it, the run's among them).
		for _, l := range next.top {
			if l != m {
				f.reg.ref(l)
			}
		}
		f.setStack(next)
		f.gen.Add(1)
		if err := f.journal.Append(f.entry("compact", layer.Checkpoint{ID: cur.base})); err != nil {
			f.log.Warn("journal compaction", "err", err)
		}
		if err := f.saveMount(true); err != nil {
			f.log.Warn("save mount record", "err", err)
		}
	} else {
		f.reg.release(m) // the stack changed meanwhile: m is not used
	}
	f.mu.Unlock()
	// A checkpoint taken while the run was being merged still names the
	// old layers, and its record may have been queued only now: rewrite
	// once more after it is written, or GC would free layers it needs.
	f.flushBG()
	if err := f.rewriteRun(runIDs, id); err != nil {
		return err
	}
	if _, err := f.store.GC(time.Minute); err != nil {
		f.log.Warn("gc after compaction", "err", err)
	}
	return nil
}

// rewriteRun makes every checkpoint record whose stack starts with the
// layers runIDs start with the merged layer id instead.
func (f *FS) rewriteRun(runIDs []string, id string) error {
	cps, err := f.store.Checkpoints()
	if err != nil {
		return fmt.Errorf("compact: %w", err)
	}
	for _, c := range cps {
		if len(c.Layers) < len(runIDs) || !slices.Equal(c.Layers[:len(runIDs)], runIDs) {
			continue
		}
		// Re-read under the store's record lock: a checkpoint deleted
		// since the listing stays deleted.
		err := f.store.RewriteCheckpoint(c.ID, func(c *layer.Checkpoint) bool {
			if len(c.Layers) < len(runIDs) || !slices.Equal(c.Layers[:len(runIDs)], runIDs) {
				return false
			}
			c.Layers = append([]string{id}, c.Layers[len(runIDs):]...)
			return true
		})
		if err != nil {
			return fmt.Errorf("compact: %w", err)
		}
	}
	return nil
}

// flushBG waits until the background worker has run everything queued so
// far (checkpoint records, spare uppers). The mount must be serving.
func (f *FS) flushBG() {
	done := make(chan struct{})
	f.bg <- func() { close(done) }
	<-done
}

// mergeRun writes into dst one layer equivalent to the run of layers top
// (top-down) placed over any lower layers: whiteouts that hide lower content
// stay, directories whose descent stops inside the run become opaque, and
// directories found at another path below the run get a redirect.
func mergeRun(top []*layerDir, dst string) error {
	srcs := make([]src, len(top))
	for i, l := range top {
		srcs[i] = src{l, "."}
	}
	var rs unix.Stat_t
	if err := unix.Fstatat(top[0].fd, ".", &rs, 0); err == nil {
		_ = os.Chmod(dst, os.FileMode(rs.Mode&0o777))
		_ = os.Lchown(dst, int(rs.Uid), int(rs.Gid))
	}
	return mergeDir(top, srcs, ".", dst)
}

func mergeDir(top []*layerDir, srcs []src, below string, dst string) error {
	var names []string
	seen := map[string]bool{}
	for _, s := range srcs {
		fd, err := openBeneath(s.l.fd, s.path, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			return err
		}
		ents, err := readDirNames(fd)
		unix.Close(fd)
		if err != nil {
			return err
		}
		for _, n := range ents {
			if !seen[n] {
				seen[n] = true
				names = append(names, n)
			}
		}
	}
	for _, name := range names {
		r, err := lookupRun(top, srcs, below, name)
		if err != nil {
			return err
		}
		dp := dst + "/" + name
		switch {
		case r.whiteout:
			if err := unix.Mknod(dp, unix.S_IFCHR, 0); err != nil {
				return err
			}
		case !r.found:
		case r.e.isDir():
			s := r.e.srcs[0]
			if err := copyMeta(s, dp, true); err != nil {
				return err
			}
			if r.stopped {
				if err := layer.SetOpaque(dp); err != nil {
					return err
				}
			} else if r.below != join(below, name) {
				if err := layer.SetRedirect(dp, "/"+r.below); err != nil {
					return err
				}
			}
			if err := mergeDir(top, r.e.srcs, r.below, dp); err != nil {
				return err
			}
			ts := []unix.Timespec{r.e.st.Atim, r.e.st.Mtim}
			_ = unix.UtimesNanoAt(unix.AT_FDCWD, dp, ts, unix.AT_SYMLINK_NOFOLLOW)
		default:
			if err := copyMeta(r.e.srcs[0], dp, false); err != nil {
				return err
			}
		}
	}
	return nil
}

type runResult struct {
	e        entry
	found    bool
	whiteout bool   // hidden by a whiteout inside the run
	stopped  bool   // a directory whose descent ends inside the run
	below    string // path of the directory in layers below the run
}

// lookupRun resolves name in a directory of the run (srcs are the
// directory's sources in the run, below its path below the run).
func lookupRun(top []*layerDir, srcs []src, below, name string) (runResult, error) {
	var r runResult
	redirect, relRedirect := "", ""
	stopNext := false
	pi := 0
	for _, l := range top {
		var pp string
		hasParent := pi < len(srcs) && srcs[pi].l == l
		if hasParent {
			pp = srcs[pi].path
			pi++
		}
		if stopNext {
			// The descent ends inside the run.
			r.stopped = r.found
			r.whiteout = !r.found
			return r, nil
		}
		var p string
		switch {
		case redirect != "":
			p = redirect
			redirect, stopNext = mapAncestors(l, p, false)
		case !hasParent:
			continue
		case relRedirect != "":
			p = join(pp, relRedirect)
		default:
			p = join(pp, name)
		}
		var s unix.Stat_t
		err := unix.Fstatat(l.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW)
		if err == unix.ENOENT || err == unix.ENOTDIR {
			continue
		}
		if err != nil {
			return r, err
		}
		if layer.IsWhiteout(&s) {
			if !r.found {
				r.whiteout = true
			} else {
				r.stopped = true
			}
			return r, nil
		}
		isDir := s.Mode&unix.S_IFMT == unix.S_IFDIR
		if !r.found {
			r.found = true
			r.e.st = s
			r.e.srcs = []src{{l, p}}
			if !isDir {
				return r, nil
			}
		} else {
			if !isDir {
				r.stopped = true
				return r, nil
			}
			r.e.srcs = append(r.e.srcs, src{l, p})
		}
		hp := l.path + "/" + p
		if layer.IsOpaque(hp) {
			r.stopped = true
			return r, nil
		}
		if rd := layer.Redirect(hp); rd != "" {
			if strings.HasPrefix(rd, "/") {
				redirect = path.Clean(strings.TrimPrefix(rd, "/"))
			} else {
				relRedirect = rd
			}
		}
	}
	switch {
	case redirect != "":
		r.below = redirect
	case relRedirect != "":
		r.below = join(path.Dir(join(below, name)), relRedirect)
	default:
		r.below = join(below, name)
	}
	return r, nil
}

// copyMeta copies one entry from s to host path dp (a directory without
// its content when dir).
func copyMeta(s src, dp string, dir bool) error {
	var ss unix.Stat_t
	if err := unix.Fstatat(s.l.fd, s.path, &ss, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	srcHost := s.l.path + "/" + s.path
	switch ss.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if err := unix.Mkdir(dp, 0o700); err != nil {
			return err
		}
	case unix.S_IFREG:
		in, err := openBeneath(s.l.fd, s.path, unix.O_RDONLY, 0)
		if err != nil {
			return err
		}
		out, err := unix.Open(dp, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_CLOEXEC|unix.O_NOFOLLOW, 0o600)
		if err != nil {
			unix.Close(in)
			return err
		}
		err = copyData(in, out, ss.Size)
		unix.Close(in)
		unix.Close(out)
		if err != nil {
			return err
		}
	case unix.S_IFLNK:
		buf := make([]byte, 4096)
		k, err := unix.Readlinkat(s.l.fd, s.path, buf)
		if err != nil {
			return err
		}
		if err := unix.Symlink(string(buf[:k]), dp); err != nil {
			return err
		}
	default:
		if err := unix.Mknod(dp, ss.Mode, int(ss.Rdev)); err != nil {
			return err
		}
	}
	if err := unix.Lchown(dp, int(ss.Uid), int(ss.Gid)); err != nil {
		return err
	}
	if ss.Mode&unix.S_IFMT != unix.S_IFLNK {
		if err := unix.Chmod(dp, ss.Mode&07777); err != nil {
			return err
		}
	}
	if err := copyXattrs(srcHost, dp); err != nil {
		return err
	}
	ts := []unix.Timespec{ss.Atim, ss.Mtim}
	return unix.UtimesNanoAt(unix.AT_FDCWD, dp, ts, unix.AT_SYMLINK_NOFOLLOW)
}
