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
	var ss, ds unix.Stat_t
	if err := unix.Lstat(from, &ss); err != nil {
		return fmt.Errorf("root attributes of %s: %w", from, err)
	}
	if err := unix.Lstat(to, &ds); err != nil {
		return fmt.Errorf("root attributes of %s: %w", to, err)
	}
	if ss.Mode&unix.S_IFMT != unix.S_IFDIR || ds.Mode&unix.S_IFMT != unix.S_IFDIR {
		return fmt.Errorf("root attributes from %s to %s: not directories", from, to)
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
	want, err := userXattrs(from)
	if err != nil {
		return fmt.Errorf("root xattrs of %s: %w", from, err)
	}
	have, err := userXattrs(to)
	if err != nil {
		return fmt.Errorf("root xattrs of %s: %w", to, err)
	}
	buf := make([]byte, 64<<10)
	for a := range have {
		if _, ok := want[a]; !ok {
			if err := unix.Lremovexattr(to, a); err != nil && err != unix.ENODATA {
				return fmt.Errorf("root xattr %s of %s: %w", a, to, err)
			}
		}
	}
	for a := range want {
		n, err := unix.Lgetxattr(from, a, buf)
		if err != nil {
			continue // gone meanwhile
		}
		if err := unix.Lsetxattr(to, a, buf[:n], 0); err != nil && err != unix.EPERM && err != unix.ENOTSUP {
			return fmt.Errorf("root xattr %s of %s: %w", a, to, err)
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
