package probe

import (
	"io/fs"
	"path/filepath"
	"sort"
	"sync"
	"syscall"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
)

// DirSource is an FSSource that finds file-system effects by scanning a
// directory tree and comparing it with the previous scan. It costs a walk
// of the whole tree per call, so it suits small trees, tests and hosts
// without rewind's fs layer (which counts operations as they happen). It
// never follows symbolic links.
type DirSource struct {
	root string

	mu   sync.Mutex
	base map[string]fileState // at construction: for UpperNonEmpty
	prev map[string]fileState
}

type fileState struct {
	mode     fs.FileMode
	size     int64
	mtime    time.Time
	ino      uint64
	uid, gid uint32
	ctime    int64
}

// NewDirSource scans root once and returns a source reporting changes from
// that state on.
func NewDirSource(root string) *DirSource {
	s := &DirSource{root: root}
	s.base = s.scan()
	s.prev = s.base
	return s
}

func (s *DirSource) scan() map[string]fileState {
	out := map[string]fileState{}
	filepath.WalkDir(s.root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || path == s.root {
			return nil
		}
		info, err := d.Info() // lstat: symbolic links are not followed
		if err != nil {
			return nil
		}
		rel, _ := filepath.Rel(s.root, path)
		st := fileState{mode: info.Mode(), size: info.Size(), mtime: info.ModTime()}
		if sys, ok := info.Sys().(*syscall.Stat_t); ok {
			st.ino, st.uid, st.gid = sys.Ino, sys.Uid, sys.Gid
			st.ctime = sys.Ctim.Sec*1e9 + sys.Ctim.Nsec
		}
		out[rel] = st
		return nil
	})
	return out
}

// TakeFSEffects implements FSSource.
func (s *DirSource) TakeFSEffects() effect.FS {
	s.mu.Lock()
	defer s.mu.Unlock()
	cur := s.scan()
	var f effect.FS
	var created, deleted, modified, meta []string
	for p, c := range cur {
		o, ok := s.prev[p]
		switch {
		case !ok:
			created = append(created, p)
		case c.mode.Type() != o.mode.Type() || c.ino != o.ino:
			deleted = append(deleted, p)
			created = append(created, p)
		case c.mode.IsRegular() && (c.size != o.size || !c.mtime.Equal(o.mtime)):
			modified = append(modified, p)
			f.BytesWritten += uint64(c.size)
		case c.mode != o.mode || c.uid != o.uid || c.gid != o.gid || c.ctime != o.ctime:
			meta = append(meta, p)
		}
	}
	for p := range s.prev {
		if _, ok := cur[p]; !ok {
			deleted = append(deleted, p)
		}
	}
	// A deleted path whose inode reappears under a created path was renamed.
	createdIno := map[uint64]int{}
	for i, p := range created {
		createdIno[cur[p].ino] = i
	}
	var renamed []string
	keptDeleted := deleted[:0]
	for _, p := range deleted {
		o := s.prev[p]
		// Inode numbers are reused: a rename also keeps type, size and mtime.
		if i, ok := createdIno[o.ino]; ok && created[i] != "" && created[i] != p && sameContent(o, cur[created[i]]) {
			renamed = append(renamed, p)
			created[i] = ""
			continue
		}
		keptDeleted = append(keptDeleted, p)
	}
	deleted = keptDeleted
	keptCreated := created[:0]
	for _, p := range created {
		if p != "" {
			keptCreated = append(keptCreated, p)
			if c := cur[p]; c.mode.IsRegular() {
				f.BytesWritten += uint64(c.size)
			}
		}
	}
	created = keptCreated
	f.Created, f.Modified, f.Deleted = uint64(len(created)), uint64(len(modified)), uint64(len(deleted))
	f.Renamed, f.MetaChanged = uint64(len(renamed)), uint64(len(meta))
	for _, g := range []struct {
		op    string
		paths []string
	}{{"create", created}, {"modify", modified}, {"delete", deleted}, {"rename", renamed}, {"meta", meta}} {
		sort.Strings(g.paths)
		for _, p := range g.paths {
			if len(f.Samples) >= effect.MaxSamples {
				break
			}
			f.Samples = append(f.Samples, effect.PathSample{Op: g.op, Path: p})
		}
	}
	f.UpperNonEmpty = !sameTree(s.base, cur)
	s.prev = cur
	return f
}

func sameTree(a, b map[string]fileState) bool {
	if len(a) != len(b) {
		return false
	}
	for p, x := range a {
		y, ok := b[p]
		if !ok || x != y {
			return false
		}
	}
	return true
}

func sameContent(a, b fileState) bool {
	return a.mode.Type() == b.mode.Type() && a.size == b.size && a.mtime.Equal(b.mtime)
}
