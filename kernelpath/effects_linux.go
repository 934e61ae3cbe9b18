package kernelpath

import (
	"errors"
	"fmt"
	"io"
	"os"
	"sort"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/effect"
)

// TakeFSEffects returns what changed in the view since the previous call.
// With the change tracker it looks only at the entries named by events
// since the previous call (and walks directories new since); otherwise,
// or when the events do not suffice (the cases of track_linux.go), it
// compares a walk of the whole live upper with the previous call's.
// Renames show as a create plus a delete; deletes of lower entries show as
// whiteouts created. UpperNonEmpty reports whether the upper differs from
// what the last checkpoint froze.
func (f *FS) TakeFSEffects() effect.FS {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	if f.closed {
		return effect.FS{}
	}
	if out, err := f.takeTracked(); err == nil {
		f.lastEffects = "tracked"
		return out
	} else if f.track != nil {
		f.lastEffects = "walk: " + err.Error()
		f.log.Debug("kernelpath: effect report walks the upper", "mount", f.id, "reason", err)
	}
	return f.takeWalk()
}

// baseline is the fingerprint the effect report compares with.
func (f *FS) baseline() map[string]entryFP {
	switch {
	case f.taken != nil:
		return f.taken.fp
	case f.ckpt != nil:
		return f.ckpt.fp
	}
	return nil
}

func (f *FS) takeWalk() effect.FS {
	var out effect.FS
	if f.track != nil {
		f.track.drain() // the walk sees what the events said
	}
	cur, err := f.walkUpper()
	if err != nil {
		f.log.Warn("kernelpath: walk upper for effects", "mount", f.id, "err", err)
		out.UpperNonEmpty = true
		return out
	}
	var ckptFP map[string]entryFP
	if f.ckpt != nil {
		ckptFP = f.ckpt.fp
	}
	out = f.effectsOf(cur, f.baseline())
	f.taken = newIndex(cur)
	out.UpperNonEmpty = !sameFP(cur, ckptFP)
	if f.track != nil {
		f.track.effCommitted()
	}
	return out
}

// walkUpper fingerprints the whole live upper; with the tracker it
// watches every directory before reading it and tests the files of
// directories it watches only now for writers.
func (f *FS) walkUpper() (map[string]entryFP, error) {
	root := f.st.LayerPath(f.upper)
	if f.track == nil {
		return fingerprintTree(root)
	}
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	out := map[string]entryFP{}
	s := &effScan{t: f.track, cur: out}
	if err := s.walk(fd, ""); err != nil {
		return nil, err
	}
	return out, nil
}

// effectsOf classifies the entries of cur against prev (both keyed by
// path; prev holds at least every path of cur that it has, and the paths
// that may have gone).
func (f *FS) effectsOf(cur, prev map[string]entryFP) effect.FS {
	var out effect.FS
	paths := make([]string, 0, len(cur))
	for p := range cur {
		paths = append(paths, p)
	}
	sort.Strings(paths)
	sample := func(op, p string) {
		if len(out.Samples) < effect.MaxSamples {
			out.Samples = append(out.Samples, effect.PathSample{Op: op, Path: "/" + p})
		}
	}
	for _, p := range paths {
		c := cur[p]
		o, had := prev[p]
		switch {
		case c.isWhiteout() && (!had || !o.isWhiteout()):
			out.Deleted++
			sample("delete", p)
		case c.isWhiteout():
		case !had:
			if l, ok := f.lowerStat(p); ok && c.mode&unix.S_IFMT == l.mode&unix.S_IFMT {
				// A copy-up of a lower entry: a change, not a creation.
				if c.mode&unix.S_IFMT == unix.S_IFDIR {
					continue // a directory copied up for a change below it
				}
				if c.size != l.size || c.mtime != l.mtime {
					out.Modified++
					sample("modify", p)
					if c.size > l.size {
						out.BytesWritten += uint64(c.size - l.size)
					}
				} else {
					out.MetaChanged++
					sample("meta", p)
				}
				continue
			}
			out.Created++
			sample("create", p)
			if c.mode&unix.S_IFMT == unix.S_IFREG {
				out.BytesWritten += uint64(c.size)
			}
		case o.ino != c.ino || o.mode&unix.S_IFMT != c.mode&unix.S_IFMT:
			out.Created++
			sample("create", p)
		case c.mode&unix.S_IFMT != unix.S_IFDIR && (o.size != c.size || o.mtime != c.mtime):
			out.Modified++
			sample("modify", p)
			if c.size > o.size {
				out.BytesWritten += uint64(c.size - o.size)
			}
		case o.ctime != c.ctime && c.mode&unix.S_IFMT != unix.S_IFDIR:
			out.MetaChanged++
			sample("meta", p)
		case o.mode != c.mode:
			out.MetaChanged++
			sample("meta", p)
		}
	}
	gone := make([]string, 0)
	for p, o := range prev {
		if _, ok := cur[p]; !ok && !o.isWhiteout() {
			gone = append(gone, p)
		}
	}
	sort.Strings(gone)
	for _, p := range gone {
		out.Deleted++
		sample("delete", p)
	}
	return out
}

// takeTracked is the effect report from the tracker's events.
func (f *FS) takeTracked() (effect.FS, error) {
	t := f.track
	if t == nil {
		return effect.FS{}, errors.New("no tracking")
	}
	todo, err := t.planEff()
	if err != nil {
		return effect.FS{}, err
	}
	if f.ckpt != nil && t.broken != "" {
		return effect.FS{}, fmt.Errorf("%w: %s", errNeedWalk, t.broken)
	}
	base := f.taken
	if base == nil {
		base = cloneIndex(f.ckpt)
	}
	root, err := unix.Open(f.st.LayerPath(f.upper), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return effect.FS{}, err
	}
	defer unix.Close(root)
	s := &effScan{t: t, base: base, cur: map[string]entryFP{}, prev: map[string]entryFP{}}
	if err := s.visit(root, "", todo); err != nil {
		return effect.FS{}, err
	}
	out := f.effectsOf(s.cur, s.prev)
	if f.ckpt == nil {
		out.UpperNonEmpty = dirHasEntries(root)
	} else {
		out.UpperNonEmpty = differs(root, "", closure(t.dirty), f.ckpt)
	}
	for _, p := range s.gone {
		base.remove(p, nil)
	}
	paths := make([]string, 0, len(s.cur))
	for p := range s.cur {
		paths = append(paths, p)
	}
	sort.Slice(paths, func(i, j int) bool { return len(paths[i]) < len(paths[j]) })
	for _, p := range paths {
		base.set(p, s.cur[p])
	}
	f.taken = base
	t.effCommitted()
	return out, nil
}

func cloneIndex(x *fpIndex) *fpIndex {
	fp := map[string]entryFP{}
	if x != nil {
		for p, e := range x.fp {
			fp[p] = e
		}
	}
	return newIndex(fp)
}

func dirHasEntries(fd int) bool {
	dup, err := dupCloexec(fd)
	if err != nil {
		return true
	}
	d := os.NewFile(uintptr(dup), "upper")
	defer d.Close()
	names, err := d.Readdirnames(1)
	if errors.Is(err, io.EOF) {
		return false
	}
	return err != nil || len(names) > 0
}

// effScan collects the current fingerprints of the entries an effect
// report looks at (cur) and the baseline's at those paths (prev).
type effScan struct {
	t    *tracker
	base *fpIndex
	cur  map[string]entryFP
	prev map[string]entryFP
	gone []string // baseline paths whose entry (and subtree) is replaced or removed
}

// addBase puts the baseline's entries at p and below into prev.
func (s *effScan) addBase(p string) {
	o, ok := s.base.fp[p]
	if !ok {
		return
	}
	s.prev[p] = o
	if o.mode&unix.S_IFMT == unix.S_IFDIR {
		for name := range s.base.children[p] {
			s.addBase(join(p, name))
		}
	}
}

func (s *effScan) visit(ufd int, p string, todo map[string]map[string]uint8) error {
	for name := range todo[p] {
		cp := join(p, name)
		o, had := s.base.fp[cp]
		if had && o.multiLink() {
			return fmt.Errorf("%w: /%s has other names", errNeedWalk, cp)
		}
		var st unix.Stat_t
		err := unix.Fstatat(ufd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) {
			if had {
				s.gone = append(s.gone, cp)
				s.addBase(cp)
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("/%s: %w", cp, err)
		}
		cur := fpOf(&st)
		isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
		if !isDir && cur.multiLink() {
			s.t.noteLinked(ufd, name)
			return fmt.Errorf("%w: /%s has other names", errNeedWalk, cp)
		}
		known := false
		if isDir {
			if pq, ok := s.base.dirs[cur.ino]; ok {
				if pq != cp {
					return fmt.Errorf("%w: directory /%s moved to /%s unseen", errNeedWalk, pq, cp)
				}
				known = true
			}
		}
		s.cur[cp] = cur
		if had {
			if known {
				s.prev[cp] = o
			} else {
				// A new entry where the baseline had another: all of the
				// baseline's below is gone or replaced.
				s.gone = append(s.gone, cp)
				s.addBase(cp)
			}
		}
		if !isDir {
			continue
		}
		cfd, err := unix.Openat(ufd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("/%s: %w", cp, err)
		}
		if known {
			err = s.visit(cfd, cp, todo)
			unix.Close(cfd)
		} else {
			err = s.walk(cfd, cp) // closes cfd
		}
		if err != nil {
			return err
		}
	}
	return nil
}

// walk fingerprints everything below the directory fd at path p (which
// it closes) into cur, watching each directory before reading it; with a
// baseline (a tracked report) an entry with other names aborts.
func (s *effScan) walk(fd int, p string) error {
	fresh, err := s.t.enter(fd, p, 0)
	if err != nil {
		s.t.breakf("%v", err)
	}
	dir := os.NewFile(uintptr(fd), p)
	defer dir.Close()
	names, err := dir.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read dir /%s: %w", p, err)
	}
	for _, name := range names {
		cp := join(p, name)
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			return fmt.Errorf("/%s: %w", cp, err)
		}
		e := fpOf(&st)
		s.cur[cp] = e
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFDIR:
			cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				if errors.Is(err, unix.ENOENT) {
					continue
				}
				return fmt.Errorf("/%s: %w", cp, err)
			}
			if err := s.walk(cfd, cp); err != nil {
				return err
			}
			continue
		case unix.S_IFREG:
			if fresh {
				// Opened before this directory was watched: a writer?
				l := &leases{t: s.t, writers: s.t.writers}
				l.check(fd, name, cp)
				if l.err != nil {
					s.t.breakf("%v", l.err)
				}
			}
		}
		if e.multiLink() {
			s.t.noteLinked(fd, name)
			if s.base != nil {
				return fmt.Errorf("%w: /%s has other names", errNeedWalk, cp)
			}
		}
	}
	return nil
}

// differs reports whether any entry named by todo (below the directory
// ufd at path p) differs from the checkpoint's fingerprint x, as sameFP
// compares.
func differs(ufd int, p string, todo map[string]map[string]uint8, x *fpIndex) bool {
	for name := range todo[p] {
		cp := join(p, name)
		o, had := x.fp[cp]
		var st unix.Stat_t
		err := unix.Fstatat(ufd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) {
			if had {
				return true
			}
			continue
		}
		if err != nil || !had {
			return true
		}
		c := fpOf(&st)
		if !(c.isWhiteout() && o.isWhiteout()) && (c.mode != o.mode || c.size != o.size || c.mtime != o.mtime || c.ctime != o.ctime) {
			return true
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			continue
		}
		if x.dirs[c.ino] != cp {
			return true
		}
		cfd, err := unix.Openat(ufd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return true
		}
		d := differs(cfd, cp, todo, x)
		unix.Close(cfd)
		if d {
			return true
		}
	}
	return false
}
