package compat

import (
	"fmt"
	"time"
)

// FSSample is what the --fs auto self-test measured on one backend: the
// medians of a checkpoint after an FSInputs.Entries-entry delta, of a
// switch between two checkpoints, and of an I/O sample (FSInputs.IOFiles
// small files created, written, stat'ed and read back in a fresh
// directory, as an agent's tool call does).
type FSSample struct {
	Checkpoint time.Duration `json:"checkpoint_ns"`
	Switch     time.Duration `json:"switch_ns"`
	IO         time.Duration `json:"io_ns"`
}

// Turn is the sample's cost of one agent turn: one checkpoint, one switch
// (a tree search restores about once per turn) and the I/O sample.
func (s FSSample) Turn() time.Duration { return s.Checkpoint + s.Switch + s.IO }

func (s FSSample) String() string {
	return fmt.Sprintf("%v (checkpoint %v + switch %v + I/O %v)", ms(s.Turn()), ms(s.Checkpoint), ms(s.Switch), ms(s.IO))
}

func ms(d time.Duration) string { return fmt.Sprintf("%.2f ms", float64(d.Microseconds())/1000) }

// FSInputs are the facts the --fs auto choice is made from (ChooseFS
// gathers them on the host; DecideFS decides).
type FSInputs struct {
	// IoctlErr is set when the layer-switch ioctl probe failed for another
	// reason than a stock kernel.
	IoctlErr string `json:"ioctl_err,omitempty"`
	// Ioctl: overlayfs answers the layer-switch ioctl (patched kernel).
	Ioctl bool `json:"ioctl"`
	// OnRootFS: the state dir is on the host root's file system, the
	// sandboxes' default base, where overlayfs refuses its layers.
	OnRootFS bool `json:"on_root_fs"`
	// FSType is the state dir's file system.
	FSType string `json:"fs_type,omitempty"`
	// Measured: the self-test ran (the fields below are set).
	Measured bool `json:"measured"`
	// KernelErr and FUSEErr are why a backend's self-test failed.
	KernelErr string `json:"kernel_err,omitempty"`
	FUSEErr   string `json:"fuse_err,omitempty"`
	// Freeze is the kernel path's stock-kernel checkpoint mode: "reflink"
	// (data shared, cost by entries) or "copy" (no reflink: cost by data).
	Freeze string `json:"freeze,omitempty"`
	// Tracked: the kernel path's checkpoints found their entries by the
	// fanotify change tracker (else each checkpoint and effect report
	// walks the whole live upper).
	Tracked bool `json:"tracked"`
	// LiveFDsFollow: open fds of live processes follow a switch (ioctl).
	LiveFDsFollow bool `json:"live_fds_follow"`
	// Entries and IOFiles are the sizes of the checkpoint delta and the
	// I/O sample.
	Entries int      `json:"entries"`
	IOFiles int      `json:"io_files"`
	Kernel  FSSample `json:"kernel"`
	FUSE    FSSample `json:"fuse"`
}

// What the stock-kernel path does differently, said in every choice made
// between the two on measured numbers.
const stockKernelServes = "on a stock kernel the kernel path serves everything the daemon does (checked by the daemon's kernel-path tests): restores re-create the processes on the new view (template copies re-enter their working directory and reopen their files, process trees restore through CRIU), forks mount the checkpoint's view, per-turn effect reports come from the change tracker; a restore always re-creates the processes, even with no file changed"

// DecideFS picks the backend for --fs auto from measured inputs:
//
//   - the kernel path needs a working ioctl probe and a state dir off the
//     host's root file system (overlayfs refuses a layer inside its base);
//   - with the patched kernel's layer-switch ioctl (live fds follow a
//     switch) the kernel path is taken once its self-test passes;
//   - on a stock kernel it is taken only on a reflink file system with the
//     change tracker working (otherwise a checkpoint's cost grows with the
//     data, or with the whole upper) and only when it wins on the measured
//     cost of a turn (checkpoint + switch + the I/O sample) against FUSE;
//   - FUSE otherwise. The reason gives the numbers.
func DecideFS(in FSInputs) Choice {
	fuse := func(why string) Choice { return Choice{Backend: "fuse", Reason: why, Inputs: &in} }
	kernel := func(why string) Choice { return Choice{Backend: "kernel", Reason: why, Inputs: &in} }
	switch {
	case in.IoctlErr != "":
		return fuse("the layer-switch ioctl probe failed (" + in.IoctlErr + "): using the FUSE overlay")
	case in.OnRootFS:
		return fuse("the state dir is on the host's root file system, the sandboxes' default base, where overlayfs refuses its layers: using the FUSE overlay (rewind init-store gives the state dir its own reflink file system, where the kernel path is measured and may be chosen)")
	case !in.Measured:
		return fuse("the kernel path was not measured: using the FUSE overlay")
	case in.KernelErr != "":
		return fuse("the kernel path's self-test failed (" + in.KernelErr + "): using the FUSE overlay")
	case in.Ioctl && in.LiveFDsFollow:
		return kernel(fmt.Sprintf("patched overlayfs with the layer-switch ioctl (live fds follow a switch); self-test on %s: %s", in.FSType, in.Kernel))
	case in.Ioctl:
		return fuse("the layer-switch ioctl answers but open fds do not follow a switch in the self-test: using the FUSE overlay")
	case in.Freeze != "reflink":
		return fuse(fmt.Sprintf("stock overlayfs on %s without reflink: a kernel-path checkpoint copies the data of every changed file (measured %s at %d entries), so its cost grows with the data; using the FUSE overlay, which checkpoints in place (rewind init-store makes a reflink XFS or btrfs state dir)", in.FSType, ms(in.Kernel.Checkpoint), in.Entries))
	case !in.Tracked:
		return fuse("stock overlayfs without fanotify change tracking: every kernel-path checkpoint and effect report would walk the whole live upper (cost grows with the upper, 30 ms at 10k files); using the FUSE overlay")
	case in.FUSEErr != "":
		return kernel(fmt.Sprintf("the FUSE overlay's self-test failed (%s); the kernel path works on %s: %s; %s", in.FUSEErr, in.FSType, in.Kernel, stockKernelServes))
	}
	k, f := in.Kernel.Turn(), in.FUSE.Turn()
	cmp := fmt.Sprintf("measured per turn on %s (a %d-entry checkpoint, a switch, %d small files created, stat'ed and read): kernel path %s, FUSE %s", in.FSType, in.Entries, in.IOFiles, in.Kernel, in.FUSE)
	if k < f {
		return kernel("stock overlayfs on a reflink state dir, the kernel path wins: " + cmp + "; " + stockKernelServes)
	}
	return fuse("stock overlayfs, the FUSE overlay wins: " + cmp + " (--fs kernel forces native overlayfs for native-speed I/O)")
}
