package kernelpath

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// btrfs subvolume ioctls (linux/btrfs.h), absent from x/sys. Each takes a
// 4096-byte argument: _IOW(0x94, nr, 4096).
const (
	btrfsIocSubvolCreate  = 0x5000940e // BTRFS_IOC_SUBVOL_CREATE, struct btrfs_ioctl_vol_args
	btrfsIocSnapDestroy   = 0x5000940f // BTRFS_IOC_SNAP_DESTROY, struct btrfs_ioctl_vol_args
	btrfsIocSnapCreateV2  = 0x50009417 // BTRFS_IOC_SNAP_CREATE_V2, struct btrfs_ioctl_vol_args_v2
	btrfsSubvolRdonly     = 1 << 1     // BTRFS_SUBVOL_RDONLY
	btrfsVolNameMax       = 4087
	btrfsVolArgsV2NameLen = 4040
)

// btrfsVolArgs is struct btrfs_ioctl_vol_args.
type btrfsVolArgs struct {
	fd   int64
	name [btrfsVolNameMax + 1]byte
}

// btrfsVolArgsV2 is struct btrfs_ioctl_vol_args_v2 (the union members
// unused here are zero).
type btrfsVolArgsV2 struct {
	fd      int64
	transid uint64
	flags   uint64
	unused  [4]uint64
	name    [btrfsVolArgsV2NameLen]byte
}

func btrfsIoctl(dirfd int, req uintptr, arg unsafe.Pointer) error {
	if _, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(dirfd), req, uintptr(arg)); e != 0 {
		return e
	}
	return nil
}

// btrfsSubvolCreate creates subvolume name in directory dir.
func btrfsSubvolCreate(dir, name string) error {
	if err := btrfsNameIoctl(dir, name, btrfsIocSubvolCreate); err != nil {
		return fmt.Errorf("create subvolume %s in %s: %w", name, dir, err)
	}
	return nil
}

// btrfsNameIoctl issues req, an ioctl taking struct btrfs_ioctl_vol_args
// with a subvolume name, on directory dir.
func btrfsNameIoctl(dir, name string, req uintptr) error {
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	var a btrfsVolArgs
	copy(a.name[:btrfsVolNameMax], name)
	return btrfsIoctl(fd, req, unsafe.Pointer(&a))
}

// btrfsSnapshot snapshots subvolume src as name in directory dir
// (read-only if ro): one transaction commit, whatever the subvolume holds.
func btrfsSnapshot(src, dir, name string, ro bool) error {
	sfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	dfd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	a := btrfsVolArgsV2{fd: int64(sfd)}
	if ro {
		a.flags = btrfsSubvolRdonly
	}
	copy(a.name[:btrfsVolArgsV2NameLen-1], name)
	if err := btrfsIoctl(dfd, btrfsIocSnapCreateV2, unsafe.Pointer(&a)); err != nil {
		return fmt.Errorf("snapshot %s as %s in %s: %w", src, name, dir, err)
	}
	return nil
}

// btrfsSubvolDestroy deletes subvolume (or snapshot, read-only or not)
// name in directory dir.
func btrfsSubvolDestroy(dir, name string) error {
	if err := btrfsNameIoctl(dir, name, btrfsIocSnapDestroy); err != nil {
		return fmt.Errorf("delete subvolume %s in %s: %w", name, dir, err)
	}
	return nil
}

// measureBtrfsSnapshot times what a checkpoint by btrfs read-only snapshot
// of the upper would cost on the btrfs holding dir: a scratch subvolume,
// `entries` small files written before each snapshot (they must reach the
// snapshot, so the kernel flushes them in the commit), median of runs.
// Everything is deleted before it returns.
func measureBtrfsSnapshot(dir string, entries, runs int) (time.Duration, error) {
	name := ".kernelpath-snap-" + strconv.Itoa(os.Getpid())
	if err := btrfsSubvolCreate(dir, name); err != nil {
		return 0, err
	}
	sv := filepath.Join(dir, name)
	var snaps []string
	defer func() {
		for _, s := range snaps {
			_ = btrfsSubvolDestroy(dir, s)
		}
		_ = os.RemoveAll(sv) // rmdir of an empty subvolume deletes it
		_ = btrfsSubvolDestroy(dir, name)
	}()
	var ds []time.Duration
	for r := range runs {
		for i := range entries {
			p := filepath.Join(sv, "f"+strconv.Itoa(r)+"-"+strconv.Itoa(i))
			if err := os.WriteFile(p, []byte("rewind self-test\n"), 0o644); err != nil {
				return 0, err
			}
		}
		s := name + "-" + strconv.Itoa(r)
		t0 := time.Now()
		if err := btrfsSnapshot(sv, dir, s, true); err != nil {
			return 0, err
		}
		ds = append(ds, time.Since(t0))
		snaps = append(snaps, s)
	}
	return median(ds), nil
}
