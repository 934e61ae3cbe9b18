// Package compat detects what the host offers rewind — FUSE, overlayfs,
// reflink and snapshots on the state directory, eBPF, CRIU, namespaces,
// cgroup freezing, dirty-page tracking — and picks the backend for each
// layer (file system, process C/R, effect probe), explaining every choice.
//
// Every probe is cheap (a whole Probe run takes well under two seconds),
// leaves nothing mounted or loaded behind, and reports a clear reason when
// something is missing: the errno and what to install or enable.
package compat

import (
	"context"
	"time"
)

// Status is the outcome of one capability probe.
type Status string

// Statuses of a Check.
const (
	OK       Status = "ok"
	Missing  Status = "missing"
	Degraded Status = "degraded"
)

// Check is one probed capability.
type Check struct {
	// Group is the area the capability belongs to ("fuse", "overlayfs",
	// "statedir", "ebpf", "criu", "kernel").
	Group string `json:"group"`
	// Name identifies the capability within its group.
	Name   string `json:"name"`
	Status Status `json:"status"`
	// Detail says what was found, or why it is missing and how to fix it.
	Detail string `json:"detail"`
}

// Choice is the backend picked for one layer of rewind, with the reason.
type Choice struct {
	Backend string `json:"backend"`
	Reason  string `json:"reason"`
	// Inputs are the measured facts of the file-system choice (DecideFS).
	Inputs *FSInputs `json:"inputs,omitempty"`
}

// Chosen holds the backend picked for each layer.
type Chosen struct {
	// FS is "kernel" or "fuse" (or "none").
	FS Choice `json:"fs"`
	// CR is "template+criu", "criu" or "template" (or "none").
	CR Choice `json:"cr"`
	// Probe is "ebpf" or "userspace".
	Probe Choice `json:"probe"`
}

// Report is the result of probing a host.
type Report struct {
	Kernel    string        `json:"kernel"`
	StateDir  string        `json:"state_dir"`
	Checks    []Check       `json:"checks"`
	Chosen    Chosen        `json:"chosen"`
	ElapsedMS float64       `json:"elapsed_ms"`
	elapsed   time.Duration `json:"-"`
}

// Get returns the check with the given group and name, if it was probed.
func (r *Report) Get(group, name string) (Check, bool) {
	for _, c := range r.Checks {
		if c.Group == group && c.Name == name {
			return c, true
		}
	}
	return Check{}, false
}

// OK reports whether the named check was probed and is ok.
func (r *Report) OK(group, name string) bool {
	c, found := r.Get(group, name)
	return found && c.Status == OK
}

// Options configures Probe.
type Options struct {
	// StateDir is the directory whose file system is probed for reflink
	// and snapshots (default /var/lib/rewind, or the nearest existing parent).
	StateDir string
	// CRIUPath is an explicitly configured CRIU binary (see FindCRIU).
	CRIUPath string
	// SkipLoopXFS skips the loop-mounted XFS reflink self-test.
	SkipLoopXFS bool
}

// Probe runs every capability probe and picks backends.
func Probe(ctx context.Context, opts Options) *Report {
	start := time.Now()
	r := probeHost(ctx, opts)
	r.Chosen = choose(r)
	if r.Chosen.FS.Backend != "none" {
		// What the daemon's --fs auto picks, by the same measurement.
		fuse := r.Chosen.FS
		r.Chosen.FS = ChooseFS(r.StateDir)
		if r.Chosen.FS.Backend == "fuse" && !r.OK("fuse", "mount") {
			r.Chosen.FS = fuse
		}
		if r.Chosen.FS.Backend == "fuse" && r.OK("fuse", "passthrough") {
			r.Chosen.FS.Reason += "; FUSE passthrough gives native-speed data I/O"
		}
	}
	r.elapsed = time.Since(start)
	r.ElapsedMS = float64(r.elapsed.Microseconds()) / 1000
	return r
}

// choose picks a backend for each layer from the probed capabilities.
func choose(r *Report) Chosen {
	var ch Chosen
	switch {
	case r.OK("overlayfs", "layer-switch-ioctl"):
		ch.FS = Choice{Backend: "kernel", Reason: "patched overlayfs with the layer-switch ioctl"}
	case r.OK("fuse", "mount"):
		ch.FS = Choice{Backend: "fuse", Reason: "stock overlayfs has no layer-switch ioctl, so a kernel-path checkpoint copies (reflinks) each entry changed (found by fanotify; its cost grows with the entries changed, the FUSE overlay's is constant), and its switch replaces the sandbox's root mount, so every restore re-creates the processes; the FUSE overlay checkpoints and switches in place; --fs kernel forces native overlayfs for native-speed I/O"}
		if r.OK("fuse", "passthrough") {
			ch.FS.Reason += "; FUSE passthrough gives native-speed data I/O"
		}
	default:
		ch.FS = Choice{Backend: "none", Reason: "neither FUSE nor a patched overlayfs is usable: install fuse3 and load the fuse module"}
	}
	criuOK := r.OK("criu", "check")
	ptraceOK := r.OK("kernel", "ptrace")
	switch {
	case criuOK && ptraceOK:
		ch.CR = Choice{Backend: "template+criu", Reason: "template fork by ptrace injection for millisecond restores, CRIU images as the durable fallback"}
	case criuOK:
		ch.CR = Choice{Backend: "criu", Reason: "ptrace injection unavailable; every restore goes through CRIU"}
	case ptraceOK:
		ch.CR = Choice{Backend: "template", Reason: "CRIU >= 4 missing (run `make deps`): templates only, checkpoints do not survive a host restart"}
	default:
		ch.CR = Choice{Backend: "none", Reason: "neither CRIU nor ptrace is usable"}
	}
	if r.OK("ebpf", "raw-tracepoints") && r.OK("ebpf", "cgroup-v2-id") {
		ch.Probe = Choice{Backend: "ebpf", Reason: "raw tracepoints attach and cgroup v2 ids filter events per sandbox in the kernel"}
	} else {
		ch.Probe = Choice{Backend: "userspace", Reason: "eBPF raw tracepoints or cgroup v2 ids unavailable: effects come from the fs layer and /proc"}
	}
	return ch
}
