package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// No-open mode (Options.NoOpen): the mount answers the kernel's first
// OPEN with ENOSYS, after which the kernel opens and closes regular files
// without asking (FUSE's no_open: no OPEN, no RELEASE) and, once FLUSH is
// answered with ENOSYS too, closes them without a FLUSH. READ, WRITE,
// FSYNC, FALLOCATE, LSEEK and GETATTR then arrive without a file handle
// and are served through the node's implicit handles: an ordinary handle
// for reading, opened on the node's first read, and one for writing
// (copied up first), opened on its first write. They re-target after a
// copy-up or a switch exactly like the handles of opened files (handle.
// refresh); the only difference a descriptor sees is that copy-up happens
// at the first write rather than at an open for writing (the content is
// the same either way). A file unlinked or renamed over while the kernel
// may still hold it open gets its handle before the name goes, and keeps
// it until the kernel forgets the inode, so unlinked open files stay
// readable and writable. Other implicit handles are closed when more than
// implicitMax nodes hold one (the kernel keeps the pages it read: a
// re-read of a cached file costs nothing, an evicted handle is reopened on
// the next request that needs it).

// implicitMax bounds the nodes of one mount holding implicit handles
// (each one or two host fds) before idle ones are closed: a daemon serves
// many mounts under one fd limit (64 fork children: at most 8k fds).
const implicitMax = 64

// noOpen reports whether the mount runs in no-open mode.
func (f *FS) noOpen() bool { return f.opts.NoOpen && !f.opts.Passthrough }

var (
	_ gofs.NodeReader    = (*node)(nil)
	_ gofs.NodeWriter    = (*node)(nil)
	_ gofs.NodeFsyncer   = (*node)(nil)
	_ gofs.NodeAllocater = (*node)(nil)
	_ gofs.NodeLseeker   = (*node)(nil)
)

// implicit returns n's implicit handle for reading or writing (opening it
// if needed) and counts a use; call n.unuse when done.
func (n *node) implicit(write bool) (*handle, syscall.Errno) {
	n.mu.Lock()
	h := n.implR
	if write {
		h = n.implW
	}
	if h != nil {
		n.implUse++
		n.mu.Unlock()
		return h, 0
	}
	n.mu.Unlock()
	st, done, errno := n.begin(write)
	if errno != 0 {
		return nil, errno
	}
	flags := uint32(unix.O_RDONLY)
	if write {
		flags = unix.O_RDWR
	}
	nh, _, errno := n.openHandle(st, flags, write)
	done()
	if errno != 0 {
		return nil, errno
	}
	n.mu.Lock()
	slot := &n.implR
	if write {
		slot = &n.implW
	}
	if *slot != nil { // opened concurrently
		h = *slot
		n.implUse++
		n.mu.Unlock()
		nh.close()
		return h, 0
	}
	*slot = nh
	n.implUse++
	n.mu.Unlock()
	n.f.addImplicit(n)
	return nh, 0
}

func (n *node) unuse() {
	n.mu.Lock()
	n.implUse--
	n.mu.Unlock()
}

// addImplicit records that n holds implicit handles and closes idle ones
// of other nodes when too many do.
func (f *FS) addImplicit(n *node) {
	var drop []*handle
	f.implMu.Lock()
	f.implNodes[n] = struct{}{}
	if len(f.implNodes) > implicitMax {
		for cn := range f.implNodes {
			if len(f.implNodes) <= implicitMax/2 {
				break
			}
			if cn == n {
				continue
			}
			cn.mu.Lock()
			if cn.implUse == 0 && !cn.implPinned && !cn.gone {
				drop = append(drop, cn.implR, cn.implW)
				cn.implR, cn.implW = nil, nil
				delete(f.implNodes, cn)
			}
			cn.mu.Unlock()
		}
	}
	f.implMu.Unlock()
	closeHandles(drop)
}

func closeHandles(hs []*handle) {
	for _, h := range hs {
		if h != nil {
			h.close() // idempotent: the same handle may come twice
		}
	}
}

// dropImplicit closes n's implicit handles (the kernel forgot n).
func (n *node) dropImplicit() {
	n.mu.Lock()
	hs := append([]*handle{n.implR, n.implW}, n.implOld...)
	n.implR, n.implW, n.implOld, n.implPinned = nil, nil, nil, false
	n.mu.Unlock()
	if hs[0] == nil && hs[1] == nil && len(hs) == 2 {
		return
	}
	f := n.f
	f.implMu.Lock()
	delete(f.implNodes, n)
	f.implMu.Unlock()
	closeHandles(hs)
}

// closeAllImplicit closes every implicit handle (unmount).
func (f *FS) closeAllImplicit() {
	f.implMu.Lock()
	nodes := make([]*node, 0, len(f.implNodes))
	for n := range f.implNodes {
		nodes = append(nodes, n)
	}
	f.implMu.Unlock()
	for _, n := range nodes {
		n.dropImplicit()
	}
}

// pinImplicit gives regular file cn, whose name (view path p, resolved as
// e) is about to go, a handle for reading and writing that outlives the
// name: the kernel may hold the file open without our knowing. The
// caller holds f.ns exclusively (a namespace change), so no implicit
// handle of cn is being opened meanwhile.
func (f *FS) pinImplicit(st *stack, cn *node, p string, e *entry) {
	if !f.noOpen() || e.isDir() || e.st.Mode&unix.S_IFMT != unix.S_IFREG || e.st.Nlink > 1 {
		return
	}
	s := e.srcs[0]
	cn.mu.Lock()
	if cn.implPinned {
		cn.mu.Unlock()
		return
	}
	h := cn.implW
	if h != nil && h.l != s.l {
		h = nil
	}
	cn.implPinned = true // not evicted from here on
	cn.mu.Unlock()
	if h == nil {
		// A read-only fd on a frozen or lower file: a write moves the
		// data into the upper first (handle.refresh).
		path, mode := s.path, unix.O_RDONLY
		if s.l == st.upper {
			path, mode = p, unix.O_RDWR
		}
		fd, err := openBeneath(s.l.fd, path, mode, 0)
		if err != nil {
			f.log.Warn("no-open: keep a file that loses its name", "path", p, "err", err)
			return
		}
		h = &handle{n: cn, fd: fd, l: s.l, flags: unix.O_RDWR, viewGen: f.viewGen.Load()}
	}
	cn.mu.Lock()
	for _, o := range []*handle{cn.implR, cn.implW} {
		if o != nil && o != h {
			cn.implOld = append(cn.implOld, o) // may be in use: closed at forget
		}
	}
	cn.implR, cn.implW = h, h
	cn.mu.Unlock()
	f.implMu.Lock()
	f.implNodes[cn] = struct{}{}
	f.implMu.Unlock()
}

// pinChild pins the node of name in directory n, if the kernel knows it.
func (n *node) pinChild(st *stack, name string, e *entry) {
	if !n.f.noOpen() {
		return
	}
	if ch := n.GetChild(name); ch != nil {
		if cn, ok := ch.Operations().(*node); ok {
			n.f.pinImplicit(st, cn, join(n.vpath(), name), e)
		}
	}
}

// Read serves a READ: through the kernel's handle, or without one (no-open
// mode) through the node's implicit handle.
func (n *node) Read(ctx context.Context, fh gofs.FileHandle, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	if fh != nil {
		if r, ok := fh.(gofs.FileReader); ok {
			return r.Read(ctx, dest, off)
		}
		return nil, syscall.ENOTSUP
	}
	h, errno := n.implicit(false)
	if errno != 0 {
		return nil, errno
	}
	defer n.unuse()
	return h.Read(ctx, dest, off)
}

// Write serves a WRITE (see Read).
func (n *node) Write(ctx context.Context, fh gofs.FileHandle, data []byte, off int64) (uint32, syscall.Errno) {
	if fh != nil {
		if w, ok := fh.(gofs.FileWriter); ok {
			return w.Write(ctx, data, off)
		}
		return 0, syscall.ENOTSUP
	}
	h, errno := n.implicit(true)
	if errno != 0 {
		return 0, errno
	}
	defer n.unuse()
	return h.Write(ctx, data, off)
}

// Fsync serves an FSYNC (see Read).
func (n *node) Fsync(ctx context.Context, fh gofs.FileHandle, flags uint32) syscall.Errno {
	if fh != nil {
		if s, ok := fh.(gofs.FileFsyncer); ok {
			return s.Fsync(ctx, flags)
		}
		return syscall.ENOTSUP
	}
	n.mu.Lock()
	h := n.implW
	if h != nil {
		n.implUse++
	}
	n.mu.Unlock()
	if h == nil {
		return 0 // never written through this mount's daemon: nothing to sync
	}
	defer n.unuse()
	return h.Fsync(ctx, flags)
}

// Allocate serves a FALLOCATE (see Read).
func (n *node) Allocate(ctx context.Context, fh gofs.FileHandle, off uint64, size uint64, mode uint32) syscall.Errno {
	if fh != nil {
		if a, ok := fh.(gofs.FileAllocater); ok {
			return a.Allocate(ctx, off, size, mode)
		}
		return syscall.ENOTSUP
	}
	h, errno := n.implicit(true)
	if errno != 0 {
		return errno
	}
	defer n.unuse()
	return h.Allocate(ctx, off, size, mode)
}

// Lseek serves an LSEEK (SEEK_DATA, SEEK_HOLE; see Read).
func (n *node) Lseek(ctx context.Context, fh gofs.FileHandle, off uint64, whence uint32) (uint64, syscall.Errno) {
	if fh != nil {
		if l, ok := fh.(gofs.FileLseeker); ok {
			return l.Lseek(ctx, off, whence)
		}
		return 0, syscall.ENOTSUP
	}
	h, errno := n.implicit(false)
	if errno != 0 {
		return 0, errno
	}
	defer n.unuse()
	f := n.f
	f.mu.RLock()
	if h.stale() {
		if errno := h.refresh(f.st, false); errno != 0 {
			f.mu.RUnlock()
			return 0, errno
		}
	}
	f.mu.RUnlock()
	return h.Lseek(ctx, off, whence)
}

// implicitForStat returns the implicit handle a GETATTR without a file
// handle should stat (the writing one first), with a use counted, or nil.
func (n *node) implicitForStat() *handle {
	if !n.f.noOpen() {
		return nil
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	h := n.implW
	if h == nil {
		h = n.implR
	}
	if h != nil {
		n.implUse++
	}
	return h
}
