package fs

import (
	"context"
	"sync"

	"github.com/hanwen/go-fuse/v2/fuse"
)

// releases brackets the RELEASE requests in flight, so that a node knows
// go-fuse has not yet finished releasing one of its handles.
//
// go-fuse's bridge calls a handle's Release and only afterwards drops the
// node's reference on its registered passthrough backing file, and it
// drops one on every release of a node that has a backing registered,
// also of a handle that was not passed through. Between the two steps a
// node's own counts say "nothing open" while go-fuse still holds the
// backing: an OPEN served then as passthrough would either reuse that
// backing (the kernel then reads and writes the file the node had before,
// not the one it has now) or have its fresh backing unregistered by the
// pending drop, after which the next passthrough open registers yet
// another one and the kernel refuses it (EIO: one backing file per
// inode). So each Release marks its node as releasing, and the mark is
// cleared only once go-fuse's release returned; Open and Create start a
// passthrough epoch only on a node without the mark and serve a plain
// handle otherwise.
//
// A request is identified by its cancel channel, which go-fuse makes per
// request and hands to Release inside the fuse.Context.
type releases struct {
	mu sync.Mutex
	m  map[<-chan struct{}]*node // request -> the node its Release marked
}

// begin registers the RELEASE request cancel before go-fuse serves it.
func (r *releases) begin(cancel <-chan struct{}) {
	if cancel == nil {
		return
	}
	r.mu.Lock()
	r.m[cancel] = nil
	r.mu.Unlock()
}

// attach marks n as releasing when ctx is a RELEASE request bracketed
// by begin (end clears the mark), and reports whether it did. A Release
// calls it before it drops its open count, so an Open always sees the
// count or the mark.
func (r *releases) attach(ctx context.Context, n *node) bool {
	fc, ok := ctx.(*fuse.Context)
	if !ok || fc.Cancel == nil {
		return false
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	prev, ok := r.m[fc.Cancel]
	if !ok || prev != nil {
		return false
	}
	r.m[fc.Cancel] = n
	n.mu.Lock()
	n.releasing++
	n.mu.Unlock()
	return true
}

// end clears the mark the request cancel put on its node, once go-fuse
// has finished releasing the handle.
func (r *releases) end(cancel <-chan struct{}) {
	if cancel == nil {
		return
	}
	r.mu.Lock()
	n := r.m[cancel]
	delete(r.m, cancel)
	r.mu.Unlock()
	if n != nil {
		n.mu.Lock()
		n.releasing--
		n.mu.Unlock()
	}
}
