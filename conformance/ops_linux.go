package conformance

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path"
	"strconv"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// heldFD is a file descriptor a workload keeps open across steps.
type heldFD struct {
	f     *os.File
	path  string
	flags int
}

// opState is what the file operations of one tree need: its root
// directory and the descriptors the workload holds in it.
type opState struct {
	root string
	fds  map[string]*heldFD
}

// parent opens the directory containing rel beneath root without
// following any symlink, and returns it with the last path component.
func (o *opState) parent(rel string) (int, string, error) {
	dir, name := path.Split(rel)
	if dir == "" {
		dir = "."
	}
	how := unix.OpenHow{
		Flags:   unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC,
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	}
	rootfd, err := unix.Open(o.root, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, "", err
	}
	defer unix.Close(rootfd)
	fd, err := unix.Openat2(rootfd, path.Clean(dir), &how)
	if err != nil {
		return -1, "", err
	}
	return fd, name, nil
}

// openBeneath opens rel beneath root without following symlinks.
func (o *opState) openBeneath(rel string, flags int, mode uint32) (int, error) {
	dfd, name, err := o.parent(rel)
	if err != nil {
		return -1, err
	}
	defer unix.Close(dfd)
	return unix.Openat(dfd, name, flags|unix.O_NOFOLLOW|unix.O_CLOEXEC, mode)
}

// procPath opens rel with O_PATH (no follow) and returns a /proc/self/fd
// path for calls that have no fd or *at form (chmod, xattrs); it refuses
// symlinks.
func (o *opState) procPath(rel string) (string, func(), error) {
	fd, err := o.openBeneath(rel, unix.O_PATH, 0)
	if err != nil {
		return "", nil, err
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return "", nil, err
	}
	if st.Mode&unix.S_IFMT == unix.S_IFLNK {
		unix.Close(fd)
		return "", nil, unix.ELOOP
	}
	return "/proc/self/fd/" + strconv.Itoa(fd), func() { unix.Close(fd) }, nil
}

func parseMode(s string, def uint32) uint32 {
	if s == "" {
		return def
	}
	m, _ := strconv.ParseUint(s, 8, 32)
	return uint32(m)
}

func writeAll(fd int, b []byte, off int64) error {
	for len(b) > 0 {
		var n int
		var err error
		if off >= 0 {
			n, err = unix.Pwrite(fd, b, off)
			off += int64(n)
		} else {
			n, err = unix.Write(fd, b)
		}
		if err != nil {
			return err
		}
		b = b[n:]
	}
	return nil
}

// shTimeout bounds one shell step.
const shTimeout = 2 * time.Minute

// apply runs one file or shell step on the tree. It returns the step's
// error (compared across paths by errno) and, for sh and fdread, the
// output the step observed.
func (o *opState) apply(ctx context.Context, s Step) (string, error) {
	switch s.Op {
	case "write", "append", "sparse":
		// O_NONBLOCK: opening a FIFO for writing must fail (ENXIO), not
		// wait for a reader; it changes nothing for regular files.
		flags := unix.O_WRONLY | unix.O_CREAT | unix.O_NONBLOCK
		switch s.Op {
		case "write":
			flags |= unix.O_TRUNC
		case "append":
			flags |= unix.O_APPEND
		}
		fd, err := o.openBeneath(s.Path, flags, parseMode(s.Mode, 0o644))
		if err != nil {
			return "", err
		}
		defer unix.Close(fd)
		if s.Mode != "" && s.Op == "write" {
			if err := unix.Fchmod(fd, parseMode(s.Mode, 0o644)); err != nil {
				return "", err
			}
		}
		off := int64(-1)
		if s.Op == "sparse" {
			off = s.Offset
		}
		if err := writeAll(fd, s.content(), off); err != nil {
			return "", err
		}
		if s.Op == "sparse" && s.Size > 0 {
			var st unix.Stat_t
			if err := unix.Fstat(fd, &st); err != nil {
				return "", err
			}
			if st.Size < s.Size {
				return "", unix.Ftruncate(fd, s.Size)
			}
		}
		return "", nil
	case "truncate":
		fd, err := o.openBeneath(s.Path, unix.O_WRONLY|unix.O_NONBLOCK, 0)
		if err != nil {
			return "", err
		}
		defer unix.Close(fd)
		return "", unix.Ftruncate(fd, s.Size)
	case "mkdir":
		dfd, name, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		if err := unix.Mkdirat(dfd, name, parseMode(s.Mode, 0o755)); err != nil {
			return "", err
		}
		if s.Mode != "" { // umask-independent
			p, done, err := o.procPath(s.Path)
			if err != nil {
				return "", err
			}
			defer done()
			return "", unix.Chmod(p, parseMode(s.Mode, 0o755))
		}
		return "", nil
	case "rm":
		dfd, name, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		var st unix.Stat_t
		if err := unix.Fstatat(dfd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return "", err
		}
		if st.Mode&unix.S_IFMT == unix.S_IFDIR {
			return "", unix.Unlinkat(dfd, name, unix.AT_REMOVEDIR)
		}
		return "", unix.Unlinkat(dfd, name, 0)
	case "rmtree":
		if _, err := o.openBeneathCheck(s.Path); err != nil {
			return "", err
		}
		return o.run(ctx, []string{"rm", "-rf", "--", s.Path})
	case "rename":
		sfd, sname, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(sfd)
		dfd, dname, err := o.parent(s.To)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		return "", unix.Renameat(sfd, sname, dfd, dname)
	case "link":
		sfd, sname, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(sfd)
		dfd, dname, err := o.parent(s.To)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		return "", unix.Linkat(sfd, sname, dfd, dname, 0)
	case "symlink":
		dfd, name, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		return "", unix.Symlinkat(s.Target, dfd, name)
	case "chmod":
		p, done, err := o.procPath(s.Path)
		if err != nil {
			return "", err
		}
		defer done()
		return "", unix.Chmod(p, parseMode(s.Mode, 0))
	case "chown":
		dfd, name, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		uid, gid := -1, -1
		if s.UID != nil {
			uid = *s.UID
		}
		if s.GID != nil {
			gid = *s.GID
		}
		return "", unix.Fchownat(dfd, name, uid, gid, unix.AT_SYMLINK_NOFOLLOW)
	case "setxattr", "rmxattr":
		p, done, err := o.procPath(s.Path)
		if err != nil {
			return "", err
		}
		defer done()
		if s.Op == "rmxattr" {
			return "", unix.Removexattr(p, s.Name)
		}
		return "", unix.Setxattr(p, s.Name, []byte(s.Value), 0)
	case "mknod":
		dfd, name, err := o.parent(s.Path)
		if err != nil {
			return "", err
		}
		defer unix.Close(dfd)
		mode := parseMode(s.Mode, 0o644)
		if s.Kind == "fifo" {
			return "", unix.Mknodat(dfd, name, unix.S_IFIFO|mode, 0)
		}
		return "", unix.Mknodat(dfd, name, unix.S_IFCHR|mode, int(unix.Mkdev(s.Major, s.Minor)))
	case "mmap":
		// Never mmap in this process: it may be the FUSE server of the
		// file (a page fault would wait for a server the Go runtime may be
		// stopping). A child process maps and writes the range.
		if _, err := o.openBeneathCheck(s.Path); err != nil {
			return "", err
		}
		script := `import mmap,os,sys
fd=os.open(sys.argv[1],os.O_RDWR|os.O_NOFOLLOW|os.O_NONBLOCK)
off=int(sys.argv[2]);data=sys.argv[3].encode()
if os.fstat(fd).st_size<off+len(data): sys.exit(22)
m=mmap.mmap(fd,0);m[off:off+len(data)]=data;m.flush();m.close();os.close(fd)`
		return o.run(ctx, []string{"python3", "-c", script, s.Path, strconv.FormatInt(s.Offset, 10), string(s.content())})
	case "open":
		flags := unix.O_RDONLY
		switch s.Flags {
		case "w":
			flags = unix.O_WRONLY
		case "rw":
			flags = unix.O_RDWR
		case "a":
			flags = unix.O_WRONLY | unix.O_APPEND
		case "creat":
			flags = unix.O_RDWR | unix.O_CREAT
		}
		if old, ok := o.fds[s.FD]; ok {
			old.f.Close()
			delete(o.fds, s.FD)
		}
		fd, err := o.openBeneath(s.Path, flags|unix.O_NONBLOCK, parseMode(s.Mode, 0o644))
		if err != nil {
			return "", err
		}
		o.fds[s.FD] = &heldFD{f: os.NewFile(uintptr(fd), s.Path), path: s.Path, flags: flags &^ unix.O_CREAT}
		return "", nil
	case "fdwrite":
		h, ok := o.fds[s.FD]
		if !ok {
			return "", unix.EBADF
		}
		off := int64(-1)
		if s.At != nil {
			off = *s.At
		}
		return "", writeAll(int(h.f.Fd()), s.content(), off)
	case "fdread":
		h, ok := o.fds[s.FD]
		if !ok {
			return "", unix.EBADF
		}
		buf := make([]byte, 1<<20)
		n, err := unix.Pread(int(h.f.Fd()), buf, 0)
		if err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	case "close":
		h, ok := o.fds[s.FD]
		if !ok {
			return "", unix.EBADF
		}
		delete(o.fds, s.FD)
		return "", h.f.Close()
	case "sh":
		return o.run(ctx, []string{"sh", "-c", s.Cmd})
	case "expect":
		fd, err := o.openBeneath(s.Path, unix.O_RDONLY|unix.O_NONBLOCK, 0)
		if s.Absent {
			if err == nil {
				unix.Close(fd)
				return "", fmt.Errorf("%s exists, want absent", s.Path)
			}
			if errors.Is(err, unix.ENOENT) {
				return "", nil
			}
			return "", err
		}
		if err != nil {
			return "", err
		}
		f := os.NewFile(uintptr(fd), s.Path)
		defer f.Close()
		var b bytes.Buffer
		if _, err := b.ReadFrom(f); err != nil {
			return "", err
		}
		if b.String() != *s.Expect {
			return "", fmt.Errorf("%s: content %q, want %q", s.Path, trunc(b.String()), trunc(*s.Expect))
		}
		return "", nil
	}
	return "", fmt.Errorf("op %q is not a file operation", s.Op)
}

func (o *opState) openBeneathCheck(rel string) (struct{}, error) {
	fd, err := o.openBeneath(rel, unix.O_PATH, 0)
	if err != nil {
		return struct{}{}, err
	}
	unix.Close(fd)
	return struct{}{}, nil
}

// exitError is a command's non-zero exit status (compared across paths).
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

// run runs argv with the tree root as working directory and a fixed
// environment; the combined output is returned.
func (o *opState) run(ctx context.Context, argv []string) (string, error) {
	ctx, cancel := context.WithTimeout(ctx, shTimeout)
	defer cancel()
	// env changes into the root after its exec, not cmd.Dir before it:
	// between clone and execve the Go runtime of this process, which also
	// serves the FUSE mount, cannot always schedule the server's reader, so
	// a chdir into the mount there can wait forever (seen in CI: the child
	// hung in the GETATTR of its chdir, holding the connection open).
	cmd := exec.CommandContext(ctx, "env", append([]string{"-C", o.root, "--"}, argv...)...)
	cmd.Dir = "/"
	cmd.Env = []string{"PATH=/usr/local/bin:/usr/bin:/bin:/usr/sbin:/sbin", "LC_ALL=C", "HOME=/nonexistent",
		"PYTHONDONTWRITEBYTECODE=1", "PYTHONHASHSEED=0", "SOURCE_DATE_EPOCH=0", "TZ=UTC"}
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	out, err := cmd.CombinedOutput()
	if err != nil {
		var ee *exec.ExitError
		if errors.As(err, &ee) && ee.ExitCode() >= 0 {
			return string(out), exitError{ee.ExitCode()}
		}
		return string(out), fmt.Errorf("%s: %w", argv[0], err)
	}
	return string(out), nil
}

// reopenFDs points every held descriptor at the same path in the (new)
// tree, keeping its offset: the lazy fd redirection rewind promises after
// a restore.
func (o *opState) reopenFDs() {
	for name, h := range o.fds {
		off, _ := h.f.Seek(0, 1)
		h.f.Close()
		fd, err := o.openBeneath(h.path, h.flags|unix.O_NONBLOCK, 0)
		if err != nil {
			// The path is gone in the restored view: the descriptor is
			// stale; later uses fail with EBADF.
			delete(o.fds, name)
			continue
		}
		f := os.NewFile(uintptr(fd), h.path)
		_, _ = f.Seek(off, 0)
		o.fds[name] = &heldFD{f: f, path: h.path, flags: h.flags}
	}
}

func (o *opState) closeFDs() {
	for name, h := range o.fds {
		h.f.Close()
		delete(o.fds, name)
	}
}

func trunc(s string) string {
	if len(s) > 200 {
		return s[:200] + "..."
	}
	return s
}

// errName renders an error for cross-path comparison: the errno name when
// there is one, the exit status of a command, else "error".
func errName(err error) string {
	if err == nil {
		return "ok"
	}
	var en syscall.Errno
	if errors.As(err, &en) {
		if n := unix.ErrnoName(en); n != "" {
			return n
		}
		return "errno " + strconv.Itoa(int(en))
	}
	var ee exitError
	if errors.As(err, &ee) {
		return ee.Error()
	}
	return "error: " + err.Error()
}
