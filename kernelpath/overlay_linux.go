package kernelpath

import (
	"errors"
	"fmt"
	"os"
	"strings"

	"golang.org/x/sys/unix"
)

// moveMountBeneath is MOVE_MOUNT_BENEATH (Linux 6.5), absent from x/sys.
const moveMountBeneath = 0x00000200

// ovlMaxStack is overlayfs's limit on lower layers (OVL_MAX_STACK).
const ovlMaxStack = 500

// stack is what one overlay mount is made of.
type stack struct {
	lowers []string // absolute directories, topmost first
	upper  string
	work   string
}

// createOverlay builds a detached overlay mount with the new mount API and
// returns its mount fd. One "lowerdir+" per layer: no option-string limit.
func createOverlay(s stack) (int, error) {
	if len(s.lowers) == 0 {
		return -1, errors.New("overlay needs at least one lower layer")
	}
	if len(s.lowers) > ovlMaxStack {
		return -1, fmt.Errorf("stack of %d lower layers exceeds overlayfs's limit of %d: compact the layers", len(s.lowers), ovlMaxStack)
	}
	fsfd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fsfd)
	set := func(key, val string) error {
		if err := unix.FsconfigSetString(fsfd, key, val); err != nil {
			return fmt.Errorf("overlay option %s=%q: %w%s", key, val, err, fsMessages(fsfd))
		}
		return nil
	}
	if err := set("source", "rewind"); err != nil {
		return -1, err
	}
	for _, l := range s.lowers {
		if err := set("lowerdir+", l); err != nil {
			return -1, err
		}
	}
	opts := [][2]string{
		{"upperdir", s.upper},
		{"workdir", s.work},
		// The shared layer format: directory renames are recorded as
		// trusted.overlay.redirect; no metacopy-only files; no index (a
		// layer is mounted by several overlays over its life).
		{"redirect_dir", "on"},
		{"metacopy", "off"},
		{"index", "off"},
	}
	for _, o := range opts {
		if err := set(o[0], o[1]); err != nil {
			return -1, err
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return -1, fmt.Errorf("create overlay: %w%s", err, fsMessages(fsfd))
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return -1, fmt.Errorf("fsmount overlay: %w%s", err, fsMessages(fsfd))
	}
	return mfd, nil
}

// fsMessages drains the kernel's messages from a fs context fd.
func fsMessages(fsfd int) string {
	var msgs []string
	buf := make([]byte, 512)
	for range 8 {
		n, err := unix.Read(fsfd, buf)
		if err != nil || n <= 0 {
			break
		}
		msgs = append(msgs, strings.TrimSpace(string(buf[:n])))
	}
	if len(msgs) == 0 {
		return ""
	}
	return " (" + strings.Join(msgs, "; ") + ")"
}

// attach moves the detached mount mfd onto mountpoint.
func attach(mfd int, mountpoint string) error {
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, mountpoint, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("move_mount onto %s: %w", mountpoint, err)
	}
	return nil
}

// replace puts the detached mount mfd in place of the mount at mountpoint:
// beneath it first (MOVE_MOUNT_BENEATH), then the old one is lazily
// detached, so a lookup sees either the old or the new view, never the bare
// directory. Without MOVE_MOUNT_BENEATH it detaches first, then attaches.
// On error the old mount is still in place unless the returned bool says
// the old mount was detached.
//
// The old mount is pinned by the returned fd (-1 if none): tearing an
// overlay down syncs its upper's file system (overlayfs's sync_fs, 2-10 ms
// on a loop XFS or btrfs here, a transaction commit with a flush), and the
// last reference pays for it. Closing the pin later, off the caller's
// critical path, moves that cost out of the switch.
func replace(mfd int, mountpoint string) (oldGone bool, pin int, err error) {
	pin, perr := unix.Open(mountpoint, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if perr != nil {
		pin = -1 // the switch still works; the teardown is then synchronous
	}
	unpin := func() {
		if pin >= 0 {
			unix.Close(pin)
			pin = -1
		}
	}
	berr := unix.MoveMount(mfd, "", unix.AT_FDCWD, mountpoint, unix.MOVE_MOUNT_F_EMPTY_PATH|moveMountBeneath)
	if berr == nil {
		if err := unix.Unmount(mountpoint, unix.MNT_DETACH); err != nil {
			unpin()
			return false, -1, fmt.Errorf("detach old mount at %s: %w", mountpoint, err)
		}
		return true, pin, nil
	}
	if err := unix.Unmount(mountpoint, unix.MNT_DETACH); err != nil {
		unpin()
		return false, -1, fmt.Errorf("detach old mount at %s (mount beneath failed: %v): %w", mountpoint, berr, err)
	}
	if err := attach(mfd, mountpoint); err != nil {
		return true, pin, err
	}
	return true, pin, nil
}

// isMountRoot reports whether path is the root of a mount.
func isMountRoot(path string) (bool, error) {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_BASIC_STATS, &stx); err != nil {
		return false, err
	}
	if stx.Attributes_mask&unix.STATX_ATTR_MOUNT_ROOT != 0 {
		return stx.Attributes&unix.STATX_ATTR_MOUNT_ROOT != 0, nil
	}
	// Old kernels: compare with the parent's device.
	var st, pst unix.Stat_t
	if err := unix.Lstat(path, &st); err != nil {
		return false, err
	}
	if err := unix.Lstat(path+"/..", &pst); err != nil {
		return false, err
	}
	return st.Dev != pst.Dev, nil
}

// mountID returns the id of the mount whose root is at path (0 if
// unknown).
func mountID(path string) uint64 {
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, path, unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &stx); err != nil || stx.Mask&unix.STATX_MNT_ID == 0 {
		return 0
	}
	return stx.Mnt_id
}

// fsType names the file system holding path ("xfs", "btrfs", "ext4", ...).
func fsType(path string) string {
	var sfs unix.Statfs_t
	if err := unix.Statfs(path, &sfs); err != nil {
		return "unknown"
	}
	switch uint32(sfs.Type) {
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlay"
	case unix.FUSE_SUPER_MAGIC:
		return "fuse"
	}
	return fmt.Sprintf("0x%x", uint32(sfs.Type))
}

// probeReflink reports whether FICLONE works in dir (on the state dir's
// file system).
func probeReflink(dir string) bool {
	src, err := os.CreateTemp(dir, ".reflink-probe-*")
	if err != nil {
		return false
	}
	defer os.Remove(src.Name())
	defer src.Close()
	if _, err := src.Write(make([]byte, 4096)); err != nil {
		return false
	}
	dst, err := os.CreateTemp(dir, ".reflink-probe-*")
	if err != nil {
		return false
	}
	defer os.Remove(dst.Name())
	defer dst.Close()
	return unix.IoctlFileClone(int(dst.Fd()), int(src.Fd())) == nil
}
