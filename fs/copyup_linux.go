package fs

import (
	"errors"
	"fmt"
	iofs "io/fs"
	"path"
	"slices"
	"strings"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// copyUp makes sure node n exists in the writable upper. Directories are
// copied up without their content (they stay merged with the lowers);
// other entries are copied whole. With noData a regular file's content is
// not copied (the caller truncates it to 0). The caller holds f.ns
// exclusively and has resolved n.
func (f *FS) copyUp(st *stack, n *node, noData bool) error {
	if n.inUpper(st) {
		// The caller changes the entry next. Entries the upper got by a
		// change marked it dirty then, but the root is the upper itself.
		f.dirty.Store(true)
		return nil
	}
	gen := f.gen.Load()
	name, pin := n.Parent()
	if pin == nil {
		return syscall.ENOENT
	}
	p := pin.Operations().(*node)
	if errno := p.resolve(st, gen); errno != 0 {
		return errno
	}
	if err := f.copyUp(st, p, false); err != nil {
		return err
	}
	srcs := n.getSrcs()
	dst := join(p.vpath(), name)
	var s unix.Stat_t
	if err := unix.Fstatat(st.upper.fd, dst, &s, unix.AT_SYMLINK_NOFOLLOW); err == nil && !layer.IsWhiteout(&s) {
		// Already copied up by a path-based copy-up (a hard link or a
		// rename); refresh the resolution.
		e, found, err := lookupEntry(st, p.getSrcs(), p.vpath(), name, false)
		if err != nil {
			return err
		}
		if !found {
			return syscall.ENOENT
		}
		n.setSrcs(e.srcs, gen)
		return nil
	}
	ns, err := f.copyEntry(st, srcs[0], dst, noData)
	if err != nil {
		return fmt.Errorf("copy-up %s: %w", dst, err)
	}
	f.aliasIno(st.upper, ns.Ino, n.StableAttr().Ino)
	up := src{st.upper, dst}
	if ns.Mode&unix.S_IFMT == unix.S_IFDIR {
		n.setSrcs(append([]src{up}, srcs...), gen)
	} else {
		n.setSrcs([]src{up}, gen)
		f.copyUpLinks(st, srcs[0], dst)
	}
	f.dirty.Store(true)
	return nil
}

// copyUpPath copies up the entry e found at view path vp (whose parent is
// already in the upper). It returns the upper copy's stat.
func (f *FS) copyUpPath(st *stack, vp string, e *entry, noData bool) error {
	if e.srcs[0].l == st.upper {
		return nil
	}
	ns, err := f.copyEntry(st, e.srcs[0], vp, noData)
	if err != nil {
		return fmt.Errorf("copy-up %s: %w", vp, err)
	}
	f.aliasIno(st.upper, ns.Ino, f.inoFor(e.srcs[0].l, e.st.Ino))
	if ns.Mode&unix.S_IFMT != unix.S_IFDIR {
		f.copyUpLinks(st, e.srcs[0], vp)
	}
	f.dirty.Store(true)
	return nil
}

// copyEntry copies one entry (not a directory's content) from s to the
// upper at dst, preserving mode, owner, times and xattrs.
func (f *FS) copyEntry(st *stack, s src, dst string, noData bool) (unix.Stat_t, error) {
	u := st.upper
	var ss unix.Stat_t
	if err := unix.Fstatat(s.l.fd, s.path, &ss, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return ss, err
	}
	srcHost := s.l.path + "/" + s.path
	dstHost := u.path + "/" + dst
	mode := ss.Mode & unix.S_IFMT
	switch mode {
	case unix.S_IFDIR:
		if err := unix.Mkdirat(u.fd, dst, 0o700); err != nil {
			return ss, err
		}
	case unix.S_IFREG:
		if err := copyFile(s.l.fd, s.path, u.fd, dst, &ss, srcHost, noData); err != nil {
			return ss, err
		}
		var ns unix.Stat_t
		err := unix.Fstatat(u.fd, dst, &ns, unix.AT_SYMLINK_NOFOLLOW)
		return ns, err
	case unix.S_IFLNK:
		buf := make([]byte, 4096)
		k, err := unix.Readlinkat(s.l.fd, s.path, buf)
		if err != nil {
			return ss, err
		}
		if err := unix.Symlinkat(string(buf[:k]), u.fd, dst); err != nil {
			return ss, err
		}
	default:
		if err := unix.Mknodat(u.fd, dst, ss.Mode, int(ss.Rdev)); err != nil {
			return ss, err
		}
	}
	if err := unix.Fchownat(u.fd, dst, int(ss.Uid), int(ss.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return ss, err
	}
	if mode != unix.S_IFLNK {
		if err := unix.Fchmodat(u.fd, dst, ss.Mode&07777, 0); err != nil {
			return ss, err
		}
	}
	if err := copyXattrs(srcHost, dstHost); err != nil {
		return ss, err
	}
	ts := []unix.Timespec{ss.Atim, ss.Mtim}
	if err := unix.UtimesNanoAt(u.fd, dst, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return ss, err
	}
	var ns unix.Stat_t
	err := unix.Fstatat(u.fd, dst, &ns, unix.AT_SYMLINK_NOFOLLOW)
	return ns, err
}

// copyFile copies a regular file into an O_TMPFILE in the destination
// directory and links it into place, so a crash never leaves a partial copy
// visible.
func copyFile(sdir int, sp string, udir int, dst string, ss *unix.Stat_t, srcHost string, noData bool) error {
	in, err := openBeneath(sdir, sp, unix.O_RDONLY, 0)
	if err != nil {
		return err
	}
	defer unix.Close(in)
	out, err := openBeneath(udir, path.Dir(dst), unix.O_TMPFILE|unix.O_RDWR, 0o600)
	if err != nil {
		return err
	}
	defer unix.Close(out)
	if !noData && ss.Size > 0 {
		if err := copyData(in, out, ss.Size); err != nil {
			return err
		}
	}
	if err := unix.Fchown(out, int(ss.Uid), int(ss.Gid)); err != nil {
		return err
	}
	if err := unix.Fchmod(out, ss.Mode&07777); err != nil {
		return err
	}
	if err := copyXattrsFd(srcHost, out); err != nil {
		return err
	}
	ts := []unix.Timespec{ss.Atim, ss.Mtim}
	if err := unix.UtimesNanoAt(out, "", ts, unix.AT_EMPTY_PATH); err != nil {
		return err
	}
	dfd, err := openBeneath(udir, path.Dir(dst), unix.O_PATH|unix.O_DIRECTORY, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	return unix.Linkat(out, "", dfd, path.Base(dst), unix.AT_EMPTY_PATH)
}

// copyData copies size bytes from in to out: a reflink when the file
// system supports it, else the data segments alone (SEEK_DATA/SEEK_HOLE),
// each by copy_file_range or read/write, so that a sparse file's holes stay
// holes (a 1 GiB file with one written block took 1 GiB of disk per
// copy-up); out ends up size bytes long.
func copyData(in, out int, size int64) error {
	if err := unix.IoctlFileClone(out, in); err == nil {
		return nil
	}
	for off := int64(0); off < size; {
		data, err := unix.Seek(in, off, unix.SEEK_DATA)
		if err == unix.ENXIO {
			break // only a hole from off on
		}
		hole := size
		if err != nil {
			data = off // no hole support: everything is data
		} else if h, err := unix.Seek(in, data, unix.SEEK_HOLE); err == nil {
			hole = min(h, size)
		}
		if data >= size {
			break
		}
		if err := copyRange(in, out, data, hole); err != nil {
			return err
		}
		off = hole
	}
	return unix.Ftruncate(out, size)
}

// copyRange copies bytes [from, to) of in to the same offsets of out.
func copyRange(in, out int, from, to int64) error {
	for from < to {
		roff, woff := from, from
		k, err := unix.CopyFileRange(in, &roff, out, &woff, int(min(to-from, 1<<30)), 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			if err == unix.EXDEV || err == unix.EINVAL || err == unix.ENOSYS || err == unix.EOPNOTSUPP {
				return copyRW(in, out, from, to)
			}
			return err
		}
		if k == 0 {
			return nil // the file got shorter meanwhile
		}
		from += int64(k)
	}
	return nil
}

// copyRW is copyRange by read and write.
func copyRW(in, out int, from, to int64) error {
	buf := make([]byte, min(1<<20, max(to-from, 1)))
	for from < to {
		k, err := unix.Pread(in, buf[:min(int64(len(buf)), to-from)], from)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return err
		}
		if k == 0 {
			return nil
		}
		if _, err := unix.Pwrite(out, buf[:k], from); err != nil {
			return err
		}
		from += int64(k)
	}
	return nil
}

func listXattrs(host string) ([]string, error) {
	buf := make([]byte, 64<<10)
	sz, err := unix.Llistxattr(host, buf)
	if err != nil {
		if err == unix.ENOTSUP {
			return nil, nil
		}
		return nil, err
	}
	var out []string
	for _, a := range strings.Split(string(buf[:sz]), "\x00") {
		if a != "" && !hiddenXattr(a) {
			out = append(out, a)
		}
	}
	return out, nil
}

func copyXattrs(srcHost, dstHost string) error {
	names, err := listXattrs(srcHost)
	if err != nil {
		return err
	}
	buf := make([]byte, 64<<10)
	for _, a := range names {
		sz, err := unix.Lgetxattr(srcHost, a, buf)
		if err != nil {
			continue
		}
		if err := unix.Lsetxattr(dstHost, a, buf[:sz], 0); err != nil && err != unix.EPERM && err != unix.ENOTSUP {
			return fmt.Errorf("xattr %s: %w", a, err)
		}
	}
	return nil
}

func copyXattrsFd(srcHost string, out int) error {
	names, err := listXattrs(srcHost)
	if err != nil {
		return err
	}
	buf := make([]byte, 64<<10)
	for _, a := range names {
		sz, err := unix.Lgetxattr(srcHost, a, buf)
		if err != nil {
			continue
		}
		if err := unix.Fsetxattr(out, a, buf[:sz], 0); err != nil && err != unix.EPERM && err != unix.ENOTSUP {
			return fmt.Errorf("xattr %s: %w", a, err)
		}
	}
	return nil
}

// copyUpLinks keeps hard links linked: after the file at s (with other
// names in the same layer) was copied to dst, every other visible name of
// the same layer inode is linked to the copy.
func (f *FS) copyUpLinks(st *stack, s src, dst string) {
	var ss unix.Stat_t
	if err := unix.Fstatat(s.l.fd, s.path, &ss, unix.AT_SYMLINK_NOFOLLOW); err != nil || ss.Nlink <= 1 || ss.Mode&unix.S_IFMT == unix.S_IFDIR {
		return
	}
	others := f.linkNames(s.l, ss.Ino, ss.Nlink)
	var redirects [][2]string // (view dir, lower path) of renamed dirs above s.l
	for _, o := range others {
		if o == s.path {
			continue
		}
		// A name under a renamed directory shows at another view path:
		// try the layer path, then the paths redirects map it to.
		cands := []string{o}
		if redirects == nil {
			redirects = f.redirectsAbove(st, s.l)
		}
		for round := 0; round < 4; round++ {
			for _, c := range cands {
				for _, r := range redirects {
					if rest, ok := strings.CutPrefix(c, r[1]+"/"); ok && !slices.Contains(cands, join(r[0], rest)) {
						cands = append(cands, join(r[0], rest))
					}
				}
			}
		}
		for _, v := range cands {
			if v == dst {
				continue
			}
			e, ok := f.resolvePath(st, v)
			if !ok || e.srcs[0].l != s.l || e.srcs[0].path != o {
				continue
			}
			if err := f.copyUpDirs(st, path.Dir(v)); err != nil {
				continue
			}
			_ = unix.Linkat(st.upper.fd, dst, st.upper.fd, v, 0)
		}
	}
}

// redirectsAbove lists the redirected directories of the layers above l
// in stack st as (path in that layer, redirect target) pairs.
func (f *FS) redirectsAbove(st *stack, l *layerDir) [][2]string {
	out := [][2]string{}
	for _, a := range st.top {
		if a == l {
			break
		}
		_ = layer.Walk(a.path, func(rel string, d interfaceDirEntry) error {
			if !d.IsDir() {
				return nil
			}
			if r := layer.Redirect(a.path + "/" + rel); r != "" {
				if strings.HasPrefix(r, "/") {
					out = append(out, [2]string{rel, path.Clean(strings.TrimPrefix(r, "/"))})
				} else {
					out = append(out, [2]string{rel, join(path.Dir(rel), r)})
				}
			}
			return nil
		})
	}
	return out
}

// linkNames finds the names of inode ino in layer l (a walk of the layer;
// only done when a multiply-linked file is copied up).
func (f *FS) linkNames(l *layerDir, ino uint64, nlink uint64) []string {
	var out []string
	_ = layer.Walk(l.path, func(rel string, d interfaceDirEntry) error {
		if d.IsDir() {
			return nil
		}
		var s unix.Stat_t
		if unix.Fstatat(l.fd, rel, &s, unix.AT_SYMLINK_NOFOLLOW) == nil && s.Ino == ino {
			out = append(out, rel)
			if uint64(len(out)) >= nlink {
				return errStopWalk
			}
		}
		return nil
	})
	return out
}

// resolvePath resolves a view path from the root in stack st.
func (f *FS) resolvePath(st *stack, vp string) (entry, bool) {
	e := entry{srcs: rootSrcs(st)}
	_ = unix.Fstatat(st.upper.fd, ".", &e.st, 0)
	cur := "."
	for _, c := range splitPath(vp) {
		ne, found, err := lookupEntry(st, e.srcs, cur, c, false)
		if err != nil || !found {
			return ne, false
		}
		e = ne
		cur = join(cur, c)
	}
	return e, true
}

// copyUpDirs copies up every directory of view path dir.
func (f *FS) copyUpDirs(st *stack, dir string) error {
	e := entry{srcs: rootSrcs(st)}
	cur := "."
	in := f.root.EmbeddedInode()
	gen := f.gen.Load()
	for _, c := range splitPath(dir) {
		ne, found, err := lookupEntry(st, e.srcs, cur, c, false)
		if err != nil {
			return err
		}
		if !found || !ne.isDir() {
			return syscall.ENOENT
		}
		next := join(cur, c)
		if in != nil {
			in = in.GetChild(c)
		}
		if ne.srcs[0].l != st.upper {
			ns, err := f.copyEntry(st, ne.srcs[0], next, false)
			if err != nil {
				return err
			}
			f.aliasIno(st.upper, ns.Ino, f.inoFor(ne.srcs[0].l, ne.st.Ino))
			ne.srcs = append([]src{{st.upper, next}}, ne.srcs...)
			f.dirty.Store(true)
			// Keep a known node's resolution in step with the upper.
			if in != nil && in.IsDir() {
				if cn, ok := in.Operations().(*node); ok {
					cn.setSrcs(ne.srcs, gen)
				}
			}
		}
		e, cur = ne, next
	}
	return nil
}

type interfaceDirEntry = iofs.DirEntry

var errStopWalk = errors.New("stop walk")
