package fs

import (
	"context"
	"strconv"
	"strings"
	"sync"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/procfs"
	"github.com/rewind-sandbox/rewind/layer"
)

// node is one inode of the view. Its resolution (srcs) is valid for the
// generation gen; a checkpoint or switch makes it stale and the next use
// re-resolves it through its parent.
type node struct {
	gofs.Inode
	f *FS

	mu   sync.Mutex
	gen  uint64
	srcs []src // top-down
	gone bool  // does not exist in the view of generation gen

	// unlinked is set when the kernel may no longer hold a positive
	// dentry for this node under its name (a switch invalidated the
	// entry, or a lookup of the name failed since): the next switch must
	// invalidate the name again, even if the node is a directory on both
	// sides, or a negative dentry cached in between would hide it. Cleared
	// when a lookup hands the node to the kernel again.
	unlinked bool

	// Passthrough bookkeeping: the kernel registers one backing file per
	// inode and reuses it for every passthrough open while one is open, so
	// a new passthrough handle is only handed out when the registered
	// backing (ptLayer, ptPath) is still the entry's data.
	ptOpen     int    // open passthrough handles
	ptWrite    int    // ... of which writable
	cachedOpen int    // open non-passthrough handles
	ptIno      uint64 // backing inode of the passthrough handles
	// releasing counts this node's handles in a RELEASE that go-fuse has
	// not finished (it drops their backing reference last; see
	// releases): until it has, no handle may start a passthrough epoch.
	releasing int
	// ptLower is set once the node served a read-only passthrough handle
	// on a file in a frozen or lower layer (Options.PassthroughLower),
	// and stays set: go-fuse may still hold that backing registered after
	// the last such handle is closed, so the node only ever opens that
	// very file (ptLower, ptIno) again; once its name resolves elsewhere
	// (a copy-up, a switch) the name gets a new node (same inode number,
	// next generation) and opens through this one fail with ESTALE, which
	// makes the kernel look the name up again.
	ptLower *layerDir

	// Implicit handles (Options.NoOpen), guarded by mu: the handles
	// serving requests that come without one, for reading and for
	// writing; implUse counts requests using them; implPinned is set
	// once the node lost its name while the kernel may hold it open
	// (they then stay until the kernel forgets the node).
	implR, implW *handle
	implOld      []*handle // replaced by pinning while maybe in use
	implUse      int
	implPinned   bool
}

var (
	_ gofs.NodeLookuper      = (*node)(nil)
	_ gofs.NodeGetattrer     = (*node)(nil)
	_ gofs.NodeSetattrer     = (*node)(nil)
	_ gofs.NodeReaddirer     = (*node)(nil)
	_ gofs.NodeMkdirer       = (*node)(nil)
	_ gofs.NodeMknoder       = (*node)(nil)
	_ gofs.NodeCreater       = (*node)(nil)
	_ gofs.NodeSymlinker     = (*node)(nil)
	_ gofs.NodeLinker        = (*node)(nil)
	_ gofs.NodeUnlinker      = (*node)(nil)
	_ gofs.NodeRmdirer       = (*node)(nil)
	_ gofs.NodeRenamer       = (*node)(nil)
	_ gofs.NodeReadlinker    = (*node)(nil)
	_ gofs.NodeOpener        = (*node)(nil)
	_ gofs.NodeStatfser      = (*node)(nil)
	_ gofs.NodeGetxattrer    = (*node)(nil)
	_ gofs.NodeSetxattrer    = (*node)(nil)
	_ gofs.NodeListxattrer   = (*node)(nil)
	_ gofs.NodeRemovexattrer = (*node)(nil)
	_ gofs.NodeOnForgetter   = (*node)(nil)
)

// vpath is the node's path in the view, "." for the root.
func (n *node) vpath() string {
	p := n.Path(nil)
	if p == "" {
		return "."
	}
	return p
}

func (n *node) isRoot() bool { return n == n.f.root }

// resolve makes n's resolution current for stack st at generation gen. The
// caller holds f.mu (shared) and f.ns (shared or exclusive).
func (n *node) resolve(st *stack, gen uint64) syscall.Errno {
	n.mu.Lock()
	if n.gen == gen {
		gone := n.gone
		n.mu.Unlock()
		if gone {
			return syscall.ENOENT
		}
		return 0
	}
	n.mu.Unlock()
	if n.isRoot() {
		n.mu.Lock()
		n.srcs, n.gen, n.gone = rootSrcs(st), gen, false
		n.mu.Unlock()
		return 0
	}
	name, pin := n.Parent()
	var e entry
	found := false
	if pin != nil {
		p := pin.Operations().(*node)
		if errno := p.resolve(st, gen); errno == 0 {
			var err error
			e, found, err = lookupEntry(st, p.getSrcs(), p.vpath(), name, false)
			if err != nil {
				return errnoOf(err)
			}
		}
	}
	n.mu.Lock()
	defer n.mu.Unlock()
	if !found || e.st.Mode&unix.S_IFMT != n.StableAttr().Mode&unix.S_IFMT {
		n.gen, n.gone = gen, true
		return syscall.ENOENT
	}
	n.srcs, n.gen, n.gone = e.srcs, gen, false
	return 0
}

func (n *node) getSrcs() []src {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.srcs
}

func (n *node) setSrcs(srcs []src, gen uint64) {
	n.mu.Lock()
	n.srcs, n.gen, n.gone = srcs, gen, false
	n.mu.Unlock()
}

// setUnlinked records whether the kernel may have dropped n's dentry.
func (n *node) setUnlinked(v bool) {
	n.mu.Lock()
	n.unlinked = v
	n.mu.Unlock()
}

func (n *node) isUnlinked() bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	return n.unlinked
}

// top returns the layer and host-relative path of the entry's top source.
func (n *node) top(st *stack) (*layerDir, string) {
	s := n.getSrcs()[0]
	if s.l == st.upper {
		return s.l, n.vpath()
	}
	return s.l, s.path
}

func (n *node) inUpper(st *stack) bool { return n.getSrcs()[0].l == st.upper }

// begin takes the shared barrier and resolves n. The returned function
// releases what was taken.
func (n *node) begin(excl bool) (*stack, func(), syscall.Errno) {
	f := n.f
	f.mu.RLock()
	if excl {
		f.ns.Lock()
	} else {
		f.ns.RLock()
	}
	done := func() {
		if excl {
			f.ns.Unlock()
		} else {
			f.ns.RUnlock()
		}
		f.mu.RUnlock()
	}
	st := f.st
	if errno := n.resolve(st, f.gen.Load()); errno != 0 {
		done()
		return nil, nil, errno
	}
	return st, done, 0
}

func fillAttr(out *fuse.Attr, st *unix.Stat_t, ino uint64) {
	var s syscall.Stat_t
	s.Dev, s.Ino, s.Nlink, s.Mode = st.Dev, st.Ino, st.Nlink, st.Mode
	s.Uid, s.Gid, s.Rdev, s.Size = st.Uid, st.Gid, st.Rdev, st.Size
	s.Blksize, s.Blocks = st.Blksize, st.Blocks
	s.Atim = syscall.Timespec(st.Atim)
	s.Mtim = syscall.Timespec(st.Mtim)
	s.Ctim = syscall.Timespec(st.Ctim)
	out.FromStat(&s)
	out.Ino = ino
}

// child returns the node for entry e named name in directory n, reusing a
// known node of the same type.
func (n *node) child(ctx context.Context, name string, e *entry, gen uint64, fresh bool) *gofs.Inode {
	f := n.f
	mode := e.st.Mode & unix.S_IFMT
	if !fresh {
		if ch := n.GetChild(name); ch != nil && ch.StableAttr().Mode == mode {
			if cn, ok := ch.Operations().(*node); ok && !cn.pinnedElsewhere(e) {
				cn.setSrcs(e.srcs, gen)
				cn.setUnlinked(false)
				f.aliasIno(e.srcs[0].l, e.st.Ino, ch.StableAttr().Ino)
				return ch
			}
		}
	}
	var ino uint64
	if fresh {
		ino = f.freshIno(e.srcs[0].l, e.st.Ino)
	} else {
		ino = f.inoFor(e.srcs[0].l, e.st.Ino)
	}
	f.inoMu.Lock()
	// A node the kernel has forgotten may still be in the table: go-fuse
	// detaches it before it calls OnForget. It holds nothing open, so it
	// does not keep its number from this name. (Forgotten is deprecated
	// in favour of OnForget, which comes too late for this window: a
	// node handed out here would be revived, and then dropped from the
	// table by its pending OnForget.)
	//lint:ignore SA1019 no other way to see the window before OnForget
	if cn := f.nodes[ino]; cn != nil && !fresh && !cn.Forgotten() {
		// Another name of a live node: a hard link of the same inode is
		// shared; anything else is a stale key (a reused backing inode
		// number) and gets a fresh number.
		if mode != unix.S_IFDIR && cn.StableAttr().Mode == mode && e.st.Nlink > 1 && !cn.pinnedElsewhere(e) {
			f.inoMu.Unlock()
			cn.setSrcs(e.srcs, gen)
			cn.setUnlinked(false)
			return cn.EmbeddedInode()
		}
		if cn.StableAttr().Mode == mode && cn.pinnedElsewhere(e) && cn.lowerPinnedAt(n.EmbeddedInode(), name) {
			// The same file, whose node is pinned to its old backing
			// (a read passthrough on the lower copy): a new node of
			// the next generation, the inode number stays.
			g := max(cn.StableAttr().Gen, f.inoGen[ino]) + 1
			f.inoGen[ino] = g
			f.inoMu.Unlock()
			return n.newChild(ctx, &node{f: f, gen: gen, srcs: e.srcs}, gofs.StableAttr{Mode: mode, Ino: ino, Gen: g})
		}
		f.inoMu.Unlock()
		ino = f.freshIno(e.srcs[0].l, e.st.Ino)
		f.inoMu.Lock()
	}
	// The latest generation of the number: an older node of it may still
	// be alive, pinned to a lower backing (go-fuse would hand that one
	// out again for the same StableAttr).
	g := f.inoGen[ino]
	f.inoMu.Unlock()
	return n.newChild(ctx, &node{f: f, gen: gen, srcs: e.srcs}, gofs.StableAttr{Mode: mode, Ino: ino, Gen: g})
}

// newChild initializes cn's inode and only then publishes it in the inode
// table, where concurrent lookups read its attributes.
func (n *node) newChild(ctx context.Context, cn *node, sa gofs.StableAttr) *gofs.Inode {
	ch := n.NewInode(ctx, cn, sa)
	f := n.f
	f.inoMu.Lock()
	f.nodes[sa.Ino] = cn
	f.inoMu.Unlock()
	return ch
}

// OnForget drops the node from the inode table and closes its implicit
// handles.
func (n *node) OnForget() {
	n.dropImplicit()
	f := n.f
	ino := n.StableAttr().Ino
	f.inoMu.Lock()
	if f.nodes[ino] == n {
		delete(f.nodes, ino)
	}
	f.inoMu.Unlock()
}

// Lookup resolves name in the merged view.
func (n *node) Lookup(ctx context.Context, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	st, done, errno := n.begin(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	gen := n.f.gen.Load()
	e, found, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, false)
	if err != nil {
		return nil, errnoOf(err)
	}
	if !found {
		// The kernel caches the miss (a negative dentry) while a node
		// of the name may live on (held open): see node.unlinked.
		if ch := n.GetChild(name); ch != nil {
			if cn, ok := ch.Operations().(*node); ok {
				cn.setUnlinked(true)
			}
		}
		return nil, syscall.ENOENT
	}
	ch := n.child(ctx, name, &e, gen, false)
	fillAttr(&out.Attr, &e.st, ch.StableAttr().Ino)
	return ch, 0
}

// Getattr returns the attributes of the top source (or of the open handle).
func (n *node) Getattr(ctx context.Context, fh gofs.FileHandle, out *fuse.AttrOut) syscall.Errno {
	if h, ok := fh.(*handle); ok {
		return h.Getattr(ctx, out)
	}
	if h := n.implicitForStat(); h != nil {
		defer n.unuse()
		return h.Getattr(ctx, out)
	}
	st, done, errno := n.begin(false)
	if errno != 0 {
		return errno
	}
	defer done()
	l, p := n.top(st)
	var s unix.Stat_t
	if err := unix.Fstatat(l.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return errnoOf(err)
	}
	fillAttr(&out.Attr, &s, n.StableAttr().Ino)
	return 0
}

// Setattr applies chmod/chown/truncate/utimens to the upper copy.
//
// The mount negotiates FUSE_HANDLE_KILLPRIV_V2, so dropping setuid/setgid
// bits is ours: FATTR_KILL_SUIDGID comes with a truncate or a write (see
// rawFS.Writev) by a caller without CAP_FSETID; a chown drops them on the
// host by itself. File capabilities need nothing: the host drops them on
// every write, truncate and chown of the upper copy.
func (n *node) Setattr(ctx context.Context, fh gofs.FileHandle, in *fuse.SetAttrIn, out *fuse.AttrOut) syscall.Errno {
	f := n.f
	kill := in.Valid&fuse.FATTR_KILL_SUIDGID != 0
	if kill && in.Valid&^(fuse.FATTR_KILL_SUIDGID|fuse.FATTR_FH|fuse.FATTR_LOCKOWNER) == 0 {
		// Only the kill (before a write): nothing to do, and no copy-up,
		// unless the entry has a bit to drop.
		var s unix.Stat_t
		if errno := n.statTop(&s); errno != 0 {
			return errno
		}
		if dropBits(ctx, &s) == 0 {
			fillAttr(&out.Attr, &s, n.StableAttr().Ino)
			out.SetTimeout(f.opts.CacheTimeout)
			return 0
		}
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return errno
	}
	defer done()
	size, hasSize := in.GetSize()
	if err := f.copyUp(st, n, hasSize && size == 0); err != nil {
		return errnoOf(err)
	}
	_, p := n.top(st)
	u := st.upper
	if m, ok := in.GetMode(); ok {
		if err := unix.Fchmodat(u.fd, p, m&07777, 0); err != nil {
			return errnoOf(err)
		}
	}
	uid, hasUID := in.GetUID()
	gid, hasGID := in.GetGID()
	if hasUID || hasGID {
		iu, ig := -1, -1
		if hasUID {
			iu = int(uid)
		}
		if hasGID {
			ig = int(gid)
		}
		if err := unix.Fchownat(u.fd, p, iu, ig, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return errnoOf(err)
		}
		kill = false // the host's chown dropped them
	}
	if hasSize {
		var err error
		if h, ok := fh.(*handle); ok && h.writableIn(u) {
			err = unix.Ftruncate(h.fd, int64(size))
		} else {
			var fd int
			fd, err = openBeneath(u.fd, p, unix.O_WRONLY, 0)
			if err == nil {
				err = unix.Ftruncate(fd, int64(size))
				unix.Close(fd)
			}
		}
		if err != nil {
			return errnoOf(err)
		}
		f.record("modify", n, "", 0)
	} else {
		f.record("meta", n, "", 0)
	}
	if kill {
		var s unix.Stat_t
		if err := unix.Fstatat(u.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return errnoOf(err)
		}
		if drop := dropBits(ctx, &s); drop != 0 {
			if err := unix.Fchmodat(u.fd, p, s.Mode&07777&^drop, 0); err != nil {
				return errnoOf(err)
			}
		}
	}
	atime, hasA := in.GetATime()
	mtime, hasM := in.GetMTime()
	if hasA || hasM {
		ts := []unix.Timespec{{Nsec: unix.UTIME_OMIT}, {Nsec: unix.UTIME_OMIT}}
		if hasA {
			ts[0] = unix.NsecToTimespec(atime.UnixNano())
			if in.Valid&fuse.FATTR_ATIME_NOW != 0 {
				ts[0] = unix.Timespec{Nsec: unix.UTIME_NOW}
			}
		}
		if hasM {
			ts[1] = unix.NsecToTimespec(mtime.UnixNano())
			if in.Valid&fuse.FATTR_MTIME_NOW != 0 {
				ts[1] = unix.Timespec{Nsec: unix.UTIME_NOW}
			}
		}
		if err := unix.UtimesNanoAt(u.fd, p, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return errnoOf(err)
		}
	}
	var s unix.Stat_t
	if err := unix.Fstatat(u.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return errnoOf(err)
	}
	fillAttr(&out.Attr, &s, n.StableAttr().Ino)
	// go-fuse leaves a SETATTR reply's timeout at 0, which would make the
	// kernel ask again (GETATTR) right after every chmod/chown/utimens.
	out.SetTimeout(f.opts.CacheTimeout)
	return 0
}

// statTop stats the entry's top source.
func (n *node) statTop(s *unix.Stat_t) syscall.Errno {
	st, done, errno := n.begin(false)
	if errno != 0 {
		return errno
	}
	defer done()
	l, p := n.top(st)
	return errnoOf(unix.Fstatat(l.fd, p, s, unix.AT_SYMLINK_NOFOLLOW))
}

// dropBits is the kernel's rule for a write or truncate by a caller
// without CAP_FSETID: setuid goes; setgid goes when the group may execute
// the file or the caller is not in the file's group.
func dropBits(ctx context.Context, s *unix.Stat_t) uint32 {
	if s.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0
	}
	var drop uint32
	if s.Mode&unix.S_ISUID != 0 {
		drop |= unix.S_ISUID
	}
	if s.Mode&unix.S_ISGID != 0 && (s.Mode&unix.S_IXGRP != 0 || !callerInGroup(ctx, s.Gid)) {
		drop |= unix.S_ISGID
	}
	return drop
}

// callerInGroup reports whether the caller of a request is in group gid
// (its primary group, or a supplementary one as /proc lists them).
func callerInGroup(ctx context.Context, gid uint32) bool {
	c, ok := fuse.FromContext(ctx)
	if !ok {
		return true
	}
	if c.Gid == gid {
		return true
	}
	if c.Pid == 0 {
		return false
	}
	b, err := procfs.ReadFile(procfs.PIDPath(int(c.Pid), "status"))
	if err != nil {
		return false
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "Groups:"); ok {
			for _, g := range strings.Fields(rest) {
				if g == strconv.FormatUint(uint64(gid), 10) {
					return true
				}
			}
		}
	}
	return false
}

// Readdir lists the merged directory.
func (n *node) Readdir(ctx context.Context) (gofs.DirStream, syscall.Errno) {
	st, done, errno := n.begin(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	ents, err := readMerged(st, n.getSrcs(), n.vpath())
	if err != nil {
		return nil, errnoOf(err)
	}
	list := n.dots(len(ents))
	for _, e := range ents {
		list = append(list, fuse.DirEntry{Name: e.name, Mode: e.mode, Ino: n.f.inoFor(e.l, e.ino)})
	}
	return gofs.NewListDirStream(list), 0
}

// dots starts a listing of n with "." and "..", as overlayfs and plain
// directories list them (ls -a, fts). They also keep a listing the kernel
// caches from being empty: the kernel notices an invalidation of a cached
// listing by its missing first page, and an empty listing has no page, so
// after a switch it would be served again whenever the directory's mtime
// is the same on both sides (coarse timestamps make that common).
func (n *node) dots(extra int) []fuse.DirEntry {
	ino := n.StableAttr().Ino
	pino := ino
	if _, p := n.Parent(); p != nil {
		pino = p.StableAttr().Ino
	}
	list := make([]fuse.DirEntry, 0, extra+2)
	return append(list,
		fuse.DirEntry{Name: ".", Mode: unix.S_IFDIR, Ino: ino},
		fuse.DirEntry{Name: "..", Mode: unix.S_IFDIR, Ino: pino})
}

// Readlink reads a symlink's target.
func (n *node) Readlink(ctx context.Context) ([]byte, syscall.Errno) {
	st, done, errno := n.begin(false)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	l, p := n.top(st)
	buf := make([]byte, 4096)
	k, err := unix.Readlinkat(l.fd, p, buf)
	if err != nil {
		return nil, errnoOf(err)
	}
	return buf[:k], 0
}

// Statfs reports the store's file system.
func (n *node) Statfs(ctx context.Context, out *fuse.StatfsOut) syscall.Errno {
	n.f.mu.RLock()
	fd := n.f.st.upper.fd
	var s unix.Statfs_t
	err := unix.Fstatfs(fd, &s)
	n.f.mu.RUnlock()
	if err != nil {
		return errnoOf(err)
	}
	out.Blocks, out.Bfree, out.Bavail = s.Blocks, s.Bfree, s.Bavail
	out.Files, out.Ffree = s.Files, s.Ffree
	out.Bsize, out.Frsize = uint32(s.Bsize), uint32(s.Frsize)
	out.NameLen = uint32(s.Namelen)
	return 0
}

func hiddenXattr(name string) bool { return strings.HasPrefix(name, layer.XattrPrefixOverlay) }

// Getxattr reads an xattr of the top source; overlay xattrs are hidden.
func (n *node) Getxattr(ctx context.Context, attr string, dest []byte) (uint32, syscall.Errno) {
	if hiddenXattr(attr) {
		return 0, syscall.ENODATA
	}
	st, done, errno := n.begin(false)
	if errno != 0 {
		return 0, errno
	}
	defer done()
	l, p := n.top(st)
	sz, err := unix.Lgetxattr(l.path+"/"+p, attr, dest)
	if err != nil {
		return uint32(max(sz, 0)), errnoOf(err)
	}
	return uint32(sz), 0
}

// Listxattr lists the xattrs of the top source, without overlay ones.
func (n *node) Listxattr(ctx context.Context, dest []byte) (uint32, syscall.Errno) {
	st, done, errno := n.begin(false)
	if errno != 0 {
		return 0, errno
	}
	defer done()
	l, p := n.top(st)
	buf := make([]byte, 64<<10)
	sz, err := unix.Llistxattr(l.path+"/"+p, buf)
	if err != nil {
		return 0, errnoOf(err)
	}
	var out []byte
	for _, a := range strings.Split(string(buf[:sz]), "\x00") {
		if a == "" || hiddenXattr(a) {
			continue
		}
		out = append(append(out, a...), 0)
	}
	if len(dest) == 0 {
		return uint32(len(out)), 0
	}
	if len(dest) < len(out) {
		return uint32(len(out)), syscall.ERANGE
	}
	copy(dest, out)
	return uint32(len(out)), 0
}

// Setxattr copies the entry up and sets the xattr there.
func (n *node) Setxattr(ctx context.Context, attr string, data []byte, flags uint32) syscall.Errno {
	if hiddenXattr(attr) {
		return syscall.EPERM
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return errno
	}
	defer done()
	if err := n.f.copyUp(st, n, false); err != nil {
		return errnoOf(err)
	}
	_, p := n.top(st)
	if err := unix.Lsetxattr(st.upper.path+"/"+p, attr, data, int(flags)); err != nil {
		return errnoOf(err)
	}
	n.f.record("meta", n, "", 0)
	return 0
}

// Removexattr copies the entry up and removes the xattr there.
func (n *node) Removexattr(ctx context.Context, attr string) syscall.Errno {
	if hiddenXattr(attr) {
		return syscall.ENODATA
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return errno
	}
	defer done()
	l, p := n.top(st)
	var b [1]byte
	if _, err := unix.Lgetxattr(l.path+"/"+p, attr, b[:0]); err != nil {
		return errnoOf(err)
	}
	if err := n.f.copyUp(st, n, false); err != nil {
		return errnoOf(err)
	}
	_, p = n.top(st)
	if err := unix.Lremovexattr(st.upper.path+"/"+p, attr); err != nil {
		return errnoOf(err)
	}
	n.f.record("meta", n, "", 0)
	return 0
}

// dirHandle is an open directory: a snapshot of the merged listing, taken
// at the first read (so an opendir answered from the kernel's readdir
// cache costs nothing). The kernel may cache it (FOPEN_CACHE_DIR); a switch
// invalidates it with NotifyContent on the directory, local changes are
// seen by the kernel itself.
//
// A stream opened before a switch still holds the old view's listing: a
// rewind reloads it, and its release invalidates the kernel's cache once
// more, since the kernel may have cached what it served after the switch's
// invalidation.
type dirHandle struct {
	n      *node
	mu     sync.Mutex
	loaded bool
	view   uint64 // f.viewGen of the snapshot
	ents   []fuse.DirEntry
	pos    int
}

var (
	_ gofs.NodeOpendirHandler = (*node)(nil)
	_ gofs.FileReaddirenter   = (*dirHandle)(nil)
	_ gofs.FileSeekdirer      = (*dirHandle)(nil)
	_ gofs.FileReleasedirer   = (*dirHandle)(nil)
)

// OpendirHandle opens the directory and lets the kernel cache its listing.
func (n *node) OpendirHandle(ctx context.Context, flags uint32) (gofs.FileHandle, uint32, syscall.Errno) {
	return &dirHandle{n: n}, fuse.FOPEN_CACHE_DIR | fuse.FOPEN_KEEP_CACHE, 0
}

// load snapshots the merged listing; the caller holds d.mu.
func (d *dirHandle) load() syscall.Errno {
	if d.loaded {
		return 0
	}
	n := d.n
	st, done, errno := n.begin(false)
	if errno != 0 {
		return errno
	}
	defer done()
	ents, err := readMerged(st, n.getSrcs(), n.vpath())
	if err != nil {
		return errnoOf(err)
	}
	d.ents = n.dots(len(ents))
	for _, e := range ents {
		d.ents = append(d.ents, fuse.DirEntry{Name: e.name, Mode: e.mode, Ino: n.f.inoFor(e.l, e.ino)})
	}
	for i := range d.ents {
		d.ents[i].Off = uint64(i + 1)
	}
	d.loaded, d.view = true, n.f.viewGen.Load()
	return 0
}

// Readdirent returns the next entry.
func (d *dirHandle) Readdirent(ctx context.Context) (*fuse.DirEntry, syscall.Errno) {
	d.mu.Lock()
	defer d.mu.Unlock()
	if errno := d.load(); errno != 0 {
		return nil, errno
	}
	if d.pos >= len(d.ents) {
		return nil, 0
	}
	e := d.ents[d.pos]
	d.pos++
	return &e, 0
}

// Seekdir repositions the stream (offsets are 1-based entry indexes).
func (d *dirHandle) Seekdir(ctx context.Context, off uint64) syscall.Errno {
	d.mu.Lock()
	defer d.mu.Unlock()
	if off == 0 && d.loaded && d.view != d.n.f.viewGen.Load() {
		d.loaded = false // rewinddir after a switch: the current view
	}
	if errno := d.load(); errno != 0 {
		return errno
	}
	d.pos = int(min(off, uint64(len(d.ents))))
	return 0
}

// Releasedir invalidates the kernel's cached listing when the stream
// served a view that a switch replaced meanwhile. The kernel has handled
// every reply of the stream by the time it releases it, so nothing it
// cached from the old view survives.
func (d *dirHandle) Releasedir(ctx context.Context, flags uint32) {
	d.mu.Lock()
	stale := d.loaded && d.view != d.n.f.viewGen.Load()
	d.mu.Unlock()
	if stale {
		_ = d.n.NotifyContent(0, 0)
	}
}

// pinnedElsewhere reports whether passthrough handles hold n on a backing
// file other than e's: such a node cannot serve e (the kernel would refuse
// to open it), so e gets a fresh node.
func (n *node) pinnedElsewhere(e *entry) bool {
	n.mu.Lock()
	defer n.mu.Unlock()
	if n.ptLower != nil {
		return e.srcs[0].l != n.ptLower || n.ptIno != e.st.Ino
	}
	return n.ptOpen > 0 && (e.srcs[0].l != n.f.upperNow() || n.ptIno != e.st.Ino)
}

// lowerPinnedAt reports whether n is pinned to a lower backing file
// (ptLower) while attached as name in directory parent: a new node for
// that name is the same file after a copy-up and keeps n's inode number.
func (n *node) lowerPinnedAt(parent *gofs.Inode, name string) bool {
	n.mu.Lock()
	pinned := n.ptLower != nil
	n.mu.Unlock()
	if !pinned {
		return false
	}
	pn, pp := n.Parent()
	return pp == parent && pn == name
}
