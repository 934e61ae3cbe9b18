package fs

import (
	"context"
	"syscall"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// owner returns the uid/gid a new entry in directory n gets: the caller's,
// with the directory's gid when it is setgid.
func (n *node) owner(ctx context.Context, st *stack) (uid, gid int, setgid bool) {
	uid, gid = 0, 0
	if c, ok := fuse.FromContext(ctx); ok {
		uid, gid = int(c.Uid), int(c.Gid)
	}
	var ps unix.Stat_t
	if unix.Fstatat(st.upper.fd, n.vpath(), &ps, unix.AT_SYMLINK_NOFOLLOW) == nil && ps.Mode&unix.S_ISGID != 0 {
		gid = int(ps.Gid)
		setgid = true
	}
	return uid, gid, setgid
}

// removeWhiteout removes a whiteout at upper path p and reports whether
// there was one.
func removeWhiteout(u *layerDir, p string) bool {
	var s unix.Stat_t
	if unix.Fstatat(u.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW) == nil && layer.IsWhiteout(&s) {
		return unix.Unlinkat(u.fd, p, 0) == nil
	}
	return false
}

// prepareCreate checks that name does not exist in directory n, copies n
// up and clears a whiteout at the new name. It returns the new entry's
// upper path and whether a whiteout was cleared.
func (n *node) prepareCreate(st *stack, name string) (string, bool, syscall.Errno) {
	_, found, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, false)
	if err != nil {
		return "", false, errnoOf(err)
	}
	if found {
		return "", false, syscall.EEXIST
	}
	if err := n.f.copyUp(st, n, false); err != nil {
		return "", false, errnoOf(err)
	}
	p := join(n.vpath(), name)
	return p, removeWhiteout(st.upper, p), 0
}

// finishCreate stats the new upper entry and returns its node.
func (n *node) finishCreate(ctx context.Context, st *stack, name, p string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	var s unix.Stat_t
	if err := unix.Fstatat(st.upper.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, errnoOf(err)
	}
	return n.finishCreateStat(ctx, st, name, p, &s, out), 0
}

// finishCreateStat returns the node of the new upper entry p, whose stat
// is s.
func (n *node) finishCreateStat(ctx context.Context, st *stack, name, p string, s *unix.Stat_t, out *fuse.EntryOut) *gofs.Inode {
	e := entry{srcs: []src{{st.upper, p}}, st: *s}
	ch := n.child(ctx, name, &e, n.f.gen.Load(), true)
	fillAttr(&out.Attr, s, ch.StableAttr().Ino)
	n.f.dirty.Store(true)
	n.f.record("create", n, name, 0)
	return ch
}

// Create creates and opens a regular file.
func (n *node) Create(ctx context.Context, name string, flags uint32, mode uint32, out *fuse.EntryOut) (*gofs.Inode, gofs.FileHandle, uint32, syscall.Errno) {
	if h := n.f.afterCreate.Load(); h != nil {
		defer (*h)()
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	defer done()
	p, _, errno := n.prepareCreate(st, name)
	if errno != 0 {
		return nil, nil, 0, errno
	}
	hf := hostFlags(flags, true)
	if n.f.noOpen() {
		// The fd becomes the new node's implicit handle for writing:
		// pwrite at the kernel's offsets (no O_APPEND), readable too.
		hf = unix.O_RDWR
	}
	fd, err := openBeneath(st.upper.fd, p, hf|unix.O_CREAT|unix.O_EXCL, 0o600)
	if err != nil {
		return nil, nil, 0, errnoOf(err)
	}
	// The server runs as root: a new entry is already root-owned.
	if uid, gid, _ := n.owner(ctx, st); uid != 0 || gid != 0 {
		if err := unix.Fchown(fd, uid, gid); err != nil {
			unix.Close(fd)
			return nil, nil, 0, errnoOf(err)
		}
	}
	if err := unix.Fchmod(fd, mode&07777); err != nil {
		unix.Close(fd)
		return nil, nil, 0, errnoOf(err)
	}
	var s unix.Stat_t
	if err := unix.Fstat(fd, &s); err != nil {
		unix.Close(fd)
		return nil, nil, 0, errnoOf(err)
	}
	ch := n.finishCreateStat(ctx, st, name, p, &s, out)
	cn := ch.Operations().(*node)
	h := &handle{n: cn, fd: fd, l: st.upper, flags: flags, viewGen: n.f.viewGen.Load()}
	if n.f.noOpen() {
		// No handle for the kernel (it sends no RELEASE in no-open
		// mode): the file's writes come without one.
		h.flags = unix.O_RDWR
		cn.mu.Lock()
		old := cn.implW
		cn.implW = h
		cn.mu.Unlock()
		if old != nil {
			old.close()
		}
		n.f.addImplicit(cn)
		return ch, nil, fuse.FOPEN_KEEP_CACHE, 0
	}
	if n.f.opts.Passthrough {
		cn.mu.Lock()
		ok := cn.ptOpen == 0 && cn.cachedOpen == 0 && cn.releasing == 0 && mode&(unix.S_ISUID|unix.S_ISGID) == 0
		if ok {
			cn.ptOpen++
			cn.ptWrite++
			cn.ptIno = s.Ino
		}
		cn.mu.Unlock()
		if ok {
			n.f.ptMu.Lock()
			n.f.ptNodes[cn] = struct{}{}
			n.f.ptMu.Unlock()
			return ch, &ptHandle{handle: h, write: true}, fuse.FOPEN_NOFLUSH, 0
		}
	}
	cn.mu.Lock()
	cn.cachedOpen++
	cn.mu.Unlock()
	return ch, h, fuse.FOPEN_KEEP_CACHE | fuse.FOPEN_NOFLUSH, 0
}

// Mkdir creates a directory (opaque when it replaces a whiteout).
func (n *node) Mkdir(ctx context.Context, name string, mode uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	st, done, errno := n.begin(true)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	p, wo, errno := n.prepareCreate(st, name)
	if errno != 0 {
		return nil, errno
	}
	if err := unix.Mkdirat(st.upper.fd, p, 0o700); err != nil {
		return nil, errnoOf(err)
	}
	uid, gid, sg := n.owner(ctx, st)
	m := mode & 07777
	if sg {
		m |= unix.S_ISGID
	}
	if uid != 0 || gid != 0 {
		if err := unix.Fchownat(st.upper.fd, p, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return nil, errnoOf(err)
		}
	}
	if err := unix.Fchmodat(st.upper.fd, p, m, 0); err != nil {
		return nil, errnoOf(err)
	}
	if wo {
		if err := layer.SetOpaque(st.upper.path + "/" + p); err != nil {
			return nil, errnoOf(err)
		}
	}
	return n.finishCreate(ctx, st, name, p, out)
}

// Mknod creates a device node, fifo or socket.
func (n *node) Mknod(ctx context.Context, name string, mode uint32, dev uint32, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	if mode&unix.S_IFMT == unix.S_IFCHR && dev == 0 {
		return nil, syscall.EPERM // 0:0 is the whiteout marker
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	p, _, errno := n.prepareCreate(st, name)
	if errno != 0 {
		return nil, errno
	}
	if err := unix.Mknodat(st.upper.fd, p, mode&^07777|0o600, int(dev)); err != nil {
		return nil, errnoOf(err)
	}
	uid, gid, _ := n.owner(ctx, st)
	if err := unix.Fchownat(st.upper.fd, p, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, errnoOf(err)
	}
	if err := unix.Fchmodat(st.upper.fd, p, mode&07777, 0); err != nil {
		return nil, errnoOf(err)
	}
	return n.finishCreate(ctx, st, name, p, out)
}

// Symlink creates a symbolic link.
func (n *node) Symlink(ctx context.Context, target, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	st, done, errno := n.begin(true)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	p, _, errno := n.prepareCreate(st, name)
	if errno != 0 {
		return nil, errno
	}
	if err := unix.Symlinkat(target, st.upper.fd, p); err != nil {
		return nil, errnoOf(err)
	}
	uid, gid, _ := n.owner(ctx, st)
	if err := unix.Fchownat(st.upper.fd, p, uid, gid, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, errnoOf(err)
	}
	return n.finishCreate(ctx, st, name, p, out)
}

// Link creates a hard link to target (copied up first).
func (n *node) Link(ctx context.Context, target gofs.InodeEmbedder, name string, out *fuse.EntryOut) (*gofs.Inode, syscall.Errno) {
	tn, ok := target.(*node)
	if !ok {
		return nil, syscall.EXDEV
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return nil, errno
	}
	defer done()
	if errno := tn.resolve(st, n.f.gen.Load()); errno != 0 {
		return nil, errno
	}
	if err := n.f.copyUp(st, tn, false); err != nil {
		return nil, errnoOf(err)
	}
	p, _, errno := n.prepareCreate(st, name)
	if errno != 0 {
		return nil, errno
	}
	_, tp := tn.top(st)
	if err := unix.Linkat(st.upper.fd, tp, st.upper.fd, p, 0); err != nil {
		return nil, errnoOf(err)
	}
	var s unix.Stat_t
	if err := unix.Fstatat(st.upper.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return nil, errnoOf(err)
	}
	fillAttr(&out.Attr, &s, tn.StableAttr().Ino)
	n.f.dirty.Store(true)
	n.f.record("create", n, name, 0)
	return tn.EmbeddedInode(), 0
}

// removeEntry removes name (resolved as e) from directory n: the upper
// copy is deleted and a whiteout is left when a lower layer has the name.
func (n *node) removeEntry(st *stack, name string, e *entry, dir bool) syscall.Errno {
	f := n.f
	lower, hasLower, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, true)
	_ = lower
	if err != nil {
		return errnoOf(err)
	}
	if err := f.copyUp(st, n, false); err != nil {
		return errnoOf(err)
	}
	p := join(n.vpath(), name)
	u := st.upper
	if !dir && e.st.Nlink > 1 && e.srcs[0].l != u {
		// Keep the other names of a multiply-linked lower inode linked
		// (and their link count right): copy it up with its links first.
		if err := f.copyUpChild(st, n, name, p, e); err != nil {
			return errnoOf(err)
		}
		e.srcs = []src{{u, p}}
	}
	if !dir {
		n.pinChild(st, name, e)
	}
	if e.srcs[0].l == u {
		if dir {
			// A merged-empty directory holds only whiteouts in the upper.
			if fd, err := openBeneath(u.fd, p, unix.O_RDONLY|unix.O_DIRECTORY, 0); err == nil {
				names, _ := readDirNames(fd)
				for _, nm := range names {
					_ = unix.Unlinkat(fd, nm, 0)
				}
				unix.Close(fd)
			}
			if err := unix.Unlinkat(u.fd, p, unix.AT_REMOVEDIR); err != nil {
				return errnoOf(err)
			}
		} else if err := unix.Unlinkat(u.fd, p, 0); err != nil {
			return errnoOf(err)
		}
	}
	if hasLower {
		if err := layer.MakeWhiteout(u.fd, p); err != nil {
			return errnoOf(err)
		}
	}
	if ch := n.GetChild(name); ch != nil && (dir || e.st.Nlink <= 1) {
		if cn, ok := ch.Operations().(*node); ok {
			cn.mu.Lock()
			cn.gone = true
			cn.mu.Unlock()
		}
	}
	f.dirty.Store(true)
	f.record("delete", n, name, 0)
	return 0
}

// Unlink removes a non-directory.
func (n *node) Unlink(ctx context.Context, name string) syscall.Errno {
	st, done, errno := n.begin(true)
	if errno != 0 {
		return errno
	}
	defer done()
	e, found, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, false)
	if err != nil {
		return errnoOf(err)
	}
	if !found {
		return syscall.ENOENT
	}
	if e.isDir() {
		return syscall.EISDIR
	}
	return n.removeEntry(st, name, &e, false)
}

// Rmdir removes an empty (merged) directory.
func (n *node) Rmdir(ctx context.Context, name string) syscall.Errno {
	st, done, errno := n.begin(true)
	if errno != 0 {
		return errno
	}
	defer done()
	e, found, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, false)
	if err != nil {
		return errnoOf(err)
	}
	if !found {
		return syscall.ENOENT
	}
	if !e.isDir() {
		return syscall.ENOTDIR
	}
	ents, err := readMerged(st, e.srcs, join(n.vpath(), name))
	if err != nil {
		return errnoOf(err)
	}
	if len(ents) > 0 {
		return syscall.ENOTEMPTY
	}
	return n.removeEntry(st, name, &e, true)
}

// Rename moves name to newName in newParent, across layers.
func (n *node) Rename(ctx context.Context, name string, newParent gofs.InodeEmbedder, newName string, flags uint32) syscall.Errno {
	np, ok := newParent.(*node)
	if !ok {
		return syscall.EXDEV
	}
	st, done, errno := n.begin(true)
	if errno != 0 {
		return errno
	}
	defer done()
	f := n.f
	gen := f.gen.Load()
	if errno := np.resolve(st, gen); errno != 0 {
		return errno
	}
	u := st.upper
	e1, found, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, false)
	if err != nil {
		return errnoOf(err)
	}
	if !found {
		return syscall.ENOENT
	}
	e2, found2, err := lookupEntry(st, np.getSrcs(), np.vpath(), newName, false)
	if err != nil {
		return errnoOf(err)
	}
	hasLowerDir := func(e *entry) bool {
		return e.isDir() && (len(e.srcs) > 1 || e.srcs[0].l != u)
	}
	if flags&unix.RENAME_EXCHANGE != 0 {
		if !found2 {
			return syscall.ENOENT
		}
		if hasLowerDir(&e1) || hasLowerDir(&e2) {
			return syscall.EXDEV
		}
		if err := f.copyUp(st, n, false); err != nil {
			return errnoOf(err)
		}
		if err := f.copyUp(st, np, false); err != nil {
			return errnoOf(err)
		}
		p1, p2 := join(n.vpath(), name), join(np.vpath(), newName)
		if err := f.copyUpChild(st, n, name, p1, &e1); err != nil {
			return errnoOf(err)
		}
		if err := f.copyUpChild(st, np, newName, p2, &e2); err != nil {
			return errnoOf(err)
		}
		if err := unix.Renameat2(u.fd, p1, u.fd, p2, unix.RENAME_EXCHANGE); err != nil {
			return errnoOf(err)
		}
		f.dirty.Store(true)
		f.record("rename", n, name, 0)
		return 0
	}
	if found2 {
		if flags&unix.RENAME_NOREPLACE != 0 {
			return syscall.EEXIST
		}
		if e1.srcs[0].l == e2.srcs[0].l && e1.st.Ino == e2.st.Ino {
			return 0 // two names of one inode: nothing to do
		}
		if e1.isDir() && !e2.isDir() {
			return syscall.ENOTDIR
		}
		if !e1.isDir() && e2.isDir() {
			return syscall.EISDIR
		}
		if e2.isDir() {
			ents, err := readMerged(st, e2.srcs, join(np.vpath(), newName))
			if err != nil {
				return errnoOf(err)
			}
			if len(ents) > 0 {
				return syscall.ENOTEMPTY
			}
		}
	}
	if err := f.copyUp(st, n, false); err != nil {
		return errnoOf(err)
	}
	if err := f.copyUp(st, np, false); err != nil {
		return errnoOf(err)
	}
	p1, p2 := join(n.vpath(), name), join(np.vpath(), newName)
	var firstLower *src
	if e1.isDir() {
		for i := range e1.srcs {
			if e1.srcs[i].l != u {
				firstLower = &e1.srcs[i]
				break
			}
		}
	}
	if err := f.copyUpChild(st, n, name, p1, &e1); err != nil {
		return errnoOf(err)
	}
	_, lowerAtDst, err := lookupEntry(st, np.getSrcs(), np.vpath(), newName, true)
	if err != nil {
		return errnoOf(err)
	}
	if found2 && !e2.isDir() && e2.st.Nlink > 1 && e2.srcs[0].l != u {
		// The target name of a multiply-linked lower inode disappears:
		// copy it up with its links so the other names' count drops.
		if err := f.copyUpChild(st, np, newName, p2, &e2); err != nil {
			return errnoOf(err)
		}
	}
	if found2 && e2.isDir() && e2.srcs[0].l == u {
		if fd, err := openBeneath(u.fd, p2, unix.O_RDONLY|unix.O_DIRECTORY, 0); err == nil {
			names, _ := readDirNames(fd)
			for _, nm := range names {
				_ = unix.Unlinkat(fd, nm, 0)
			}
			unix.Close(fd)
		}
	}
	if !found2 {
		removeWhiteout(u, p2)
	} else if !e2.isDir() {
		np.pinChild(st, newName, &e2)
	}
	if err := unix.Renameat2(u.fd, p1, u.fd, p2, 0); err != nil {
		return errnoOf(err)
	}
	if e1.isDir() {
		host := u.path + "/" + p2
		if firstLower != nil {
			if err := layer.SetRedirect(host, "/"+firstLower.path); err != nil {
				return errnoOf(err)
			}
		} else if lowerAtDst && layer.Redirect(host) == "" {
			if err := layer.SetOpaque(host); err != nil {
				return errnoOf(err)
			}
		}
	}
	if _, lowerAtSrc, err := lookupEntry(st, n.getSrcs(), n.vpath(), name, true); err != nil {
		return errnoOf(err)
	} else if lowerAtSrc {
		if err := layer.MakeWhiteout(u.fd, p1); err != nil {
			return errnoOf(err)
		}
	}
	// The moved node keeps its lower sources; its upper path follows the
	// view (go-fuse moves it in the tree after we return).
	if ch := n.GetChild(name); ch != nil {
		if cn, ok := ch.Operations().(*node); ok {
			srcs := []src{{u, p2}}
			if e1.isDir() {
				for _, s := range e1.srcs {
					if s.l != u {
						srcs = append(srcs, s)
					}
				}
			}
			cn.setSrcs(srcs, gen)
		}
	}
	if found2 {
		if ch := np.GetChild(newName); ch != nil {
			if cn, ok := ch.Operations().(*node); ok && (e2.isDir() || e2.st.Nlink <= 1) {
				cn.mu.Lock()
				cn.gone = true
				cn.mu.Unlock()
			}
		}
	}
	f.dirty.Store(true)
	f.record("rename", n, name, 0)
	return 0
}

// copyUpChild copies up child name of directory n (entry e at view path
// p), through its node when the kernel knows it.
func (f *FS) copyUpChild(st *stack, n *node, name, p string, e *entry) error {
	if !e.isDir() {
		// Path based: a node with several names must be copied up under
		// this very name.
		if err := f.copyUpPath(st, p, e, false); err != nil {
			return err
		}
		if ch := n.GetChild(name); ch != nil {
			if cn, ok := ch.Operations().(*node); ok {
				cn.setSrcs([]src{{st.upper, p}}, f.gen.Load())
			}
		}
		return nil
	}
	if ch := n.GetChild(name); ch != nil {
		if cn, ok := ch.Operations().(*node); ok && ch.StableAttr().Mode == e.st.Mode&unix.S_IFMT {
			cn.setSrcs(e.srcs, f.gen.Load())
			return f.copyUp(st, cn, false)
		}
	}
	return f.copyUpPath(st, p, e, false)
}
