package fs

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"sync/atomic"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"
)

// Request opcodes counted by rawFS, in the order RequestCounts
// reports them.
const (
	opLookup = iota
	opGetattr
	opSetattr
	opMknod
	opMkdir
	opUnlink
	opRmdir
	opRename
	opLink
	opSymlink
	opReadlink
	opAccess
	opGetxattr
	opListxattr
	opSetxattr
	opRemovexattr
	opCreate
	opOpen
	opRead
	opWrite
	opFlush
	opFsync
	opFallocate
	opRelease
	opOpendir
	opReaddir
	opReaddirplus
	opReleasedir
	opStatfs
	opLseek
	opCopyFileRange
	opStatx
	numOps
)

var opNames = [numOps]string{
	"LOOKUP", "GETATTR", "SETATTR", "MKNOD", "MKDIR", "UNLINK", "RMDIR", "RENAME", "LINK",
	"SYMLINK", "READLINK", "ACCESS", "GETXATTR", "LISTXATTR", "SETXATTR", "REMOVEXATTR",
	"CREATE", "OPEN", "READ", "WRITE", "FLUSH", "FSYNC", "FALLOCATE", "RELEASE", "OPENDIR",
	"READDIR", "READDIRPLUS", "RELEASEDIR", "STATFS", "LSEEK", "COPY_FILE_RANGE", "STATX",
}

// opCounts counts the FUSE requests a mount served, by opcode.
type opCounts [numOps]atomic.Uint64

// rawFS wraps go-fuse's node bridge: it counts every request before
// passing it on (one atomic add per request), and turns the kill-suid
// flag of a WRITE, which the node API drops, into a SETATTR.
type rawFS struct {
	fuse.RawFileSystem
	c *opCounts
	// noOpen answers OPEN and FLUSH with ENOSYS, so the kernel stops
	// sending them (and RELEASE), and drops RELEASEs of handle 0
	// (Options.NoOpen).
	noOpen bool
	// rel brackets each RELEASE, so a node knows a release of one of its
	// handles is still being finished by go-fuse (see releases).
	rel *releases
}

func (c *rawFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opLookup].Add(1)
	return c.RawFileSystem.Lookup(cancel, h, name, out)
}

func (c *rawFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	c.c[opGetattr].Add(1)
	return c.RawFileSystem.GetAttr(cancel, in, out)
}

func (c *rawFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	c.c[opSetattr].Add(1)
	return c.RawFileSystem.SetAttr(cancel, in, out)
}

func (c *rawFS) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opMknod].Add(1)
	return c.RawFileSystem.Mknod(cancel, in, name, out)
}

func (c *rawFS) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opMkdir].Add(1)
	return c.RawFileSystem.Mkdir(cancel, in, name, out)
}

func (c *rawFS) Unlink(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	c.c[opUnlink].Add(1)
	return c.RawFileSystem.Unlink(cancel, h, name)
}

func (c *rawFS) Rmdir(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	c.c[opRmdir].Add(1)
	return c.RawFileSystem.Rmdir(cancel, h, name)
}

func (c *rawFS) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	c.c[opRename].Add(1)
	return c.RawFileSystem.Rename(cancel, in, oldName, newName)
}

func (c *rawFS) Link(cancel <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opLink].Add(1)
	return c.RawFileSystem.Link(cancel, in, name, out)
}

func (c *rawFS) Symlink(cancel <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opSymlink].Add(1)
	return c.RawFileSystem.Symlink(cancel, h, target, name, out)
}

func (c *rawFS) Readlink(cancel <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	c.c[opReadlink].Add(1)
	return c.RawFileSystem.Readlink(cancel, h)
}

func (c *rawFS) Access(cancel <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	c.c[opAccess].Add(1)
	return c.RawFileSystem.Access(cancel, in)
}

func (c *rawFS) GetXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	c.c[opGetxattr].Add(1)
	return c.RawFileSystem.GetXAttr(cancel, h, attr, dest)
}

func (c *rawFS) ListXAttr(cancel <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	c.c[opListxattr].Add(1)
	return c.RawFileSystem.ListXAttr(cancel, h, dest)
}

func (c *rawFS) SetXAttr(cancel <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	c.c[opSetxattr].Add(1)
	return c.RawFileSystem.SetXAttr(cancel, in, attr, data)
}

func (c *rawFS) RemoveXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string) fuse.Status {
	c.c[opRemovexattr].Add(1)
	return c.RawFileSystem.RemoveXAttr(cancel, h, attr)
}

func (c *rawFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	c.c[opCreate].Add(1)
	return c.RawFileSystem.Create(cancel, in, name, out)
}

func (c *rawFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	c.c[opOpen].Add(1)
	if c.noOpen {
		return fuse.ENOSYS
	}
	return c.RawFileSystem.Open(cancel, in, out)
}

func (c *rawFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	c.c[opRead].Add(1)
	return c.RawFileSystem.Read(cancel, in, buf)
}

// Writev serves WRITE (go-fuse's server calls Write only when Writev
// answers ENOSYS, which the node bridge never does).
func (c *rawFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	c.c[opWrite].Add(1)
	if in.WriteFlags&fuse.WRITE_KILL_SUIDGID != 0 {
		c.killSuidgid(cancel, in.InHeader)
	}
	return c.RawFileSystem.Writev(cancel, in, data)
}

// killSuidgid drops the setuid/setgid bits a write by the caller of h
// (who lacks CAP_FSETID) drops. A failure (say, the file was unlinked)
// does not stop the write.
func (c *rawFS) killSuidgid(cancel <-chan struct{}, h fuse.InHeader) {
	in := &fuse.SetAttrIn{SetAttrInCommon: fuse.SetAttrInCommon{InHeader: h, Valid: fuse.FATTR_KILL_SUIDGID}}
	_ = c.RawFileSystem.SetAttr(cancel, in, &fuse.AttrOut{})
}

func (c *rawFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	c.c[opFlush].Add(1)
	if c.noOpen && in.Fh == 0 {
		return fuse.ENOSYS
	}
	return c.RawFileSystem.Flush(cancel, in)
}

func (c *rawFS) Fsync(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	c.c[opFsync].Add(1)
	return c.RawFileSystem.Fsync(cancel, in)
}

func (c *rawFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	c.c[opFallocate].Add(1)
	if in.Caller.Uid != 0 {
		// FALLOCATE carries no kill flag: a caller other than root is
		// taken to lack CAP_FSETID.
		c.killSuidgid(cancel, in.InHeader)
	}
	return c.RawFileSystem.Fallocate(cancel, in)
}

func (c *rawFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	c.c[opRelease].Add(1)
	if c.noOpen && in.Fh == 0 {
		return // a file created before the first OPEN: no handle
	}
	c.rel.begin(cancel)
	c.RawFileSystem.Release(cancel, in)
	c.rel.end(cancel)
}

func (c *rawFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	c.c[opOpendir].Add(1)
	return c.RawFileSystem.OpenDir(cancel, in, out)
}

func (c *rawFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	c.c[opReaddir].Add(1)
	return c.RawFileSystem.ReadDir(cancel, in, out)
}

func (c *rawFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	c.c[opReaddirplus].Add(1)
	return c.RawFileSystem.ReadDirPlus(cancel, in, out)
}

func (c *rawFS) ReleaseDir(in *fuse.ReleaseIn) {
	c.c[opReleasedir].Add(1)
	c.RawFileSystem.ReleaseDir(in)
}

func (c *rawFS) StatFs(cancel <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	c.c[opStatfs].Add(1)
	return c.RawFileSystem.StatFs(cancel, h, out)
}

func (c *rawFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	c.c[opLseek].Add(1)
	return c.RawFileSystem.Lseek(cancel, in, out)
}

func (c *rawFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	c.c[opCopyFileRange].Add(1)
	return c.RawFileSystem.CopyFileRange(cancel, in)
}

func (c *rawFS) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
	c.c[opStatx].Add(1)
	return c.RawFileSystem.Statx(cancel, in, out)
}

// RequestCounts returns how many FUSE requests of each opcode (LOOKUP,
// GETATTR, ...) the mount has served so far; opcodes never seen are left
// out. Diff two snapshots to count the round trips of a workload.
func (f *FS) RequestCounts() map[string]uint64 {
	m := map[string]uint64{}
	for i := range f.ops {
		if v := f.ops[i].Load(); v > 0 {
			m[opNames[i]] = v
		}
	}
	return m
}

// mountCounting is gofs.Mount with the bridge wrapped in a rawFS.
func mountCounting(mp string, root gofs.InodeEmbedder, o *gofs.Options, c *opCounts, rel *releases, noOpen bool) (*fuse.Server, error) {
	raw := &rawFS{RawFileSystem: gofs.NewNodeFS(root, o), c: c, noOpen: noOpen, rel: rel}
	// go-fuse opens /dev/fuse without O_CLOEXEC, so every program this
	// process starts would inherit the connection: a sandbox's init would
	// hold the connections of the other sandboxes' mounts, and once this
	// process died their requests would never be answered nor failed
	// (the connection lives while any fd holds it), leaving the sandboxes'
	// processes, the inits included, blocked for good. No fork runs
	// between the open and the fix (ForkLock; a direct mount only, which
	// starts no fusermount).
	syscall.ForkLock.Lock()
	hint := lowestFreeFD()
	srv, err := fuse.NewServer(raw, mp, &o.MountOptions)
	if err == nil {
		err = cloexecFuseFD(hint)
	}
	syscall.ForkLock.Unlock()
	if err != nil {
		if srv != nil {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
		return nil, err
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		return nil, err // as gofs.Mount: a failed mount has no loop to stop
	}
	return srv, nil
}

// lowestFreeFD returns the number the next descriptor opened will get
// (unless another goroutine opens one first), or -1.
func lowestFreeFD() int {
	fd, err := unix.Open("/dev/null", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1
	}
	unix.Close(fd)
	return fd
}

// cloexecFuseFD sets close-on-exec on the /dev/fuse descriptor a mount has
// just opened without it, which got the lowest free number, hint, unless
// another goroutine took that first: the few numbers from hint on are
// looked at, then every descriptor (cloexecFuseFDsScan). It runs under
// ForkLock at every mount, so it must be cheap: the scan of the thousand
// descriptors the daemon holds beside 64 fork children takes 2 ms, and
// holds every process start of the daemon meanwhile. Only /dev/fuse
// descriptors are touched: other code passes descriptors to children by
// leaving close-on-exec off (go-criu's swrk socket, named by number on
// criu's command line).
func cloexecFuseFD(hint int) error {
	if hint >= 0 {
		for fd := hint; fd < hint+8; fd++ {
			if flags, ok := fuseWithoutCloexec(fd); ok {
				if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, flags|unix.FD_CLOEXEC); err == nil {
					return nil
				}
			}
		}
	}
	return cloexecFuseFDsScan()
}

// fuseWithoutCloexec reports whether descriptor fd is a /dev/fuse
// connection without close-on-exec, and its descriptor flags.
func fuseWithoutCloexec(fd int) (int, bool) {
	flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
	if err != nil || flags&unix.FD_CLOEXEC != 0 {
		return 0, false
	}
	t, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	return flags, err == nil && t == "/dev/fuse"
}

// cloexecFuseFDsScan sets close-on-exec on every /dev/fuse descriptor of
// this process: only descriptors without the flag are looked at, and one
// closed since the listing (another mount going away) is skipped.
func cloexecFuseFDsScan() error {
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		return fmt.Errorf("list descriptors: %w", err)
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
		if err != nil || flags&unix.FD_CLOEXEC != 0 {
			continue
		}
		if t, err := os.Readlink("/proc/self/fd/" + e.Name()); err != nil || t != "/dev/fuse" {
			continue
		}
		if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETFD, flags|unix.FD_CLOEXEC); err != nil && !errors.Is(err, unix.EBADF) {
			return fmt.Errorf("close-on-exec on /dev/fuse descriptor %d: %w", fd, err)
		}
	}
	return nil
}
