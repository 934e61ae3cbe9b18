package kernelpath

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// entryFP is the fingerprint of one upper entry, used to tell what changed
// between two walks of the upper (file-system effects, dirtiness).
type entryFP struct {
	mode  uint32
	nlink uint32
	rdev  uint64
	ino   uint64
	size  int64
	mtime int64
	ctime int64
	// Directories only: the overlayfs flags.
	opaque   bool
	redirect string
}

func fpOf(st *unix.Stat_t) entryFP {
	return entryFP{
		mode:  st.Mode,
		nlink: uint32(st.Nlink),
		rdev:  st.Rdev,
		ino:   st.Ino,
		size:  st.Size,
		mtime: st.Mtim.Nano(),
		ctime: st.Ctim.Nano(),
	}
}

// isWhiteout reports whether a fingerprint is an overlayfs whiteout.
func (e entryFP) isWhiteout() bool { return e.mode&unix.S_IFMT == unix.S_IFCHR && e.rdev == 0 }

// same reports whether an entry is unchanged for a freeze. Whiteouts are
// all alike: overlayfs makes them as hard links of one shared whiteout
// inode, whose link count and ctime change with every other delete.
func (e entryFP) same(o entryFP) bool { return e == o || e.isWhiteout() && o.isWhiteout() }

// multiLink reports whether a non-directory other than a whiteout has
// other names (a change through one name changes them all).
func (e entryFP) multiLink() bool {
	return e.nlink > 1 && e.mode&unix.S_IFMT != unix.S_IFDIR && !e.isWhiteout()
}

// keepXattr tells which xattrs a frozen layer keeps: every xattr except
// overlayfs's private bookkeeping (origin, impure, ...); of those only the
// two the shared layer format defines survive.
func keepXattr(name string) bool {
	if !strings.HasPrefix(name, layer.XattrPrefixOverlay) {
		return true
	}
	return name == layer.XattrOpaque || name == layer.XattrRedirect
}

// treeCopier copies (freezes) a live upper into a new layer directory. All
// host-side access is fd-relative with O_NOFOLLOW: a symlink made inside the
// sandbox is never followed.
type treeCopier struct {
	reflink bool
	small   int64 // copy data of files up to this size instead of cloning
	uid     uint32
	gid     uint32
	umask   uint32
	dstRoot int
	links   map[uint64]string // inode -> path (relative to dstRoot) of a first copy
	fp      map[string]entryFP
	bufs    copyBufs // the calling goroutine's
	// noOvl drops every trusted.overlay.* xattr (incremental freeze sets
	// the flags itself).
	noOvl bool
	// rootSetgid, when set, is whether every directory files are created
	// in has the setgid bit: a freeze creates its directories (mode 0700,
	// inheriting only the layer root's setgid bit) and gives them their
	// modes after their children, so the layer root decides. Nil: ask the
	// directory for each file.
	rootSetgid *bool
	// tr links a freeze of the live upper to its change tracker (nil: none).
	tr *trackCtx
	// freshDir: test the next regular file copied for writers.
	freshDir bool
	// files finishes the copies of regular files, on helper goroutines
	// when set (copyfile_linux.go); nil: each copy is finished inline.
	files *fileCopier
	// pool has unnamed files for the copies (nil: none).
	pool *tmpPool
	// later, when set, makes the freeze deferred (finish_linux.go): the
	// writes into the layer are queued there.
	later *finishQueue
}

// trackCtx is a freeze's link to the upper's tracker: it watches every
// directory the freeze enters, before reading it, and tests the regular
// files of directories watched only now (their opens went unseen) for
// writers.
type trackCtx struct {
	t       *tracker
	l       *leases
	all     bool  // test every regular file (after an overflow)
	markErr error // the first directory that could not be watched
}

func newTrackCtx(t *tracker) *trackCtx {
	if t == nil {
		return nil
	}
	return &trackCtx{t: t, l: &leases{t: t, writers: map[string]unix.FileHandle{}}, all: t.allLeases}
}

// enterDir watches the directory fd at path p; it reports whether the
// directory's files must be tested for writers.
func (tr *trackCtx) enterDir(fd int, p string) bool {
	if tr == nil {
		return false
	}
	fresh, err := tr.t.enter(fd, p, 0)
	if err != nil && tr.markErr == nil {
		tr.markErr = err
	}
	return fresh || tr.all
}

// broken is why the next checkpoint must walk ("" = it need not).
func (tr *trackCtx) broken() string {
	if tr.markErr != nil {
		return tr.markErr.Error()
	}
	if tr.l.err != nil {
		return tr.l.err.Error()
	}
	return ""
}

// knowSetgid sets c.rootSetgid from the layer root dstRoot.
func (c *treeCopier) knowSetgid() error {
	var st unix.Stat_t
	if err := unix.Fstat(c.dstRoot, &st); err != nil {
		return fmt.Errorf("layer root: %w", err)
	}
	g := st.Mode&unix.S_ISGID != 0
	c.rootSetgid = &g
	return nil
}

// smallFileXFS is the size up to which a frozen file's data is copied
// rather than reflinked on XFS (and in copy mode): an XFS clone costs a log
// transaction, more than writing a few blocks (measured: 100 small files
// 5.2 ms cloned, 1.9 ms copied). On btrfs cloning small files is cheaper
// than copying them (2.6-5 ms vs 7 ms), so it always clones.
const smallFileXFS = 16 << 10

// freezeTree copies every entry of the directory src into the empty
// directory dst (both on the same file system for reflink) and returns the
// fingerprints of the entries copied (paths relative, "/"-separated).
// tr, if set, watches the directories copied.
func freezeTree(src, dst string, reflink bool, fstype string, tr *trackCtx, pool *tmpPool, later *finishQueue) (map[string]entryFP, error) {
	c, sfd, err := newCopier(src, dst, reflink, fstype, tr, pool, later)
	if err != nil {
		return nil, err
	}
	dfd := c.dstRoot
	defer c.closeDir(dfd)
	defer c.files.close()
	var st unix.Stat_t
	if err := unix.Fstat(sfd, &st); err != nil {
		unix.Close(sfd)
		return nil, err
	}
	if err := c.copyDir(sfd, dfd, ""); err != nil {
		return nil, err
	}
	if err := c.files.close(); err != nil {
		return nil, err
	}
	sfd2, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	defer unix.Close(sfd2)
	if err := c.copyMeta(sfd2, dfd, &st); err != nil {
		return nil, fmt.Errorf("layer root: %w", err)
	}
	return c.fp, nil
}

// copyDir copies the children of directory fd src (ownership of src passes
// to copyDir) into directory fd dst.
func (c *treeCopier) copyDir(src, dst int, rel string) error {
	fresh := c.tr.enterDir(src, rel)
	dir := os.NewFile(uintptr(src), rel)
	defer dir.Close()
	names, err := dir.Readdirnames(-1)
	if err != nil {
		return fmt.Errorf("read dir /%s: %w", rel, err)
	}
	for _, name := range names {
		p := name
		if rel != "" {
			p = rel + "/" + name
		}
		c.freshDir = fresh
		if err := c.copyEntry(src, dst, name, p); err != nil {
			return fmt.Errorf("/%s: %w", p, err)
		}
	}
	return nil
}

func (c *treeCopier) copyEntry(src, dst int, name, rel string) error {
	var st unix.Stat_t
	if err := unix.Fstatat(src, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return err
	}
	return c.copyEntryStat(src, dst, name, rel, &st)
}

// copyEntryStat is copyEntry for an entry the caller has just stat'ed
// (the sandbox is frozen meanwhile): one syscall less per entry.
func (c *treeCopier) copyEntryStat(src, dst int, name, rel string, stp *unix.Stat_t) error {
	st := *stp
	c.fp[rel] = fpOf(&st)
	if c.tr != nil && c.fp[rel].multiLink() {
		c.tr.t.noteLinked(src, name)
	}
	const oflags = unix.O_NOFOLLOW | unix.O_CLOEXEC
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		if err := unix.Mkdirat(dst, name, 0o700); err != nil {
			return err
		}
		sfd, err := unix.Openat(src, name, unix.O_RDONLY|unix.O_DIRECTORY|oflags, 0)
		if err != nil {
			return err
		}
		fp := c.fp[rel]
		fp.opaque, fp.redirect = dirFlags(sfd)
		c.fp[rel] = fp
		dfd, err := unix.Openat(dst, name, unix.O_RDONLY|unix.O_DIRECTORY|oflags, 0)
		if err != nil {
			unix.Close(sfd)
			return err
		}
		defer func() {
			// Copies into it may still be in flight (after an error).
			_ = c.files.wait()
			c.closeDir(dfd)
		}()
		// copyDir closes its fd; keep one for the metadata.
		mfd, err := dupCloexec(sfd)
		if err != nil {
			unix.Close(sfd)
			return err
		}
		defer unix.Close(mfd)
		if err := c.copyDir(sfd, dfd, rel); err != nil {
			return err
		}
		return c.copyMeta(mfd, dfd, &st)
	case unix.S_IFREG:
		if st.Nlink > 1 {
			if first, ok := c.links[st.Ino]; ok {
				if c.later != nil {
					root := c.dstRoot
					c.later.add(func(*copyBufs) error { return unix.Linkat(root, first, dst, name, 0) })
					return nil
				}
				// The first name's copy must be in place.
				if err := c.files.wait(); err != nil {
					return err
				}
				return unix.Linkat(c.dstRoot, first, dst, name, 0)
			}
			c.links[st.Ino] = rel
		}
		sfd, err := openSource(src, name)
		if err != nil {
			return err
		}
		if c.freshDir && c.tr != nil {
			c.tr.l.checkFD(sfd, rel)
		}
		j := fileJob{sfd: sfd, dir: dst, name: name, rel: rel, st: st}
		if c.later != nil {
			return c.captureFile(j)
		}
		return c.files.copy(c, j)
	case unix.S_IFLNK:
		target, err := readlinkat(src, name)
		if err != nil {
			return err
		}
		if err := unix.Symlinkat(target, dst, name); err != nil {
			return err
		}
		return c.copyMetaAt(src, dst, name, &st, true)
	default: // whiteouts (char 0:0), devices, fifos, sockets
		if err := unix.Mknodat(dst, name, st.Mode, int(st.Rdev)); err != nil {
			return err
		}
		return c.copyMetaAt(src, dst, name, &st, false)
	}
}

// copyData clones (or copies) size bytes from sfd to dfd.
func (c *treeCopier) copyData(sfd, dfd int, size int64, b *copyBufs) error {
	if size <= c.small {
		// A clone costs a log transaction; a small file's few blocks are
		// cheaper to copy, and copying them keeps the cost bounded per entry.
		if int64(len(b.data)) < c.small {
			b.data = make([]byte, int(c.small))
		}
		n, err := unix.Pread(sfd, b.data[:size], 0)
		if err != nil {
			return fmt.Errorf("read: %w", err)
		}
		if _, err := unix.Pwrite(dfd, b.data[:n], 0); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		if int64(n) == size {
			return nil
		}
		return c.copyRW(sfd, dfd, int64(n))
	}
	if c.reflink {
		err := unix.IoctlFileClone(dfd, sfd)
		if err == nil {
			return nil
		}
		if !errors.Is(err, unix.EOPNOTSUPP) && !errors.Is(err, unix.EXDEV) && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOTTY) {
			return fmt.Errorf("reflink: %w", err)
		}
	}
	var done int64
	for done < size {
		n, err := unix.CopyFileRange(sfd, nil, dfd, nil, int(min(size-done, 1<<30)), 0)
		if err != nil {
			if errors.Is(err, unix.EXDEV) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOSYS) || errors.Is(err, unix.EOPNOTSUPP) {
				return c.copyRW(sfd, dfd, done)
			}
			return fmt.Errorf("copy_file_range: %w", err)
		}
		if n == 0 {
			break // the source shrank meanwhile
		}
		done += int64(n)
	}
	return nil
}

func (c *treeCopier) copyRW(sfd, dfd int, off int64) error {
	buf := make([]byte, 1<<20)
	for {
		n, err := unix.Pread(sfd, buf, off)
		if err != nil {
			return fmt.Errorf("read: %w", err)
		}
		if n == 0 {
			return nil
		}
		if _, err := unix.Pwrite(dfd, buf[:n], off); err != nil {
			return fmt.Errorf("write: %w", err)
		}
		off += int64(n)
	}
}

// copyMeta copies owner, mode, xattrs and times from fd sfd to fd dfd.
func (c *treeCopier) copyMeta(sfd, dfd int, st *unix.Stat_t) error {
	if c.later != nil {
		return c.deferMeta(sfd, dfd, st)
	}
	// A directory's times and metadata come after its children's copies.
	if err := c.files.wait(); err != nil {
		return err
	}
	return c.copyMetaOpt(sfd, dfd, st, true, true, &c.bufs)
}

func (c *treeCopier) copyMetaOpt(sfd, dfd int, st *unix.Stat_t, chown, chmod bool, b *copyBufs) error {
	if chown {
		if err := unix.Fchown(dfd, int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("chown: %w", err)
		}
	}
	if chmod {
		if err := unix.Fchmod(dfd, st.Mode&0o7777); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	if err := c.copyXattrs(b,
		func(b []byte) (int, error) { return unix.Flistxattr(sfd, b) },
		func(n string, b []byte) (int, error) { return unix.Fgetxattr(sfd, n, b) },
		func(n string, b []byte) error { return unix.Fsetxattr(dfd, n, b, 0) },
	); err != nil {
		return err
	}
	return futimens(dfd, st)
}

// copyMetaAt copies the metadata of a symlink or special file, by name.
func (c *treeCopier) copyMetaAt(src, dst int, name string, st *unix.Stat_t, symlink bool) error {
	if err := unix.Fchownat(dst, name, int(st.Uid), int(st.Gid), unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("chown: %w", err)
	}
	if !symlink {
		// The node was just made by us in a directory no sandbox sees.
		if err := unix.Fchmodat(dst, name, st.Mode&0o7777, 0); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	// Paths through our own directory fds; l*xattr never follows the
	// final symlink.
	sp := "/proc/self/fd/" + strconv.Itoa(src) + "/" + name
	dp := "/proc/self/fd/" + strconv.Itoa(dst) + "/" + name
	if err := c.copyXattrs(&c.bufs,
		func(b []byte) (int, error) { return unix.Llistxattr(sp, b) },
		func(n string, b []byte) (int, error) { return unix.Lgetxattr(sp, n, b) },
		func(n string, b []byte) error { return unix.Lsetxattr(dp, n, b, 0) },
	); err != nil {
		return err
	}
	ts := []unix.Timespec{st.Atim, st.Mtim}
	if err := unix.UtimesNanoAt(dst, name, ts, unix.AT_SYMLINK_NOFOLLOW); err != nil {
		return fmt.Errorf("utimens: %w", err)
	}
	return nil
}

func (c *treeCopier) copyXattrs(b *copyBufs, list func([]byte) (int, error), get func(string, []byte) (int, error), set func(string, []byte) error) error {
	xs, err := c.readXattrs(b, list, get)
	if err != nil {
		return err
	}
	return setXattrs(xs, set)
}

// dirFlags reads the overlayfs flags of directory fd.
func dirFlags(fd int) (opaque bool, redirect string) {
	buf := make([]byte, 4096)
	if n, err := unix.Fgetxattr(fd, layer.XattrOpaque, buf); err == nil && n > 0 && buf[0] == 'y' {
		opaque = true
	}
	if n, err := unix.Fgetxattr(fd, layer.XattrRedirect, buf); err == nil && n > 0 {
		redirect = string(buf[:n])
	}
	return opaque, redirect
}

// parentSetgid reports whether directory fd dir has the setgid bit (new
// entries then inherit its group).
func (c *treeCopier) parentSetgid(dir int) bool {
	if c.rootSetgid != nil {
		return *c.rootSetgid
	}
	var st unix.Stat_t
	if err := unix.Fstat(dir, &st); err != nil {
		return true
	}
	return st.Mode&unix.S_ISGID != 0
}

// currentUmask reads the process umask without changing it.
func currentUmask() uint32 {
	b, err := os.ReadFile("/proc/self/status")
	if err == nil {
		for _, line := range strings.Split(string(b), "\n") {
			if v, ok := strings.CutPrefix(line, "Umask:"); ok {
				if m, err := strconv.ParseUint(strings.TrimSpace(v), 8, 32); err == nil {
					return uint32(m)
				}
			}
		}
	}
	return 0o777 // unknown: always chmod
}

// futimens sets atime and mtime of fd (utimensat with a NULL path).
func futimens(fd int, st *unix.Stat_t) error {
	ts := [2]unix.Timespec{st.Atim, st.Mtim}
	_, _, e := unix.Syscall6(unix.SYS_UTIMENSAT, uintptr(fd), 0, uintptr(unsafe.Pointer(&ts[0])), 0, 0, 0)
	if e != 0 {
		return fmt.Errorf("utimens: %w", e)
	}
	return nil
}

func readlinkat(dirfd int, name string) (string, error) {
	for size := 256; ; size *= 2 {
		b := make([]byte, size)
		n, err := unix.Readlinkat(dirfd, name, b)
		if err != nil {
			return "", err
		}
		if n < size {
			return string(b[:n]), nil
		}
	}
}

// fingerprintTree walks the directory root (fd-relative, no symlink
// followed) and returns the fingerprint of every entry.
func fingerprintTree(root string) (map[string]entryFP, error) {
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	out := map[string]entryFP{}
	return out, walkFP(fd, "", out)
}

func walkFP(fd int, rel string, out map[string]entryFP) error {
	dir := os.NewFile(uintptr(fd), rel)
	defer dir.Close()
	names, err := dir.Readdirnames(-1)
	if err != nil {
		return err
	}
	for _, name := range names {
		p := name
		if rel != "" {
			p = rel + "/" + name
		}
		var st unix.Stat_t
		if err := unix.Fstatat(fd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			if errors.Is(err, unix.ENOENT) {
				continue
			}
			return err
		}
		out[p] = fpOf(&st)
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			cfd, err := unix.Openat(fd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				if errors.Is(err, unix.ENOENT) {
					continue
				}
				return err
			}
			if err := walkFP(cfd, p, out); err != nil {
				return err
			}
		}
	}
	return nil
}

// dupCloexec duplicates fd close-on-exec: a program the daemon starts
// meanwhile (a sandbox's init, criu) inherits none of the layers' fds.
func dupCloexec(fd int) (int, error) {
	return unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0)
}
