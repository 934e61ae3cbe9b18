package kernelpath

// The layer-switch ioctl of a patched overlayfs. The contract is
// kernelpath/ABI.md; keep the two in sync.
//
// UNTESTED ON THIS HOST: stock kernels return ENOTTY to the probe, so only
// the probe path runs in CI. The callers (ioctlCheckpoint, ioctlSwitch) are
// deliberately small and are only reached after a successful QUERY.

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Operations of the layer-switch ioctl.
const (
	ovlLSQuery      = 0
	ovlLSCheckpoint = 1
	ovlLSSwitch     = 2
)

// ovlLayerSwitch mirrors struct ovl_layer_switch (64 bytes, no implicit
// padding on any 64-bit or 32-bit ABI).
type ovlLayerSwitch struct {
	Size     uint32
	Op       uint32
	Flags    uint64
	Gen      uint64
	UpperFD  int32
	WorkFD   int32
	LowerFDs uint64 // user pointer to int32[NrLowers]
	NrLowers uint32
	NrLayers uint32
	Features uint64
	Reserved uint64
}

const ovlLayerSwitchSize = 64

// ovlIocLayerSwitch is _IOWR('o', 0xE0, struct ovl_layer_switch).
const ovlIocLayerSwitch = 3<<30 | ovlLayerSwitchSize<<16 | 'o'<<8 | 0xE0

func init() {
	if unsafe.Sizeof(ovlLayerSwitch{}) != ovlLayerSwitchSize {
		panic("kernelpath: struct ovl_layer_switch size mismatch")
	}
}

func layerSwitch(rootfd int, arg *ovlLayerSwitch) error {
	arg.Size = ovlLayerSwitchSize
	_, _, e := unix.Syscall(unix.SYS_IOCTL, uintptr(rootfd), ovlIocLayerSwitch, uintptr(unsafe.Pointer(arg)))
	if e != 0 {
		return e
	}
	return nil
}

// queryIoctl asks the overlay whose root is open as rootfd whether it
// implements the layer-switch ioctl. It reads state only.
func queryIoctl(rootfd int) (gen uint64, err error) {
	var a ovlLayerSwitch
	a.Op = ovlLSQuery
	a.UpperFD, a.WorkFD = -1, -1
	if err := layerSwitch(rootfd, &a); err != nil {
		if errors.Is(err, unix.ENOTTY) || errors.Is(err, unix.EINVAL) || errors.Is(err, unix.EOPNOTSUPP) {
			return 0, fmt.Errorf("%w: %v", ErrIoctlAbsent, err)
		}
		return 0, fmt.Errorf("layer-switch query: %w", err)
	}
	if a.Features&(1<<ovlLSCheckpoint|1<<ovlLSSwitch) != 1<<ovlLSCheckpoint|1<<ovlLSSwitch {
		return 0, fmt.Errorf("%w: kernel supports only features %#x", ErrIoctlAbsent, a.Features)
	}
	return a.Gen, nil
}

// ioctlCheckpoint freezes the live upper into the topmost lower and installs
// the empty directories upper/work as the new upper, in the kernel.
// Returns the new generation.
func ioctlCheckpoint(rootfd int, gen uint64, upper, work string) (uint64, error) {
	ufd, wfd, err := openPair(upper, work)
	if err != nil {
		return 0, err
	}
	defer unix.Close(ufd)
	defer unix.Close(wfd)
	a := ovlLayerSwitch{Op: ovlLSCheckpoint, Gen: gen, UpperFD: int32(ufd), WorkFD: int32(wfd)}
	if err := layerSwitch(rootfd, &a); err != nil {
		return 0, fmt.Errorf("layer-switch checkpoint: %w", err)
	}
	return a.Gen, nil
}

// ioctlSwitch replaces the whole stack: lowers (topmost first) plus the
// empty upper/work. Returns the new generation.
func ioctlSwitch(rootfd int, gen uint64, lowers []string, upper, work string) (uint64, error) {
	ufd, wfd, err := openPair(upper, work)
	if err != nil {
		return 0, err
	}
	defer unix.Close(ufd)
	defer unix.Close(wfd)
	fds := make([]int32, 0, len(lowers))
	defer func() {
		for _, fd := range fds {
			unix.Close(int(fd))
		}
	}()
	for _, l := range lowers {
		fd, err := unix.Open(l, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return 0, fmt.Errorf("open lower %s: %w", filepath.Base(l), err)
		}
		fds = append(fds, int32(fd))
	}
	a := ovlLayerSwitch{Op: ovlLSSwitch, Gen: gen, UpperFD: int32(ufd), WorkFD: int32(wfd), NrLowers: uint32(len(fds))}
	if len(fds) > 0 {
		a.LowerFDs = uint64(uintptr(unsafe.Pointer(&fds[0])))
	}
	err = layerSwitch(rootfd, &a)
	if err != nil {
		return 0, fmt.Errorf("layer-switch switch: %w", err)
	}
	return a.Gen, nil
}

func openPair(upper, work string) (int, int, error) {
	ufd, err := unix.Open(upper, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("open new upper: %w", err)
	}
	wfd, err := unix.Open(work, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(ufd)
		return -1, -1, fmt.Errorf("open new workdir: %w", err)
	}
	return ufd, wfd, nil
}

// ProbeSwitchIoctl reports whether this kernel's overlayfs implements the
// layer-switch ioctl: nil if it does, an error wrapping ErrIoctlAbsent if
// it does not (any stock kernel), another error if the probe could not run.
// dir is a scratch directory (the state dir is best: the probe then also
// proves overlayfs accepts its file system as upper); the probe mounts a
// tiny overlay under it, issues the read-only QUERY operation and removes
// everything again.
func ProbeSwitchIoctl(dir string) error {
	tmp, err := os.MkdirTemp(dir, ".kernelpath-probe-")
	if err != nil {
		return fmt.Errorf("probe layer-switch ioctl: %w", err)
	}
	defer os.RemoveAll(tmp)
	s := stack{lowers: []string{filepath.Join(tmp, "l")}, upper: filepath.Join(tmp, "u"), work: filepath.Join(tmp, "w")}
	mp := filepath.Join(tmp, "m")
	for _, d := range []string{s.lowers[0], s.upper, s.work, mp} {
		if err := os.Mkdir(d, 0o700); err != nil {
			return fmt.Errorf("probe layer-switch ioctl: %w", err)
		}
	}
	mfd, err := createOverlay(s)
	if err != nil {
		return fmt.Errorf("probe layer-switch ioctl: %w", err)
	}
	defer unix.Close(mfd)
	// The detached mount is enough: open its root through the mount fd.
	rootfd, err := unix.Openat(mfd, ".", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("probe layer-switch ioctl: open overlay root: %w", err)
	}
	defer unix.Close(rootfd)
	if _, err := queryIoctl(rootfd); err != nil {
		return fmt.Errorf("probe layer-switch ioctl: %w", err)
	}
	return nil
}
