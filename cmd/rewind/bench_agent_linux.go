package main

import (
	"bytes"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/bench"
)

func newBenchMCTSCmd() *cobra.Command {
	var (
		o          clientOpts
		quick      bool
		full       bool
		traces     []string
		seed       int64
		expansions int
		systems    string
		outDir     string
		writeTrace string
		crash      int
		repeat     int
		exclude    []string
	)
	cmd := &cobra.Command{
		Use:   "mcts",
		Short: "Replay tree-search trajectories with rewind and every baseline, side by side",
		Long: `mcts replays agent tree-search trajectories (JSON Lines traces: see the bench
package documentation) with rewind (policy "always": a full checkpoint every turn,
DeltaBox-style; policy "effects": skip what did not change, Crab + DeltaBox) and with
the baselines users would otherwise use: cp -a, cp --reflink (loop XFS), a tarball,
native overlayfs remount, fuse-overlayfs + copy. Each row reports the overhead over
LLM-only time (LLM latency computed, not slept: realistic median 2 s, and 0),
per-call latency p50/p99, frozen time, disk, rewind's decision mix, and recovery
correctness (crashes injected at random turns, recovery from the latest checkpoint).
The report ends with the targets' verdicts on the run (--json: "targets"): overhead
<= 1.03x at LLM 2 s, >= 10x less state-management time than the fastest baseline,
every injected crash recovered exactly. With --repeat the speedup over the fastest
baseline is also given round by round (--json: "speedup_rounds").

--quick replays one generated trace of 100 expansions (minutes); --full five.`,
		Example: "  rewind bench mcts --quick\n  rewind bench mcts --quick --repeat 3 --out bench-results\n  rewind bench mcts --full --out bench-results\n  rewind bench mcts --trace my.jsonl --systems rewind-effects,cp-a --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			var ts []*bench.Trace
			for _, p := range traces {
				f, err := os.Open(p)
				if err != nil {
					return err
				}
				got, err := bench.ReadTraces(f)
				f.Close()
				if err != nil {
					return fmt.Errorf("%s: %w", p, err)
				}
				ts = append(ts, got...)
			}
			if len(ts) == 0 {
				n := 1
				if full {
					n = 5
				}
				for i := 0; i < n; i++ {
					t, err := bench.Generate(seed+int64(i), bench.GenOptions{Expansions: expansions, Exclude: exclude})
					if err != nil {
						return fmt.Errorf("--exclude-kinds: %w", err)
					}
					ts = append(ts, t)
				}
			}
			if writeTrace != "" {
				var b bytes.Buffer
				for _, t := range ts {
					if err := t.Write(&b); err != nil {
						return err
					}
				}
				if err := os.WriteFile(writeTrace, b.Bytes(), 0o644); err != nil {
					return err
				}
			}
			var sys []string
			if systems != "" {
				sys = strings.Split(systems, ",")
			}
			needRewind := len(sys) == 0
			for _, s := range sys {
				needRewind = needRewind || strings.HasPrefix(s, "rewind-")
			}
			if repeat < 1 {
				return fmt.Errorf("--repeat %d: want 1 or more", repeat)
			}
			opts := bench.MCTSOptions{Traces: ts, Systems: sys, CrashChecks: crash, Repeat: repeat, Progress: cmd.ErrOrStderr()}
			if needRewind {
				c, err := o.connect(cmd)
				if err != nil {
					return err
				}
				opts.Client = c
			}
			rep, err := bench.RunMCTS(cmd.Context(), opts)
			if err != nil {
				return err
			}
			rep.Command = "rewind " + strings.Join(os.Args[1:], " ")
			rep.Machine = bench.Machine()
			if outDir != "" {
				if err := writeReport(outDir, rep); err != nil {
					return err
				}
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), rep)
			}
			rep.Markdown(cmd.OutOrStdout())
			return nil
		},
	}
	cmd.Flags().BoolVar(&quick, "quick", true, "one generated trace (the default)")
	cmd.Flags().BoolVar(&full, "full", false, "five generated traces")
	cmd.Flags().StringArrayVar(&traces, "trace", nil, "replay the traces of this JSON Lines file instead of generated ones (repeatable)")
	cmd.Flags().Int64Var(&seed, "seed", 1, "seed of the first generated trace")
	cmd.Flags().IntVar(&expansions, "expansions", 100, "expansions per generated trace")
	cmd.Flags().StringVar(&systems, "systems", "", "comma-separated systems (default: all): "+strings.Join(bench.AllSystems, ","))
	cmd.Flags().StringVar(&outDir, "out", "", "write results.json, results.md and chart.svg into this directory")
	cmd.Flags().StringVar(&writeTrace, "write-trace", "", "also write the traces replayed, one after the other, to this JSON Lines file (--trace reads it back)")
	cmd.Flags().IntVar(&crash, "crash-checks", 10, "crash-recovery checks per trace and system (0: none)")
	cmd.Flags().IntVar(&repeat, "repeat", 1, "run every system this many times, the systems' order rotated each time; each row is the median run")
	cmd.Flags().StringSliceVar(&exclude, "exclude-kinds", nil, "action kinds the generator leaves out (read, edit, test, cd, env, install, server, kill)")
	o.add(cmd)
	return cmd
}

func writeReport(dir string, rep *bench.Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return err
	}
	var j, md, svg bytes.Buffer
	if err := printJSON(&j, rep); err != nil {
		return err
	}
	rep.Markdown(&md)
	rep.SVG(&svg)
	for name, b := range map[string][]byte{"results.json": j.Bytes(), "results.md": md.Bytes(), "chart.svg": svg.Bytes()} {
		if err := os.WriteFile(filepath.Join(dir, name), b, 0o644); err != nil {
			return err
		}
	}
	return nil
}

func newBenchFanoutCmd() *cobra.Command {
	var (
		o      clientOpts
		counts []int
		step   float64
		fsKind string
		repeat int
	)
	cmd := &cobra.Command{
		Use:   "fanout",
		Short: "Time until N forks of one checkpoint all run a first command, vs copying",
		Long: `fanout checkpoints a sandbox holding the benchmark repository and a persistent
bash, forks it into N live sandboxes (each with its own namespaces and upper layer
over the shared frozen layers) and waits until every copy has run a first command.
The baseline copies the repository N times with cp -a and starts a shell in each.
The shell-floor row is the floor under both: N shells already running in one copy
run the first command at once (nothing copied or forked); "over floor" is what a
system adds to it at the same N.
With a simulated trainer step, it prints the fraction of time a trainer would wait
for its rollouts and the resulting "GPU utilisation". Targets: 64 forks ready within
250 ms, a trainer waiting at most 5% of the time; the output ends with their verdicts
(--json: "targets").`,
		Example: "  rewind bench fanout -n 16,32,64\n  rewind bench fanout -n 16,32,64 --repeat 3\n  rewind bench fanout -n 64 --trainer-step-ms 2000 --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			if repeat < 1 {
				return fmt.Errorf("--repeat %d: want 1 or more", repeat)
			}
			rows, err := bench.RunFanout(cmd.Context(), bench.FanoutOptions{Counts: counts, Client: c, TrainerStepMS: step, FS: fsKind, Repeat: repeat, Progress: cmd.ErrOrStderr()})
			if err != nil {
				return err
			}
			verdicts := bench.JudgeFanout(rows)
			if o.json {
				return printJSON(cmd.OutOrStdout(), map[string]any{"trainer_step_ms": step, "rows": rows, "targets": verdicts})
			}
			w := cmd.OutOrStdout()
			fmt.Fprintf(w, "| system | n | ready ms | over floor ms | fork/copy ms | trainer wait | GPU util | mem MiB | disk MiB |\n|---|---|---|---|---|---|---|---|---|\n")
			for _, r := range rows {
				if r.Error != "" {
					fmt.Fprintf(w, "| %s | %d | error: %s | | | | | | |\n", r.Name, r.N, r.Error)
					continue
				}
				over := ""
				if r.OverFloorMS != 0 {
					over = fmt.Sprintf("%.1f", r.OverFloorMS)
				}
				fmt.Fprintf(w, "| %s | %d | %.1f | %s | %.1f | %.1f%% | %.1f%% | %.1f | %.1f |\n", r.Name, r.N, r.ReadyMS, over, r.ForkMS,
					100*r.TrainerWait, 100*r.GPUUtil, float64(r.MemDeltaBytes)/(1<<20), float64(r.DiskBytes)/(1<<20))
			}
			if repeat > 1 {
				fmt.Fprintf(w, "\nEach row is the median of %d runs (the parts' order rotated every run); ready ms of every run:\n", repeat)
				for _, r := range rows {
					var v []string
					for _, x := range r.ReadyMSRuns {
						v = append(v, fmt.Sprintf("%.0f", x))
					}
					fmt.Fprintf(w, "- %s n=%d: %s\n", r.Name, r.N, strings.Join(v, " / "))
				}
			}
			bench.WriteVerdicts(w, verdicts)
			return nil
		},
	}
	cmd.Flags().IntSliceVarP(&counts, "n", "n", []int{16, 32, 64}, "fan-out widths")
	cmd.Flags().Float64Var(&step, "trainer-step-ms", 5000, "simulated trainer step the rollouts feed")
	cmd.Flags().StringVar(&fsKind, "fs", "", "file-system backend of the forked sandbox and its children: auto, fuse or kernel (native overlayfs: needs the daemon's state dir on its own file system, see rewind init-store; default: the daemon's)")
	cmd.Flags().IntVar(&repeat, "repeat", 1, "run the whole benchmark this many times, its parts' order rotated each time; each row is the median run")
	o.add(cmd)
	return cmd
}
