package compat

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/kernelpath"
)

// ChooseFS on a state dir on the root file system (where overlayfs refuses
// the layers) picks FUSE without measuring, and says why.
func TestChooseFSRootFS(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	testenv.Require(t, onRootFS(dir), "a temp dir on the root file system")
	ch := ChooseFS(dir)
	if err := kernelpath.ProbeSwitchIoctl(dir); err != nil && !errors.Is(err, kernelpath.ErrIoctlAbsent) {
		t.Skipf("ioctl probe: %v", err)
	}
	if ch.Backend != "fuse" || !strings.Contains(ch.Reason, "root file system") || ch.Inputs == nil || ch.Inputs.Measured {
		t.Fatalf("chose %+v, want fuse for the root file system, unmeasured", ch)
	}
}

// ChooseFS on a reflink XFS state dir (as rewind init-store makes it)
// measures both backends and decides on the numbers; the scratch views are
// gone afterwards.
func TestChooseFSMeasuredOnXFS(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := exec.LookPath("mkfs.xfs")
	testenv.Require(t, err == nil, "mkfs.xfs (xfsprogs)")
	tmp := t.TempDir()
	img, mnt := filepath.Join(tmp, "xfs.img"), filepath.Join(tmp, "mnt")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	f.Truncate(1 << 30)
	f.Close()
	if out, err := exec.Command("mkfs.xfs", "-q", "-f", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.xfs: %v: %s", err, out)
	}
	os.Mkdir(mnt, 0o755)
	out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput()
	testenv.Require(t, err == nil, fmt.Sprintf("loop mount: %v: %s", err, out))
	t.Cleanup(func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			unix.Unmount(mnt, unix.MNT_DETACH)
		}
	})
	state := filepath.Join(mnt, "state")
	ch := ChooseFS(state)
	in := ch.Inputs
	if in == nil || !in.Measured || in.KernelErr != "" || in.FSType != "xfs" {
		t.Fatalf("not measured on the XFS state dir: %+v (%s)", in, ch.Reason)
	}
	if in.Freeze != kernelpath.FreezeReflink && in.Freeze != kernelpath.FreezeIoctl {
		t.Fatalf("freeze %q on reflink XFS", in.Freeze)
	}
	if !in.Tracked && in.Freeze == kernelpath.FreezeReflink {
		t.Fatalf("the kernel path's checkpoints were not tracked: %s", ch.Reason)
	}
	if in.Kernel.Checkpoint <= 0 || in.Kernel.Switch <= 0 || in.Kernel.IO <= 0 {
		t.Fatalf("kernel sample missing: %+v", in.Kernel)
	}
	if in.FUSEErr == "" && (in.FUSE.Checkpoint <= 0 || in.FUSE.Switch <= 0 || in.FUSE.IO <= 0) {
		t.Fatalf("FUSE sample missing: %+v", in.FUSE)
	}
	if want := DecideFS(*in); want.Backend != ch.Backend || want.Reason != ch.Reason {
		t.Fatalf("ChooseFS %+v is not DecideFS of its inputs %+v", ch, want)
	}
	ents, _ := os.ReadDir(mnt)
	for _, e := range ents {
		if strings.HasPrefix(e.Name(), ".rewind-fs-selftest-") {
			t.Fatalf("self-test left %s", e.Name())
		}
	}
	t.Logf("chose %s: %s", ch.Backend, ch.Reason)
}
