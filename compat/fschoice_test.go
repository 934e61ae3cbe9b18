package compat

import (
	"strings"
	"testing"
	"time"
)

// DecideFS on measured inputs: the kernel path only where it can run and,
// on a stock kernel, only on reflink with the change tracker and when it
// wins the measured turn; the reason names the deciding fact.
func TestDecideFS(t *testing.T) {
	ms := time.Millisecond
	// This project's machine kind, loop XFS with reflink (bench numbers).
	kernelXFS := FSSample{Checkpoint: 4 * ms, Switch: ms / 2, IO: 12 * ms}
	fuseXFS := FSSample{Checkpoint: ms / 10, Switch: ms / 4, IO: 60 * ms}
	stock := FSInputs{Measured: true, FSType: "xfs", Freeze: "reflink", Tracked: true, Entries: 100, IOFiles: 100, Kernel: kernelXFS, FUSE: fuseXFS}
	with := func(f func(*FSInputs)) FSInputs {
		in := stock
		f(&in)
		return in
	}
	tests := []struct {
		name    string
		in      FSInputs
		backend string
		reason  string
	}{
		{"ioctl probe broken", FSInputs{IoctlErr: "EIO"}, "fuse", "probe failed (EIO)"},
		{"state dir on the root fs", FSInputs{OnRootFS: true, Measured: false}, "fuse", "root file system"},
		{"not measured", FSInputs{}, "fuse", "not measured"},
		{"kernel self-test failed", with(func(in *FSInputs) { in.KernelErr = "mount: EINVAL" }), "fuse", "self-test failed (mount: EINVAL)"},
		{"patched kernel", with(func(in *FSInputs) { in.Ioctl, in.LiveFDsFollow, in.Freeze = true, true, "ioctl" }), "kernel", "layer-switch ioctl"},
		{"ioctl without fds following", with(func(in *FSInputs) { in.Ioctl = true }), "fuse", "do not follow"},
		{"no reflink", with(func(in *FSInputs) { in.Freeze, in.FSType = "copy", "ext4" }), "fuse", "without reflink"},
		{"no change tracker", with(func(in *FSInputs) { in.Tracked = false }), "fuse", "fanotify"},
		{"FUSE broken, kernel works", with(func(in *FSInputs) { in.FUSEErr = "no /dev/fuse" }), "kernel", "FUSE overlay's self-test failed"},
		{"kernel wins the turn (I/O)", stock, "kernel", "kernel path wins"},
		{"FUSE wins: slow kernel checkpoint", with(func(in *FSInputs) { in.Kernel.Checkpoint = 80 * ms }), "fuse", "FUSE overlay wins"},
		{"FUSE wins: FUSE I/O as fast", with(func(in *FSInputs) { in.FUSE.IO = in.Kernel.IO }), "fuse", "FUSE overlay wins"},
		{"tie goes to FUSE", with(func(in *FSInputs) { in.FUSE = in.Kernel }), "fuse", "FUSE overlay wins"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			ch := DecideFS(tt.in)
			if ch.Backend != tt.backend || !strings.Contains(ch.Reason, tt.reason) {
				t.Fatalf("DecideFS = %s (%s), want %s with %q", ch.Backend, ch.Reason, tt.backend, tt.reason)
			}
			if ch.Inputs == nil || ch.Inputs.IoctlErr != tt.in.IoctlErr || ch.Inputs.Kernel != tt.in.Kernel {
				t.Fatalf("the choice does not carry its inputs: %+v", ch.Inputs)
			}
			if tt.in.Measured && tt.in.KernelErr == "" && !tt.in.Ioctl && tt.in.Freeze == "reflink" && tt.in.Tracked && tt.in.FUSEErr == "" {
				// A choice on the numbers shows both backends' numbers.
				for _, s := range []FSSample{tt.in.Kernel, tt.in.FUSE} {
					if !strings.Contains(ch.Reason, s.String()) {
						t.Errorf("reason lacks the measured %s: %s", s, ch.Reason)
					}
				}
			}
		})
	}
}
