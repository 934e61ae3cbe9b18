package fs

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// inheritRootMeta gives the upper of st the attributes of the view's root
// as the layers below it define them: mode, owner, times and xattrs of the
// next layer's root (st.top[1]; nothing to do without one). The view's
// root attributes are always its upper's root directory's (as in
// overlayfs), so an upper pushed by a checkpoint or a switch, or made for a
// new mount over lowers, must carry them or a chmod, chown or xattr of the
// sandbox's root would be lost with the next upper. Overlayfs's own xattrs
// are not copied. The caller holds f.mu for writing (or owns st alone).
func inheritRootMeta(st *stack) error {
	if len(st.top) < 2 {
		return nil
	}
	from, to := st.top[1].path, st.upper.path
	var ss, ds unix.Stat_t
	if err := unix.Lstat(from, &ss); err != nil {
		return fmt.Errorf("root attributes of %s: %w", from, err)
	}
	if err := unix.Lstat(to, &ds); err != nil {
		return fmt.Errorf("root attributes of the new upper: %w", err)
	}
	if ss.Uid != ds.Uid || ss.Gid != ds.Gid {
		if err := unix.Lchown(to, int(ss.Uid), int(ss.Gid)); err != nil {
			return fmt.Errorf("root owner of the new upper: %w", err)
		}
		ds.Mode = 0 // a chown can drop bits: set the mode again
	}
	if ss.Mode&07777 != ds.Mode&07777 {
		if err := unix.Chmod(to, ss.Mode&07777); err != nil {
			return fmt.Errorf("root mode of the new upper: %w", err)
		}
	}
	want, err := listXattrs(from)
	if err != nil {
		return fmt.Errorf("root xattrs of %s: %w", from, err)
	}
	have, err := listXattrs(to)
	if err != nil {
		return fmt.Errorf("root xattrs of the new upper: %w", err)
	}
	if len(want) > 0 || len(have) > 0 {
		keep := map[string]bool{}
		for _, a := range want {
			keep[a] = true
		}
		for _, a := range have {
			if !keep[a] {
				if err := unix.Lremovexattr(to, a); err != nil && err != unix.ENODATA {
					return fmt.Errorf("root xattr %s of the new upper: %w", a, err)
				}
			}
		}
		if err := copyXattrs(from, to); err != nil {
			return fmt.Errorf("root xattrs of the new upper: %w", err)
		}
	}
	if ss.Atim != ds.Atim || ss.Mtim != ds.Mtim {
		if err := unix.UtimesNanoAt(unix.AT_FDCWD, to, []unix.Timespec{ss.Atim, ss.Mtim}, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("root times of the new upper: %w", err)
		}
	}
	return nil
}
