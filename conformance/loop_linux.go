package conformance

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"

	"golang.org/x/sys/unix"
)

// MakeLoopXFS creates an XFS file system with reflink=1 in a sparse file of
// size bytes under dir, loop-mounts it at dir/xfs and returns the mount
// point. The kernel path freezes layers by reflink there, as on a
// production host. Needs root, mkfs.xfs (xfsprogs) and a loop device.
func MakeLoopXFS(dir string, size int64) (string, error) {
	if _, err := exec.LookPath("mkfs.xfs"); err != nil {
		return "", fmt.Errorf("loop xfs: mkfs.xfs not found (install xfsprogs)")
	}
	img := filepath.Join(dir, "xfs.img")
	f, err := os.Create(img)
	if err != nil {
		return "", fmt.Errorf("loop xfs: %w", err)
	}
	err = f.Truncate(size)
	f.Close()
	if err != nil {
		return "", fmt.Errorf("loop xfs: %w", err)
	}
	if out, err := exec.Command("mkfs.xfs", "-q", "-f", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		return "", fmt.Errorf("loop xfs: mkfs.xfs: %v: %s", err, out)
	}
	mp := filepath.Join(dir, "xfs")
	if err := os.Mkdir(mp, 0o755); err != nil {
		return "", fmt.Errorf("loop xfs: %w", err)
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mp).CombinedOutput(); err != nil {
		return "", fmt.Errorf("loop xfs: mount: %v: %s", err, out)
	}
	return mp, nil
}

// RemoveLoopXFS unmounts what MakeLoopXFS mounted and removes the image.
func RemoveLoopXFS(dir, mp string) error {
	if err := unix.Unmount(mp, 0); err != nil {
		if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount %s: %w", mp, err)
		}
	}
	return os.Remove(filepath.Join(dir, "xfs.img"))
}
