package main

import (
	"encoding/json"
	"fmt"
	"os"
	"os/signal"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/probe"
	"github.com/rewind-sandbox/rewind/probe/probebench"
)

func newProbeCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "probe",
		Short: "Inspect the effect probes (what each turn did to a sandbox)",
		Long: `The effect probes observe a sandbox turn by turn and report what each turn did:
files changed, processes born or died, memory written, network effects. The
eBPF backend uses raw tracepoints (no tracefs, no kprobes needed); the
userspace backend reads /proc and the fs layer.`,
		Example: `  rewind probe check
  rewind probe watch --cgroup /sys/fs/cgroup/unified/rewind/sbx-1 --every 2s
  rewind probe bench`,
	}
	cmd.AddCommand(newProbeCheckCmd(), newProbeWatchCmd(), newProbeBenchCmd())
	return cmd
}

func newProbeCheckCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "check",
		Short:   "Load and attach the eBPF probe once and say whether it works here",
		Example: "  rewind probe check",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			t0 := time.Now()
			if err := probe.CheckEBPF(); err != nil {
				return fmt.Errorf("%v (the userspace backend will be used; eBPF needs root and raw tracepoints)", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "eBPF probe: ok (loaded and attached in %.1f ms)\n", float64(time.Since(t0).Microseconds())/1000)
			return nil
		},
	}
}

func newProbeWatchCmd() *cobra.Command {
	var (
		cgroup, backend, dir string
		every                time.Duration
		count, initPID       int
	)
	cmd := &cobra.Command{
		Use:   "watch",
		Short: "Print one effect report (JSON) per interval for the processes of a cgroup v2 directory",
		Long: `watch treats every interval as one turn of the processes in --cgroup (a cgroup v2
directory, e.g. a sandbox's /sys/fs/cgroup/unified/rewind/<id>) and prints one
report per line. File-system effects come from scanning --dir when given (small
trees only); without it the eBPF backend counts file-system syscalls and the
userspace backend cannot see them (it flags lost_events).`,
		Example: `  rewind probe watch --cgroup /sys/fs/cgroup/unified/rewind/sbx-1
  rewind probe watch --cgroup /sys/fs/cgroup/unified/mygroup --backend userspace --dir /srv/work --every 5s --count 3`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if cgroup == "" {
				return fmt.Errorf("--cgroup is required")
			}
			if st, err := os.Stat(cgroup); err != nil || !st.IsDir() {
				return fmt.Errorf("--cgroup %s: not a directory", cgroup)
			}
			p, err := probe.Open(probe.Options{Backend: backend})
			if err != nil {
				return err
			}
			defer p.Close()
			t := probe.Target{Sandbox: cgroup, CgroupV2Dir: cgroup, InitPID: initPID}
			if dir != "" {
				t.FS = probe.NewDirSource(dir)
			}
			w, err := p.Begin(t)
			if err != nil {
				return err
			}
			defer func() { w.Abort() }()
			sig := make(chan os.Signal, 1)
			signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
			defer signal.Stop(sig)
			enc := json.NewEncoder(cmd.OutOrStdout())
			for i := 0; count <= 0 || i < count; i++ {
				select {
				case <-time.After(every):
				case <-sig:
					return nil
				}
				r, nw, err := w.Next()
				if err != nil {
					return err
				}
				w = nw
				if err := enc.Encode(r); err != nil {
					return err
				}
			}
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&cgroup, "cgroup", "", "cgroup v2 directory whose processes are observed (required)")
	f.StringVar(&backend, "backend", "auto", "auto, ebpf or userspace")
	f.StringVar(&dir, "dir", "", "directory scanned for file-system effects (optional)")
	f.DurationVar(&every, "every", 2*time.Second, "length of one turn")
	f.IntVar(&count, "count", 0, "number of reports (0 = until interrupted)")
	f.IntVar(&initPID, "init-pid", 0, "host pid excluded from memory accounting (the sandbox's init)")
	return cmd
}

func newProbeBenchCmd() *cobra.Command {
	var (
		backend, workload string
		rounds, turns     int
		noFS, asJSON      bool
	)
	cmd := &cobra.Command{
		Use:   "bench",
		Short: "Probe overhead on a syscall-heavy workload (on vs off, same run) and End latency",
		Long: `Runs --workload in a fresh cgroup v2 directory, alternating without any probe and
with the probe attached and a window open (--rounds pairs), and compares the
medians of the workload's CPU time (user+system): target <= 2% for eBPF. For
eBPF it also runs the workload once with BPF statistics on and reports what the
probe's programs cost as measured by the kernel. Then it times --turns End calls
with a persistent bash in the cgroup (turn end to report ready): target p50 <= 1 ms.
--no-fs-source opens windows without an FSSource, which attaches the eBPF
per-syscall hook (file-system effects from syscalls).`,
		Example: `  rewind probe bench
  rewind probe bench --backend ebpf --no-fs-source --workload "find /usr -xdev" --rounds 9 --json`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			backends := []string{probe.BackendEBPF, probe.BackendUserspace}
			if backend != "all" {
				backends = []string{backend}
			}
			var results []*probebench.Result
			for _, b := range backends {
				r, err := probebench.Run(probebench.Options{Backend: b, Workload: []string{"sh", "-c", workload}, Rounds: rounds, Turns: turns, NoFSSource: noFS})
				if err != nil {
					return fmt.Errorf("probe bench %s: %w", b, err)
				}
				results = append(results, r)
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), results)
			}
			printProbeBench(cmd, results)
			return nil
		},
	}
	f := cmd.Flags()
	f.StringVar(&backend, "backend", "all", "ebpf, userspace or all")
	f.StringVar(&workload, "workload", "find /usr -xdev", "shell command run in the cgroup (sh -c)")
	f.IntVar(&rounds, "rounds", 7, "off/on pairs")
	f.IntVar(&turns, "turns", 200, "timed End calls")
	f.BoolVar(&noFS, "no-fs-source", false, "open windows without an FSSource (eBPF: per-syscall hook)")
	f.BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func printProbeBench(cmd *cobra.Command, results []*probebench.Result) {
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
	fmt.Fprintln(tw, "BACKEND\tWORKLOAD\tOFF CPU\tON CPU\tOVERHEAD\tPROG TIME (HOST-WIDE)\tEND P50\tEND P99\tBEGIN P50")
	for _, r := range results {
		prog := "-"
		if r.ProgRuns > 0 {
			prog = fmt.Sprintf("%.2f%% (%d runs)", r.ProgPct, r.ProgRuns)
		}
		fmt.Fprintf(tw, "%s\t%s\t%.1f ms\t%.1f ms\t%+.2f%%\t%s\t%.0f µs\t%.0f µs\t%.0f µs\n",
			r.Backend, r.Workload, r.OffMS, r.OnMS, r.OverheadPct, prog, r.EndP50US, r.EndP99US, r.BeginP50US)
	}
	tw.Flush()
	fmt.Fprintln(cmd.OutOrStdout(), "targets: overhead <= 2% (eBPF), end p50 <= 1 ms; CPU times are medians of user+system time")
}
