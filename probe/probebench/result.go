// Package probebench measures the effect probes: the overhead they add to a
// syscall-heavy workload run in a sandbox cgroup (probe attached and a
// window open, versus no probe at all, alternating in the same run) and the
// latency of End (turn end to report ready). `rewind bench probe` and the
// package's Go benchmarks use it.
package probebench

// Options configure Run.
type Options struct {
	// Backend is probe.BackendEBPF or probe.BackendUserspace.
	Backend string
	// Workload is the command run in the cgroup; default find /usr -xdev.
	Workload []string
	// Rounds is the number of off/on pairs; default 7.
	Rounds int
	// Turns is the number of Begin/End pairs timed; default 200.
	Turns int
	// CgroupParent is where the bench cgroup is created; default
	// /sys/fs/cgroup/unified.
	CgroupParent string
	// NoFSSource opens the windows without an FSSource, which makes the
	// eBPF backend attach its per-syscall hook (file-system effects from
	// syscalls). The default passes an FSSource, as the daemon does.
	NoFSSource bool
}

// Result holds the measured numbers.
type Result struct {
	Backend    string `json:"backend"`
	Workload   string `json:"workload"`
	NoFSSource bool   `json:"no_fs_source"`
	Rounds     int    `json:"rounds"`
	// OffMS and OnMS are the medians of the workload's CPU time (user +
	// system, from rusage) without a probe and with the probe attached and
	// a window open. CPU time, unlike wall time, does not count the time
	// the workload waits for a CPU on a loaded host; the eBPF programs run
	// in the workload's context and are charged to it.
	OffMS float64 `json:"off_cpu_median_ms"`
	OnMS  float64 `json:"on_cpu_median_ms"`
	// OverheadPct is (on-off)/off of the CPU-time medians, in percent.
	OverheadPct float64 `json:"overhead_pct"`
	// OffMinMS and OnMinMS are the CPU-time minimums: on a noisy host the
	// least disturbed runs.
	OffMinMS       float64 `json:"off_cpu_min_ms"`
	OnMinMS        float64 `json:"on_cpu_min_ms"`
	OverheadMinPct float64 `json:"overhead_min_pct"`
	// ProgMS and ProgRuns are the run time and run count of rewind's eBPF
	// programs (all rw_* programs on the host) during one extra workload
	// run with BPF statistics enabled; ProgPct is ProgMS over OffMS: the
	// cost of the programs themselves, measured by the kernel.
	ProgMS   float64 `json:"prog_ms,omitempty"`
	ProgRuns uint64  `json:"prog_runs,omitempty"`
	ProgPct  float64 `json:"prog_pct,omitempty"`
	// OffWallMS and OnWallMS are the wall-time medians (noisy on a loaded
	// host).
	OffWallMS  float64 `json:"off_wall_median_ms"`
	OnWallMS   float64 `json:"on_wall_median_ms"`
	Turns      int     `json:"turns"`
	EndP50US   float64 `json:"end_p50_us"`
	EndP99US   float64 `json:"end_p99_us"`
	BeginP50US float64 `json:"begin_p50_us"`
}
