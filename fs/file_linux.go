package fs

import (
	"context"
	"sync"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/pause"
)

// handle is an open file. Its host fd lives in layer l; a write through a
// handle whose fd is not in the current upper first copies the file up and
// reopens it there (lazy fd redirection), so frozen layers are never
// written. After a switch the handle follows its path into the new view.
type handle struct {
	n       *node
	mu      sync.Mutex
	fd      int
	l       *layerDir
	flags   uint32
	viewGen uint64
	// pt is set on a handle the kernel serves by passthrough: its fd is
	// the registered backing file and is never re-targeted for reads.
	pt bool
}

var (
	_ gofs.FileReader    = (*handle)(nil)
	_ gofs.FileWriter    = (*handle)(nil)
	_ gofs.FileReleaser  = (*handle)(nil)
	_ gofs.FileFsyncer   = (*handle)(nil)
	_ gofs.FileFlusher   = (*handle)(nil)
	_ gofs.FileGetattrer = (*handle)(nil)
	_ gofs.FileAllocater = (*handle)(nil)
	_ gofs.FileLseeker   = (*handle)(nil)
)

// hostFlags maps FUSE open flags to the flags of the host fd.
func hostFlags(flags uint32, write bool) int {
	f := int(flags) & (unix.O_ACCMODE | unix.O_APPEND | unix.O_SYNC | unix.O_DSYNC)
	if !write {
		f &^= unix.O_ACCMODE | unix.O_APPEND
		f |= unix.O_RDONLY
	}
	return f
}

func wantsWrite(flags uint32) bool {
	return flags&unix.O_ACCMODE != unix.O_RDONLY || flags&unix.O_TRUNC != 0
}

// Open opens a regular file; opening for writing copies it up first.
func (n *node) Open(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	write := wantsWrite(flags)
	if write && n.f.opts.Passthrough {
		n.awaitPassthroughRelease(ctx)
	}
	st, done, errno := n.begin(write)
	if errno != 0 {
		return nil, 0, errno
	}
	defer done()
	h, fd, errno := n.openHandle(st, flags, write)
	if errno != 0 {
		return nil, 0, errno
	}
	f := n.f
	l := h.l
	// Passthrough for files whose data is in the writable upper: the kernel
	// reads and writes the backing file itself. A checkpoint moves such a
	// file's inode into the new upper (and leaves a copy in the frozen
	// layer), so the backing stays writable and no frozen layer is written.
	// With PassthroughLower, read-only opens of a file in a frozen or
	// lower layer (which never changes) are passed through too; see
	// node.ptLower for what happens when the name moves on.
	var s unix.Stat_t
	reg := f.opts.Passthrough && unix.Fstat(fd, &s) == nil && s.Mode&unix.S_IFMT == unix.S_IFREG
	inUpperReg := reg && l == st.upper
	lowerRO := reg && f.opts.PassthroughLower && !write && l != st.upper && s.Nlink == 1
	canPT := inUpperReg && s.Nlink == 1
	n.mu.Lock()
	switch {
	case n.ptLower != nil:
		// Pinned to one lower file for good: only that file again.
		canPT = lowerRO && n.ptLower == l && n.ptIno == s.Ino
		if !canPT {
			n.mu.Unlock()
			unix.Close(fd)
			return nil, 0, syscall.ESTALE
		}
	case n.ptOpen > 0 && inUpperReg && n.ptIno == s.Ino:
		// The registered backing is this very inode (also when it got
		// another name since): share it.
		canPT = true
	case n.ptOpen > 0:
		// Open through a stale node still pinned by passthrough handles
		// on another backing file: the kernel cannot mix io modes.
		n.mu.Unlock()
		unix.Close(fd)
		return nil, 0, syscall.ESTALE
	case lowerRO && n.cachedOpen == 0 && n.releasing == 0 && n.ptIno == 0:
		// Only on a node that never had a passthrough handle: go-fuse
		// reuses a node's registered backing until it has processed the
		// last RELEASE, which comes after ours.
		canPT = true
		n.ptLower = l
	case canPT && n.cachedOpen == 0 && n.releasing == 0 && !(write && s.Mode&(unix.S_ISUID|unix.S_ISGID) != 0):
		// (A write through passthrough never reaches us, so a setuid or
		// setgid file opened for writing is served by the daemon, which
		// drops those bits as the kernel would.)
	default:
		canPT = false
	}
	if canPT {
		n.ptOpen++
		n.ptIno = s.Ino
		h.pt = true
		if write {
			n.ptWrite++
		}
	} else {
		n.cachedOpen++
	}
	n.mu.Unlock()
	if canPT {
		f.ptMu.Lock()
		f.ptNodes[n] = struct{}{}
		f.ptMu.Unlock()
		if write {
			f.record("modify", n, "", 0)
		}
		return &ptHandle{handle: h, write: write}, fuse.FOPEN_NOFLUSH, 0
	}
	return h, fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH, 0
}

// openHandle opens n's top file as a handle with the open flags flags
// (write: for writing, after copying it up). It returns the handle and
// its fd. The caller holds what n.begin(write) took.
func (n *node) openHandle(st *stack, flags uint32, write bool) (*handle, int, syscall.Errno) {
	trunc := flags&unix.O_TRUNC != 0
	if write {
		if err := n.f.copyUp(st, n, trunc); err != nil {
			return nil, -1, errnoOf(err)
		}
	}
	l, p := n.top(st)
	hf := hostFlags(flags, write)
	if trunc {
		hf |= unix.O_TRUNC
	}
	fd, err := openBeneath(l.fd, p, hf, 0)
	if err != nil {
		return nil, -1, errnoOf(err)
	}
	if trunc {
		n.f.dirty.Store(true)
		n.f.record("modify", n, "", 0)
	}
	if write {
		n.f.dirty.Store(true)
	}
	return &handle{n: n, fd: fd, l: l, flags: flags, viewGen: n.f.viewGen.Load()}, fd, 0
}

// ptHandle is a handle served by FUSE passthrough (when the kernel took
// it; otherwise its methods serve requests like a plain handle).
type ptHandle struct {
	*handle
	write bool
}

// ptReleaseWait bounds how long a write open of a setuid or setgid file
// waits for the RELEASE of the node's last passthrough handle.
const ptReleaseWait = 200 * time.Millisecond

// awaitPassthroughRelease is called before a write open. A setuid or
// setgid file opened for writing by a caller whose write must drop those
// bits is served by the daemon, not passed through: a passthrough write
// never reaches the daemon, and with FUSE_HANDLE_KILLPRIV_V2 the kernel
// leaves the dropping to it. But while the node still counts an open
// passthrough handle, the open has to share it (the kernel takes one io
// mode per inode). The kernel sends a closed file's RELEASE only after
// close(2) has returned, so a handle closed just before the open (the
// file was created, then chmod +s) can still be counted: wait for that
// RELEASE, for at most ptReleaseWait. A passthrough handle that really is
// still open keeps its bits on such a write (a documented gap of
// passthrough mode), as they would through the open handle itself.
func (n *node) awaitPassthroughRelease(ctx context.Context) {
	n.mu.Lock()
	busy := n.ptOpen > 0 && n.ptLower == nil
	n.mu.Unlock()
	if !busy {
		return
	}
	var s unix.Stat_t
	if n.statTop(&s) != 0 || dropBits(ctx, &s) == 0 {
		return
	}
	deadline := time.Now().Add(ptReleaseWait)
	for delay := 20 * time.Microsecond; ; {
		n.mu.Lock()
		idle := n.ptOpen == 0 && n.releasing == 0
		n.mu.Unlock()
		if idle || time.Now().After(deadline) || ctx.Err() != nil {
			return
		}
		pause.For(delay)
		delay = min(2*delay, time.Millisecond)
	}
}

var _ gofs.FilePassthroughFder = (*ptHandle)(nil)

// PassthroughFd hands the backing fd to the kernel.
func (p *ptHandle) PassthroughFd() (int, bool) { return p.fd, true }

// Release closes the backing fd and drops the node's passthrough count.
func (p *ptHandle) Release(ctx context.Context) syscall.Errno {
	n := p.n
	n.f.rel.attach(ctx, n)
	n.mu.Lock()
	n.ptOpen--
	if p.write {
		n.ptWrite--
	}
	last := n.ptOpen == 0
	n.mu.Unlock()
	if last {
		n.f.ptMu.Lock()
		delete(n.f.ptNodes, n)
		n.f.ptMu.Unlock()
	}
	return p.handle.close()
}

func (h *handle) writableIn(u *layerDir) bool {
	return h.l == u && h.flags&unix.O_ACCMODE != unix.O_RDONLY
}

// refresh re-targets the handle after a switch (for reads) or into the
// upper (for writes). The caller holds f.mu shared and not h.mu.
func (h *handle) refresh(st *stack, forWrite bool) syscall.Errno {
	f := h.n.f
	if forWrite {
		f.ns.Lock()
		defer f.ns.Unlock()
	} else {
		f.ns.RLock()
		defer f.ns.RUnlock()
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	vg := f.viewGen.Load()
	if h.viewGen == vg && (forWrite && h.l == st.upper || !forWrite && !h.movedLocked()) {
		return 0
	}
	n := h.n
	gone := n.resolve(st, f.gen.Load()) != 0
	if gone {
		// The file does not exist in the view (any more): keep the old
		// fd, as for an unlinked open file.
		h.viewGen = vg
		if !forWrite || h.l == st.upper {
			return 0
		}
	}
	if gone {
		// An unlinked file whose fd is in a frozen layer: move its data
		// to an anonymous file in the upper.
		tmp, err := openBeneath(st.upper.fd, ".", unix.O_TMPFILE|unix.O_RDWR, 0o600)
		if err != nil {
			return errnoOf(err)
		}
		var s unix.Stat_t
		if err := unix.Fstat(h.fd, &s); err != nil {
			unix.Close(tmp)
			return errnoOf(err)
		}
		if err := copyData(h.fd, tmp, s.Size); err != nil {
			unix.Close(tmp)
			return errnoOf(err)
		}
		unix.Close(h.fd)
		h.fd, h.l = tmp, st.upper
		return 0
	}
	if forWrite {
		if err := f.copyUp(st, n, false); err != nil {
			return errnoOf(err)
		}
	}
	l, p := n.top(st)
	hf := hostFlags(h.flags, forWrite || h.flags&unix.O_ACCMODE != unix.O_RDONLY && l == st.upper)
	fd, err := openBeneath(l.fd, p, hf, 0)
	if err != nil {
		return errnoOf(err)
	}
	unix.Close(h.fd)
	h.fd, h.l, h.viewGen = fd, l, vg
	return 0
}

// Read reads at off.
func (h *handle) Read(ctx context.Context, dest []byte, off int64) (fuse.ReadResult, syscall.Errno) {
	f := h.n.f
	f.reads.Add(1)
	f.mu.RLock()
	defer f.mu.RUnlock()
	if h.stale() {
		if errno := h.refresh(f.st, false); errno != 0 {
			return nil, errno
		}
	}
	h.mu.Lock()
	k, err := unix.Pread(h.fd, dest, off)
	h.mu.Unlock()
	if err != nil {
		return nil, errnoOf(err)
	}
	return fuse.ReadResultData(dest[:k]), 0
}

// stale reports whether a read or a stat through h must first re-target
// it (refresh): a switch changed the view, or another descriptor copied the
// file up since h was opened, so h's fd, still in a lower or frozen layer,
// no longer holds the file's content. (go-fuse answers a GETATTR without a
// file handle through any open handle of the node, so a stale read-only
// handle would hand the kernel the old size: an append through another
// descriptor then looked lost.)
func (h *handle) stale() bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	return h.viewGen != h.n.f.viewGen.Load() || h.movedLocked()
}

// movedLocked reports whether the node's content now lives in another
// layer than h's fd (a copy-up through another descriptor). Passthrough
// handles keep their backing file. The caller holds h.mu.
func (h *handle) movedLocked() bool {
	if h.pt {
		return false
	}
	n := h.n
	n.mu.Lock()
	defer n.mu.Unlock()
	return !n.gone && len(n.srcs) > 0 && n.srcs[0].l != h.l
}

// prepareWrite makes sure the handle's fd is writable in the current upper.
// The caller holds f.mu shared.
func (h *handle) prepareWrite(st *stack) syscall.Errno {
	h.mu.Lock()
	ok := h.l == st.upper && h.viewGen == h.n.f.viewGen.Load()
	h.mu.Unlock()
	if ok {
		return 0
	}
	return h.refresh(st, true)
}

// Write writes at off, redirecting into the current upper first if needed.
func (h *handle) Write(ctx context.Context, data []byte, off int64) (uint32, syscall.Errno) {
	f := h.n.f
	f.writes.Add(1)
	f.mu.RLock()
	defer f.mu.RUnlock()
	if errno := h.prepareWrite(f.st); errno != 0 {
		return 0, errno
	}
	h.mu.Lock()
	k, err := unix.Pwrite(h.fd, data, off)
	h.mu.Unlock()
	if err != nil {
		return 0, errnoOf(err)
	}
	f.dirty.Store(true)
	f.record("modify", h.n, "", uint64(k))
	return uint32(k), 0
}

// Allocate implements fallocate.
func (h *handle) Allocate(ctx context.Context, off uint64, size uint64, mode uint32) syscall.Errno {
	f := h.n.f
	f.mu.RLock()
	defer f.mu.RUnlock()
	if errno := h.prepareWrite(f.st); errno != 0 {
		return errno
	}
	h.mu.Lock()
	err := unix.Fallocate(h.fd, mode, int64(off), int64(size))
	h.mu.Unlock()
	if err != nil {
		return errnoOf(err)
	}
	f.dirty.Store(true)
	f.record("modify", h.n, "", 0)
	return 0
}

// Getattr stats the open file.
func (h *handle) Getattr(ctx context.Context, out *fuse.AttrOut) syscall.Errno {
	f := h.n.f
	f.mu.RLock()
	defer f.mu.RUnlock()
	if h.stale() {
		if errno := h.refresh(f.st, false); errno != 0 {
			return errno
		}
	}
	h.mu.Lock()
	var s unix.Stat_t
	err := unix.Fstat(h.fd, &s)
	h.mu.Unlock()
	if err != nil {
		return errnoOf(err)
	}
	fillAttr(&out.Attr, &s, h.n.StableAttr().Ino)
	return 0
}

// Lseek supports SEEK_DATA and SEEK_HOLE.
func (h *handle) Lseek(ctx context.Context, off uint64, whence uint32) (uint64, syscall.Errno) {
	h.mu.Lock()
	defer h.mu.Unlock()
	r, err := unix.Seek(h.fd, int64(off), int(whence))
	if err != nil {
		return 0, errnoOf(err)
	}
	return uint64(r), 0
}

// Fsync flushes the host file.
func (h *handle) Fsync(ctx context.Context, flags uint32) syscall.Errno {
	h.mu.Lock()
	defer h.mu.Unlock()
	if err := unix.Fsync(h.fd); err != nil && err != unix.EBADF && err != unix.EINVAL {
		return errnoOf(err)
	}
	return 0
}

// Flush is a no-op: data goes to the host file on every write. Handles
// are opened with FOPEN_NOFLUSH, so the kernel does not even send it on
// close (one round trip less per close; shared mappings are written back
// when they are unmapped).
func (h *handle) Flush(ctx context.Context) syscall.Errno { return 0 }

// Release closes the host fd.
func (h *handle) Release(ctx context.Context) syscall.Errno {
	h.n.f.rel.attach(ctx, h.n)
	h.n.mu.Lock()
	h.n.cachedOpen--
	h.n.mu.Unlock()
	return h.close()
}

func (h *handle) close() syscall.Errno {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.fd >= 0 {
		unix.Close(h.fd)
		h.fd = -1
	}
	return 0
}
