package fs

import (
	"sync/atomic"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
)

// Request opcodes counted by countingFS, in the order RequestCounts
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

// countingFS wraps go-fuse's node bridge and counts every request before
// passing it on (one atomic add per request).
type countingFS struct {
	fuse.RawFileSystem
	c *opCounts
}

func (c *countingFS) Lookup(cancel <-chan struct{}, h *fuse.InHeader, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opLookup].Add(1)
	return c.RawFileSystem.Lookup(cancel, h, name, out)
}

func (c *countingFS) GetAttr(cancel <-chan struct{}, in *fuse.GetAttrIn, out *fuse.AttrOut) fuse.Status {
	c.c[opGetattr].Add(1)
	return c.RawFileSystem.GetAttr(cancel, in, out)
}

func (c *countingFS) SetAttr(cancel <-chan struct{}, in *fuse.SetAttrIn, out *fuse.AttrOut) fuse.Status {
	c.c[opSetattr].Add(1)
	return c.RawFileSystem.SetAttr(cancel, in, out)
}

func (c *countingFS) Mknod(cancel <-chan struct{}, in *fuse.MknodIn, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opMknod].Add(1)
	return c.RawFileSystem.Mknod(cancel, in, name, out)
}

func (c *countingFS) Mkdir(cancel <-chan struct{}, in *fuse.MkdirIn, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opMkdir].Add(1)
	return c.RawFileSystem.Mkdir(cancel, in, name, out)
}

func (c *countingFS) Unlink(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	c.c[opUnlink].Add(1)
	return c.RawFileSystem.Unlink(cancel, h, name)
}

func (c *countingFS) Rmdir(cancel <-chan struct{}, h *fuse.InHeader, name string) fuse.Status {
	c.c[opRmdir].Add(1)
	return c.RawFileSystem.Rmdir(cancel, h, name)
}

func (c *countingFS) Rename(cancel <-chan struct{}, in *fuse.RenameIn, oldName, newName string) fuse.Status {
	c.c[opRename].Add(1)
	return c.RawFileSystem.Rename(cancel, in, oldName, newName)
}

func (c *countingFS) Link(cancel <-chan struct{}, in *fuse.LinkIn, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opLink].Add(1)
	return c.RawFileSystem.Link(cancel, in, name, out)
}

func (c *countingFS) Symlink(cancel <-chan struct{}, h *fuse.InHeader, target, name string, out *fuse.EntryOut) fuse.Status {
	c.c[opSymlink].Add(1)
	return c.RawFileSystem.Symlink(cancel, h, target, name, out)
}

func (c *countingFS) Readlink(cancel <-chan struct{}, h *fuse.InHeader) ([]byte, fuse.Status) {
	c.c[opReadlink].Add(1)
	return c.RawFileSystem.Readlink(cancel, h)
}

func (c *countingFS) Access(cancel <-chan struct{}, in *fuse.AccessIn) fuse.Status {
	c.c[opAccess].Add(1)
	return c.RawFileSystem.Access(cancel, in)
}

func (c *countingFS) GetXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string, dest []byte) (uint32, fuse.Status) {
	c.c[opGetxattr].Add(1)
	return c.RawFileSystem.GetXAttr(cancel, h, attr, dest)
}

func (c *countingFS) ListXAttr(cancel <-chan struct{}, h *fuse.InHeader, dest []byte) (uint32, fuse.Status) {
	c.c[opListxattr].Add(1)
	return c.RawFileSystem.ListXAttr(cancel, h, dest)
}

func (c *countingFS) SetXAttr(cancel <-chan struct{}, in *fuse.SetXAttrIn, attr string, data []byte) fuse.Status {
	c.c[opSetxattr].Add(1)
	return c.RawFileSystem.SetXAttr(cancel, in, attr, data)
}

func (c *countingFS) RemoveXAttr(cancel <-chan struct{}, h *fuse.InHeader, attr string) fuse.Status {
	c.c[opRemovexattr].Add(1)
	return c.RawFileSystem.RemoveXAttr(cancel, h, attr)
}

func (c *countingFS) Create(cancel <-chan struct{}, in *fuse.CreateIn, name string, out *fuse.CreateOut) fuse.Status {
	c.c[opCreate].Add(1)
	return c.RawFileSystem.Create(cancel, in, name, out)
}

func (c *countingFS) Open(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	c.c[opOpen].Add(1)
	return c.RawFileSystem.Open(cancel, in, out)
}

func (c *countingFS) Read(cancel <-chan struct{}, in *fuse.ReadIn, buf []byte) (fuse.ReadResult, fuse.Status) {
	c.c[opRead].Add(1)
	return c.RawFileSystem.Read(cancel, in, buf)
}

// Writev serves WRITE (go-fuse's server calls Write only when Writev
// answers ENOSYS, which the node bridge never does).
func (c *countingFS) Writev(cancel <-chan struct{}, in *fuse.WriteIn, data [][]byte) (uint32, fuse.Status) {
	c.c[opWrite].Add(1)
	return c.RawFileSystem.Writev(cancel, in, data)
}

func (c *countingFS) Flush(cancel <-chan struct{}, in *fuse.FlushIn) fuse.Status {
	c.c[opFlush].Add(1)
	return c.RawFileSystem.Flush(cancel, in)
}

func (c *countingFS) Fsync(cancel <-chan struct{}, in *fuse.FsyncIn) fuse.Status {
	c.c[opFsync].Add(1)
	return c.RawFileSystem.Fsync(cancel, in)
}

func (c *countingFS) Fallocate(cancel <-chan struct{}, in *fuse.FallocateIn) fuse.Status {
	c.c[opFallocate].Add(1)
	return c.RawFileSystem.Fallocate(cancel, in)
}

func (c *countingFS) Release(cancel <-chan struct{}, in *fuse.ReleaseIn) {
	c.c[opRelease].Add(1)
	c.RawFileSystem.Release(cancel, in)
}

func (c *countingFS) OpenDir(cancel <-chan struct{}, in *fuse.OpenIn, out *fuse.OpenOut) fuse.Status {
	c.c[opOpendir].Add(1)
	return c.RawFileSystem.OpenDir(cancel, in, out)
}

func (c *countingFS) ReadDir(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	c.c[opReaddir].Add(1)
	return c.RawFileSystem.ReadDir(cancel, in, out)
}

func (c *countingFS) ReadDirPlus(cancel <-chan struct{}, in *fuse.ReadIn, out *fuse.DirEntryList) fuse.Status {
	c.c[opReaddirplus].Add(1)
	return c.RawFileSystem.ReadDirPlus(cancel, in, out)
}

func (c *countingFS) ReleaseDir(in *fuse.ReleaseIn) {
	c.c[opReleasedir].Add(1)
	c.RawFileSystem.ReleaseDir(in)
}

func (c *countingFS) StatFs(cancel <-chan struct{}, h *fuse.InHeader, out *fuse.StatfsOut) fuse.Status {
	c.c[opStatfs].Add(1)
	return c.RawFileSystem.StatFs(cancel, h, out)
}

func (c *countingFS) Lseek(cancel <-chan struct{}, in *fuse.LseekIn, out *fuse.LseekOut) fuse.Status {
	c.c[opLseek].Add(1)
	return c.RawFileSystem.Lseek(cancel, in, out)
}

func (c *countingFS) CopyFileRange(cancel <-chan struct{}, in *fuse.CopyFileRangeIn) (uint32, fuse.Status) {
	c.c[opCopyFileRange].Add(1)
	return c.RawFileSystem.CopyFileRange(cancel, in)
}

func (c *countingFS) Statx(cancel <-chan struct{}, in *fuse.StatxIn, out *fuse.StatxOut) fuse.Status {
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

// mountCounting is gofs.Mount with the bridge wrapped in a countingFS.
func mountCounting(mp string, root gofs.InodeEmbedder, o *gofs.Options, c *opCounts) (*fuse.Server, error) {
	raw := &countingFS{RawFileSystem: gofs.NewNodeFS(root, o), c: c}
	srv, err := fuse.NewServer(raw, mp, &o.MountOptions)
	if err != nil {
		return nil, err
	}
	go srv.Serve()
	if err := srv.WaitMount(); err != nil {
		return nil, err // as gofs.Mount: a failed mount has no loop to stop
	}
	return srv, nil
}
