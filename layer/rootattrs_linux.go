package layer

import (
	"fmt"
	"strings"

	"golang.org/x/sys/unix"
)

// CopyRootAttrs gives the layer root directory "to" the attributes of the
// layer root directory "from": mode, owner, access and modification times and
// xattrs (overlayfs's own, XattrPrefixOverlay, are neither copied nor
// removed). A view's root attributes are its upper's root directory's (in
// overlayfs and in the FUSE backend alike), so every new upper, and every
// layer frozen from one, must carry them: otherwise a chmod, chown or
// setxattr of a sandbox's root is lost with the next upper. Both are
// directories the store made (or a lower the user named), never a path of
// the sandbox's.
func CopyRootAttrs(from, to string) error {
	a, err := ReadRootAttrs(from)
	if err != nil {
		return err
	}
	return a.Apply(to)
}

// RootAttrs are the attributes of a layer root directory that
// CopyRootAttrs copies, read at one moment (ReadRootAttrs) and given to
// another directory later (Apply): a checkpoint reads them inside the
// sandbox's freeze window and may write its layer after it.
type RootAttrs struct {
	from   string
	st     unix.Stat_t
	xattrs map[string][]byte
}

// ReadRootAttrs reads the root attributes of directory from.
func ReadRootAttrs(from string) (RootAttrs, error) {
	a := RootAttrs{from: from}
	if err := unix.Lstat(from, &a.st); err != nil {
		return a, fmt.Errorf("root attributes of %s: %w", from, err)
	}
	if a.st.Mode&unix.S_IFMT != unix.S_IFDIR {
		return a, fmt.Errorf("root attributes of %s: not a directory", from)
	}
	names, err := userXattrs(from)
	if err != nil {
		return a, fmt.Errorf("root xattrs of %s: %w", from, err)
	}
	buf := make([]byte, 64<<10)
	a.xattrs = make(map[string][]byte, len(names))
	for name := range names {
		n, err := unix.Lgetxattr(from, name, buf)
		if err != nil {
			continue // gone meanwhile
		}
		a.xattrs[name] = append([]byte(nil), buf[:n]...)
	}
	return a, nil
}

// Apply gives directory to the attributes read.
func (a RootAttrs) Apply(to string) error {
	ss := a.st
	var ds unix.Stat_t
	if err := unix.Lstat(to, &ds); err != nil {
		return fmt.Errorf("root attributes of %s: %w", to, err)
	}
	if ds.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("root attributes from %s to %s: not directories", a.from, to)
	}
	if ss.Uid != ds.Uid || ss.Gid != ds.Gid {
		if err := unix.Lchown(to, int(ss.Uid), int(ss.Gid)); err != nil {
			return fmt.Errorf("root owner of %s: %w", to, err)
		}
		ds.Mode = unix.S_IFDIR // a chown may drop bits: set the mode again
	}
	if ss.Mode&07777 != ds.Mode&07777 {
		if err := unix.Chmod(to, ss.Mode&07777); err != nil {
			return fmt.Errorf("root mode of %s: %w", to, err)
		}
	}
	have, err := userXattrs(to)
	if err != nil {
		return fmt.Errorf("root xattrs of %s: %w", to, err)
	}
	for name := range have {
		if _, ok := a.xattrs[name]; !ok {
			if err := unix.Lremovexattr(to, name); err != nil && err != unix.ENODATA {
				return fmt.Errorf("root xattr %s of %s: %w", name, to, err)
			}
		}
	}
	for name, v := range a.xattrs {
		if err := unix.Lsetxattr(to, name, v, 0); err != nil && err != unix.EPERM && err != unix.ENOTSUP {
			return fmt.Errorf("root xattr %s of %s: %w", name, to, err)
		}
	}
	if ss.Atim != ds.Atim || ss.Mtim != ds.Mtim {
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, to, []unix.Timespec{ss.Atim, ss.Mtim}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("root times of %s: %w", to, err)
		}
	}
	return nil
}

// userXattrs lists the xattr names of p other than overlayfs's own.
func userXattrs(p string) (map[string]struct{}, error) {
	buf := make([]byte, 64<<10)
	n, err := unix.Llistxattr(p, buf)
	if err == unix.ENOTSUP {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	out := map[string]struct{}{}
	for _, a := range strings.Split(string(buf[:n]), "\x00") {
		if a != "" && !strings.HasPrefix(a, XattrPrefixOverlay) {
			out[a] = struct{}{}
		}
	}
	return out, nil
}
