package kernelpath

import (
	"path"

	"golang.org/x/sys/unix"
)

// fpIndex is the fingerprint of the upper as the last checkpoint froze it,
// with the two lookups an incremental freeze needs: directories by inode
// and the children of each directory. A walk builds it anew; a tracked
// freeze (track_linux.go) edits it in place, at a cost that follows the
// entries changed.
type fpIndex struct {
	fp       map[string]entryFP
	dirs     map[uint64]string              // inode -> path, directories only
	children map[string]map[string]struct{} // directory path ("" = root) -> child names
}

// newIndex indexes the fingerprint fp (which it keeps).
func newIndex(fp map[string]entryFP) *fpIndex {
	x := &fpIndex{fp: fp, dirs: make(map[uint64]string), children: make(map[string]map[string]struct{})}
	for p, e := range fp {
		x.link(p, e)
	}
	return x
}

func parentOf(p string) string {
	d := path.Dir(p)
	if d == "." {
		return ""
	}
	return d
}

func (x *fpIndex) link(p string, e entryFP) {
	if e.mode&unix.S_IFMT == unix.S_IFDIR {
		x.dirs[e.ino] = p
	}
	dir := parentOf(p)
	c := x.children[dir]
	if c == nil {
		c = make(map[string]struct{})
		x.children[dir] = c
	}
	c[path.Base(p)] = struct{}{}
}

// set records entry p (its parent must be recorded or be the root).
func (x *fpIndex) set(p string, e entryFP) {
	if o, ok := x.fp[p]; ok && o.mode&unix.S_IFMT == unix.S_IFDIR && x.dirs[o.ino] == p {
		delete(x.dirs, o.ino)
	}
	x.fp[p] = e
	x.link(p, e)
}

// remove drops entry p and everything below it; gone is called for every
// directory removed.
func (x *fpIndex) remove(p string, gone func(p string, ino uint64)) {
	e, ok := x.fp[p]
	if !ok {
		return
	}
	if e.mode&unix.S_IFMT == unix.S_IFDIR {
		for name := range x.children[p] {
			x.remove(join(p, name), gone)
		}
		delete(x.children, p)
		if x.dirs[e.ino] == p {
			delete(x.dirs, e.ino)
		}
		if gone != nil {
			gone(p, e.ino)
		}
	}
	delete(x.fp, p)
	if c := x.children[parentOf(p)]; c != nil {
		delete(c, path.Base(p))
		if len(c) == 0 {
			delete(x.children, parentOf(p))
		}
	}
}
