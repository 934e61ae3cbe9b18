package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/bench"
)

// mctsFlags are bench mcts's flags.
type mctsFlags struct {
	quick, full bool
	traces      []string
	seed        int64
	expansions  int
	systems     string
	outDir      string
	writeTrace  string
	crash       int
	repeat      int
	exclude     []string
}

// check refuses flag values and combinations the run would not follow
// (changed reports whether a flag was given): it runs before anything is
// read, generated, written or connected to.
func (f *mctsFlags) check(changed func(string) bool) error {
	switch {
	case changed("quick") && !f.quick:
		return fmt.Errorf("--quick=false: there is no other default; --full runs five generated traces, --trace replays files")
	case changed("quick") && (f.full || len(f.traces) > 0):
		return fmt.Errorf("--quick is one generated trace: not with --full or --trace")
	case f.full && len(f.traces) > 0:
		return fmt.Errorf("--full generates five traces: not with --trace, which replays files")
	case len(f.traces) > 0 && (changed("seed") || changed("expansions") || changed("exclude-kinds")):
		return fmt.Errorf("--seed, --expansions and --exclude-kinds shape generated traces: not with --trace")
	case f.expansions < 1:
		return fmt.Errorf("--expansions %d: want 1 or more", f.expansions)
	case f.crash < 0:
		return fmt.Errorf("--crash-checks %d: want 0 (none) or more", f.crash)
	case f.repeat < 1:
		return fmt.Errorf("--repeat %d: want 1 or more", f.repeat)
	}
	if _, err := f.systemList(changed); err != nil {
		return err
	}
	return nil
}

// systemList is --systems as a list (nil: every system), checked.
func (f *mctsFlags) systemList(changed func(string) bool) ([]string, error) {
	if !changed("systems") {
		return nil, nil
	}
	sys := strings.Split(f.systems, ",")
	for i := range sys {
		sys[i] = strings.TrimSpace(sys[i])
	}
	if err := bench.CheckSystems(sys); err != nil {
		return nil, fmt.Errorf("--systems: %w", err)
	}
	return sys, nil
}

// loadTraces reads --trace's files, or generates --quick's one trace or
// --full's five.
func (f *mctsFlags) loadTraces() ([]*bench.Trace, error) {
	var ts []*bench.Trace
	for _, p := range f.traces {
		r, err := os.Open(p)
		if err != nil {
			return nil, fmt.Errorf("--trace: %w", err)
		}
		got, err := bench.ReadTraces(r)
		r.Close()
		if err != nil {
			return nil, fmt.Errorf("--trace %s: %w", p, err)
		}
		ts = append(ts, got...)
	}
	if len(f.traces) > 0 {
		return ts, nil
	}
	n := 1
	if f.full {
		n = 5
	}
	for i := 0; i < n; i++ {
		t, err := bench.Generate(f.seed+int64(i), bench.GenOptions{Expansions: f.expansions, Exclude: f.exclude})
		if err != nil {
			return nil, fmt.Errorf("--exclude-kinds: %w", err)
		}
		ts = append(ts, t)
	}
	return ts, nil
}

// prepareOutDir makes dir and checks a file can be written in it, so that
// a bad --out fails before the run rather than after it.
func prepareOutDir(dir string) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	f, err := os.CreateTemp(dir, ".rewind-bench-check-*")
	if err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	f.Close()
	return os.Remove(f.Name())
}

// gcHint is printed after a run that used the daemon: the bench removes
// its sandboxes, but their checkpoints stay until a GC, and GC frees every
// unreachable checkpoint, the bench's or not (api/README.md, /v1/gc), so
// the bench leaves it to the user.
const gcHint = "the bench's sandboxes are removed; their checkpoints stay in the daemon until `rewind gc` (which frees every unreachable checkpoint, not only the bench's)"

// fanoutGCHint is gcHint for bench fanout, whose repeated forks leave the
// daemon holding prepared children of the bench's checkpoints.
const fanoutGCHint = "the bench's sandboxes are removed; their checkpoints, and the fork children the daemon prepared from them (running, for up to 10 minutes unused), stay until `rewind gc` (which frees every unreachable checkpoint, not only the bench's)"

func newBenchMCTSCmd() *cobra.Command {
	var (
		o clientOpts
		f mctsFlags
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

Without --full or --trace (or with --quick) it replays one generated trace of
100 expansions (minutes); --full five. --trace replays files instead (each may
hold several traces, as --write-trace writes them). The command exits 1 when a
system failed (after printing every row), and on SIGINT or SIGTERM removes what it
made and exits 128 + the signal's number.`,
		Example: "  rewind bench mcts --quick\n  rewind bench mcts --quick --repeat 3 --out bench-results\n  rewind bench mcts --full --out bench-results\n  rewind bench mcts --trace my.jsonl --systems rewind-effects,cp-a --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			changed := cmd.Flags().Changed
			if err := f.check(changed); err != nil {
				return err
			}
			sys, _ := f.systemList(changed)
			if f.outDir != "" {
				if err := prepareOutDir(f.outDir); err != nil {
					return err
				}
			}
			ts, err := f.loadTraces()
			if err != nil {
				return err
			}
			if f.writeTrace != "" {
				var b bytes.Buffer
				for _, t := range ts {
					if err := t.Write(&b); err != nil {
						return err
					}
				}
				if err := os.WriteFile(f.writeTrace, b.Bytes(), 0o644); err != nil {
					return fmt.Errorf("--write-trace: %w", err)
				}
			}
			needRewind := len(sys) == 0
			for _, s := range sys {
				needRewind = needRewind || strings.HasPrefix(s, "rewind-")
			}
			stderr := cmd.ErrOrStderr()
			opts := bench.MCTSOptions{Traces: ts, Systems: sys, CrashChecks: f.crash, Repeat: f.repeat, Progress: stderr}
			if needRewind {
				c, err := o.connect(cmd)
				if err != nil {
					return err
				}
				opts.Client = c
			}
			ctx, exitCode, stop := onInterrupt(cmd.Context(), stderr)
			rep, err := bench.RunMCTS(ctx, opts)
			stop()
			if err != nil {
				return interrupted(err, exitCode, stderr)
			}
			rep.Command = "rewind " + strings.Join(os.Args[1:], " ")
			rep.Machine = bench.Machine()
			if o.json {
				if err := printJSON(cmd.OutOrStdout(), rep); err != nil {
					return err
				}
			} else {
				rep.Markdown(cmd.OutOrStdout())
			}
			if f.outDir != "" {
				if err := writeReport(f.outDir, rep); err != nil {
					return err
				}
			}
			if opts.Client != nil {
				fmt.Fprintln(stderr, gcHint)
			}
			var failed []string
			for _, r := range rep.Systems {
				if r.Error != "" {
					failed = append(failed, r.Name)
				}
			}
			if len(failed) > 0 {
				return fmt.Errorf("%d of %d systems failed (see their rows): %s", len(failed), len(rep.Systems), strings.Join(failed, ", "))
			}
			return nil
		},
	}
	cmd.Flags().BoolVar(&f.quick, "quick", false, "one generated trace: what runs without --full or --trace")
	cmd.Flags().BoolVar(&f.full, "full", false, "five generated traces")
	cmd.Flags().StringArrayVar(&f.traces, "trace", nil, "replay the traces of this JSON Lines file instead of generated ones (repeatable)")
	cmd.Flags().Int64Var(&f.seed, "seed", 1, "seed of the first generated trace")
	cmd.Flags().IntVar(&f.expansions, "expansions", 100, "expansions per generated trace (1 or more)")
	cmd.Flags().StringVar(&f.systems, "systems", "", "comma-separated systems, each once (default: all): "+strings.Join(bench.AllSystems, ","))
	cmd.Flags().StringVar(&f.outDir, "out", "", "write results.json, results.md and chart.svg into this directory (made, and checked, before the run)")
	cmd.Flags().StringVar(&f.writeTrace, "write-trace", "", "also write the traces replayed, one after the other, to this JSON Lines file (--trace reads it back)")
	cmd.Flags().IntVar(&f.crash, "crash-checks", 10, "crash-recovery checks per trace and system (0: none)")
	cmd.Flags().IntVar(&f.repeat, "repeat", 1, "run every system this many times, the systems' order rotated each time; each row is the median run")
	cmd.Flags().StringSliceVar(&f.exclude, "exclude-kinds", nil, "action kinds the generator leaves out, each once, not all: "+strings.Join(bench.Kinds(), ", "))
	o.add(cmd)
	return cmd
}

// writeReport writes results.json, results.md and chart.svg into dir.
func writeReport(dir string, rep *bench.Report) error {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("--out: %w", err)
	}
	var j, md, svg bytes.Buffer
	if err := printJSON(&j, rep); err != nil {
		return err
	}
	rep.Markdown(&md)
	rep.SVG(&svg)
	for _, f := range []struct {
		name string
		b    []byte
	}{{"results.json", j.Bytes()}, {"results.md", md.Bytes()}, {"chart.svg", svg.Bytes()}} {
		if err := os.WriteFile(filepath.Join(dir, f.name), f.b, 0o644); err != nil {
			return fmt.Errorf("--out: %w", err)
		}
	}
	return nil
}

// fanoutFlags are bench fanout's flags.
type fanoutFlags struct {
	counts []int
	step   float64
	fsKind string
	repeat int
}

// options checks the flags (changed reports whether a flag was given) and
// returns the run's options, without a client: it runs before the command
// connects to the daemon.
func (f *fanoutFlags) options(changed func(string) bool) (bench.FanoutOptions, error) {
	o := bench.FanoutOptions{Counts: f.counts, TrainerStepMS: f.step, FS: f.fsKind, Repeat: f.repeat}
	switch {
	case changed("n") && len(f.counts) == 0:
		return o, fmt.Errorf("-n: no width given (1..%d)", bench.MaxForks)
	case !(f.step > 0):
		return o, fmt.Errorf("--trainer-step-ms %g: want a positive number", f.step)
	case f.repeat < 1:
		return o, fmt.Errorf("--repeat %d: want 1 or more", f.repeat)
	}
	if err := o.Validate(); err != nil {
		return o, err
	}
	return o, nil
}

func newBenchFanoutCmd() *cobra.Command {
	var (
		o clientOpts
		f fanoutFlags
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
(--json: "targets"). The command exits 1 when a row failed (after printing every
row), and on SIGINT or SIGTERM removes what it made and exits 128 + the signal's
number.`,
		Example: "  rewind bench fanout -n 16,32,64\n  rewind bench fanout -n 16,32,64 --repeat 3\n  rewind bench fanout -n 64 --trainer-step-ms 2000 --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			opts, err := f.options(cmd.Flags().Changed)
			if err != nil {
				return err
			}
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			stderr := cmd.ErrOrStderr()
			opts.Client, opts.Progress = c, stderr
			ctx, exitCode, stop := onInterrupt(cmd.Context(), stderr)
			rows, err := bench.RunFanout(ctx, opts)
			stop()
			if err != nil {
				return interrupted(err, exitCode, stderr)
			}
			verdicts := bench.JudgeFanout(rows)
			if o.json {
				if err := printJSON(cmd.OutOrStdout(), map[string]any{"trainer_step_ms": f.step, "machine": bench.Machine(), "rows": rows, "targets": verdicts}); err != nil {
					return err
				}
			} else {
				printFanout(cmd.OutOrStdout(), rows, verdicts, f.repeat)
			}
			fmt.Fprintln(stderr, fanoutGCHint)
			var failed []string
			for _, r := range rows {
				if r.Error != "" {
					failed = append(failed, fmt.Sprintf("%s n=%d", r.Name, r.N))
				}
			}
			if len(failed) > 0 {
				return fmt.Errorf("%d of %d rows failed (see them): %s", len(failed), len(rows), strings.Join(failed, ", "))
			}
			return nil
		},
	}
	cmd.Flags().IntSliceVarP(&f.counts, "n", "n", []int{16, 32, 64}, fmt.Sprintf("fan-out widths, each 1..%d, each once", bench.MaxForks))
	cmd.Flags().Float64Var(&f.step, "trainer-step-ms", 5000, "simulated trainer step the rollouts feed, ms (more than 0)")
	cmd.Flags().StringVar(&f.fsKind, "fs", "", "file-system backend of the forked sandbox and its children: auto, fuse or kernel (native overlayfs: needs the daemon's state dir on its own file system, see rewind init-store; default: the daemon's)")
	cmd.Flags().IntVar(&f.repeat, "repeat", 1, "run the whole benchmark this many times, its parts' order rotated each time; each row is the median run")
	o.add(cmd)
	return cmd
}

// printFanout prints fan-out rows as a Markdown table, the runs of each
// row when there were several, and the targets' verdicts.
func printFanout(w io.Writer, rows []bench.FanoutRow, verdicts []bench.Verdict, repeat int) {
	fmt.Fprintf(w, "machine: %s\n\n", bench.Machine())
	fmt.Fprintf(w, "| system | n | ready ms | over floor ms | fork/copy ms | trainer wait | GPU util | MemAvailable drop MiB | disk MiB |\n|---|---|---|---|---|---|---|---|---|\n")
	for _, r := range rows {
		if r.Error != "" {
			fmt.Fprintf(w, "| %s | %d | error: %s | | | | | | |\n", r.Name, r.N, strings.ReplaceAll(r.Error, "|", "/"))
			continue
		}
		over := ""
		if r.OverFloorMS != 0 {
			over = fmt.Sprintf("%.1f", r.OverFloorMS)
		}
		fmt.Fprintf(w, "| %s | %d | %.1f | %s | %.1f | %.1f%% | %.1f%% | %.1f | %.1f |\n", r.Name, r.N, r.ReadyMS, over, r.ForkMS,
			100*r.TrainerWait, 100*r.GPUUtil, float64(r.MemDeltaBytes)/(1<<20), float64(r.DiskBytes)/(1<<20))
	}
	fmt.Fprintf(w, "\nMemAvailable drop: how far the host's MemAvailable fell while the copies existed, at least 0; anything else running moves it too.\n")
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
}
