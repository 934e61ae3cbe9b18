package tree

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"path"
	"sort"
	"strings"

	"golang.org/x/sys/unix"
)

// Take snapshots the tree rooted at root.
func Take(root string, opts Options) (Snapshot, error) {
	if len(opts.XattrPrefixes) == 0 {
		opts.XattrPrefixes = []string{"user."}
	}
	fd, err := unix.Open(root, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", root, err)
	}
	defer unix.Close(fd)
	w := &walker{opts: opts, exclude: map[string]bool{}}
	for _, e := range opts.Exclude {
		w.exclude[strings.Trim(e, "/")] = true
	}
	if err := w.walk(fd, ""); err != nil {
		return nil, fmt.Errorf("snapshot %s: %w", root, err)
	}
	snap := Snapshot(w.entries)
	sort.Slice(snap, func(i, j int) bool { return snap[i].Path < snap[j].Path })
	if !opts.IgnoreNlink {
		groups := map[[2]uint64]string{}
		for i := range snap {
			if k, ok := w.inodes[snap[i].Path]; ok && snap[i].Nlink > 1 {
				if _, seen := groups[k]; !seen {
					groups[k] = snap[i].Path // sorted: the first is the smallest
				}
			}
		}
		for i := range snap {
			if k, ok := w.inodes[snap[i].Path]; ok && snap[i].Nlink > 1 {
				snap[i].LinkGroup = groups[k]
			}
		}
	}
	return snap, nil
}

type walker struct {
	opts    Options
	exclude map[string]bool
	entries []Entry
	inodes  map[string][2]uint64
}

func (w *walker) walk(dirfd int, rel string) error {
	var st unix.Stat_t
	if err := unix.Fstat(dirfd, &st); err != nil {
		return fmt.Errorf("stat %q: %w", rel, err)
	}
	if !(rel == "" && w.opts.IgnoreRoot) {
		e := w.entry(rel, &st)
		if err := w.xattrs(dirfd, &e); err != nil {
			return err
		}
		w.entries = append(w.entries, e)
	}
	names, err := readdirnames(dirfd)
	if err != nil {
		return fmt.Errorf("readdir %q: %w", rel, err)
	}
	for _, name := range names {
		p := path.Join(rel, name)
		if w.exclude[p] {
			continue
		}
		var cst unix.Stat_t
		if err := unix.Fstatat(dirfd, name, &cst, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("stat %q: %w", p, err)
		}
		if cst.Mode&unix.S_IFMT == unix.S_IFDIR {
			cfd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return fmt.Errorf("open %q: %w", p, err)
			}
			err = w.walk(cfd, p)
			unix.Close(cfd)
			if err != nil {
				return err
			}
			continue
		}
		e := w.entry(p, &cst)
		switch e.Type {
		case "file":
			fd, err := unix.Openat(dirfd, name, unix.O_RDONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
			if err != nil {
				return fmt.Errorf("open %q: %w", p, err)
			}
			f := os.NewFile(uintptr(fd), p)
			h := sha256.New()
			_, err = io.Copy(h, f)
			if err == nil {
				err = w.xattrs(fd, &e)
			}
			f.Close()
			if err != nil {
				return fmt.Errorf("read %q: %w", p, err)
			}
			e.Hash = hex.EncodeToString(h.Sum(nil))
		case "symlink":
			buf := make([]byte, 4096)
			n, err := unix.Readlinkat(dirfd, name, buf)
			if err != nil {
				return fmt.Errorf("readlink %q: %w", p, err)
			}
			e.Target = string(buf[:n])
		}
		if e.Type != "file" && e.Type != "dir" {
			// xattrs of special files: read through the O_PATH-less path API
			// relative to /proc/self/fd of the parent, never following links.
			if err := w.lxattrs(dirfd, name, &e); err != nil {
				return err
			}
		}
		w.entries = append(w.entries, e)
	}
	return nil
}

func (w *walker) entry(p string, st *unix.Stat_t) Entry {
	e := Entry{Path: p, Mode: st.Mode & 0o7777, UID: st.Uid, GID: st.Gid}
	switch st.Mode & unix.S_IFMT {
	case unix.S_IFDIR:
		e.Type = "dir"
	case unix.S_IFREG:
		e.Type, e.Size = "file", st.Size
	case unix.S_IFLNK:
		e.Type, e.Size = "symlink", st.Size
		e.Mode = 0 // symlink modes are meaningless on Linux
	case unix.S_IFIFO:
		e.Type = "fifo"
	case unix.S_IFSOCK:
		e.Type = "socket"
	case unix.S_IFCHR:
		e.Type, e.Rdev = "chardev", st.Rdev
	case unix.S_IFBLK:
		e.Type, e.Rdev = "blockdev", st.Rdev
	}
	if e.Type != "dir" {
		if !w.opts.IgnoreNlink {
			e.Nlink = st.Nlink
			if w.inodes == nil {
				w.inodes = map[string][2]uint64{}
			}
			w.inodes[p] = [2]uint64{st.Dev, st.Ino}
		}
		if w.opts.Times {
			e.MtimeNS = st.Mtim.Nano()
		}
	}
	return e
}

func (w *walker) keep(name string) bool {
	for _, p := range w.opts.XattrPrefixes {
		if strings.HasPrefix(name, p) {
			return true
		}
	}
	return false
}

func (w *walker) xattrs(fd int, e *Entry) error {
	return w.readXattrs(e,
		func(b []byte) (int, error) { return unix.Flistxattr(fd, b) },
		func(n string, b []byte) (int, error) { return unix.Fgetxattr(fd, n, b) })
}

// lxattrs reads the xattrs of a special file through its parent's fd,
// never following a symlink; file systems that refuse them yield none.
func (w *walker) lxattrs(dirfd int, name string, e *Entry) error {
	p := fmt.Sprintf("/proc/self/fd/%d/%s", dirfd, name)
	err := w.readXattrs(e,
		func(b []byte) (int, error) { return unix.Llistxattr(p, b) },
		func(n string, b []byte) (int, error) { return unix.Lgetxattr(p, n, b) })
	if errors.Is(err, unix.EPERM) || errors.Is(err, unix.ENOTSUP) {
		return nil
	}
	return err
}

// readXattrs records into e the xattrs selected by the options.
func (w *walker) readXattrs(e *Entry, list func([]byte) (int, error), get func(string, []byte) (int, error)) error {
	names, err := listxattr(list)
	if err != nil {
		return fmt.Errorf("listxattr %q: %w", e.Path, err)
	}
	for _, n := range names {
		if !w.keep(n) {
			continue
		}
		v, err := getxattr(func(b []byte) (int, error) { return get(n, b) })
		if err != nil {
			return fmt.Errorf("getxattr %q %s: %w", e.Path, n, err)
		}
		if e.Xattrs == nil {
			e.Xattrs = map[string]string{}
		}
		e.Xattrs[n] = v
	}
	return nil
}

func listxattr(f func([]byte) (int, error)) ([]string, error) {
	buf := make([]byte, 1024)
	for {
		n, err := f(buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		if err != nil {
			return nil, err
		}
		var names []string
		for _, s := range strings.Split(string(buf[:n]), "\x00") {
			if s != "" {
				names = append(names, s)
			}
		}
		return names, nil
	}
}

func getxattr(f func([]byte) (int, error)) (string, error) {
	buf := make([]byte, 256)
	for {
		n, err := f(buf)
		if errors.Is(err, unix.ERANGE) {
			buf = make([]byte, len(buf)*4)
			continue
		}
		if err != nil {
			return "", err
		}
		return string(buf[:n]), nil
	}
}

func readdirnames(fd int) ([]string, error) {
	dfd, err := unix.FcntlInt(uintptr(fd), unix.F_DUPFD_CLOEXEC, 0) // no program started meanwhile inherits it
	if err != nil {
		return nil, err
	}
	f := os.NewFile(uintptr(dfd), "dir")
	defer f.Close()
	if _, err := f.Seek(0, io.SeekStart); err != nil {
		return nil, err
	}
	names, err := f.Readdirnames(-1)
	if err != nil {
		return nil, err
	}
	sort.Strings(names)
	return names, nil
}
