package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"slices"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policies"
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy"
)

func newPolicyCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "policy",
		Short: "Test and inspect checkpoint policies (WASM classifiers)",
		Long: `A policy decides after each turn whether a checkpoint is needed: skip, fs
(file system only) or full. Policies are WASM modules (see policy/ABI.md);
the built-in ones are listed by "rewind policy list".`,
		Example: `  rewind policy list
  rewind policy record agent1 --out reports.jsonl --expect expect.jsonl
  rewind policy test effects --reports reports.jsonl --expect expect.jsonl`,
	}
	cmd.AddCommand(newPolicyListCmd(), newPolicyTestCmd(), newPolicyRecordCmd())
	return cmd
}

// builtinDescriptions are one-line summaries of the built-in policies.
var builtinDescriptions = map[string]string{
	"effects":  "skip when nothing lasting changed, fs when only files changed, full when processes, memory or cwd changed",
	"always":   "full checkpoint every turn (the safe baseline)",
	"fs-only":  "fs when files changed, skip otherwise; never checkpoints processes",
	"cautious": "full on any non-loopback connection or new listening socket, effects otherwise",
}

func newPolicyListCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "list",
		Short:   "List the built-in policies",
		Example: "  rewind policy list",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			w := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			for _, n := range policies.Names() {
				def := ""
				if n == policies.Default {
					def = " (default)"
				}
				fmt.Fprintf(w, "%s%s\t%s\n", n, def, builtinDescriptions[n])
			}
			return w.Flush()
		},
	}
}

type policyTestOpts struct {
	reports, expect string
	timeout         time.Duration
	memory          uint64
	quiet           bool
}

func newPolicyTestCmd() *cobra.Command {
	var o policyTestOpts
	cmd := &cobra.Command{
		Use:   "test FILE.wasm|NAME --reports FILE.jsonl [--expect FILE.jsonl]",
		Short: "Run a policy on recorded effect reports and compare with expectations",
		Long: `Runs the policy (a .wasm file or a built-in name) on every report of a JSONL
file (one effect.Report per line) and prints each decision, its reason and
its latency. With --expect (JSONL of {"turn":N,"mode":"skip|fs|full"} and an
optional "reason"), prints the differences and exits with status 1 if any.
The policy runs under the same limits as in the daemon.`,
		Example: `  rewind policy test effects --reports policies/testdata/reports.jsonl
  rewind policy test ./policy.wasm --reports turns.jsonl --expect expect.jsonl`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return runPolicyTest(cmd.Context(), cmd.OutOrStdout(), cmd.ErrOrStderr(), args[0], o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.reports, "reports", "", "JSONL file of effect reports, - for stdin (required)")
	f.StringVar(&o.expect, "expect", "", "JSONL file of expected decisions")
	f.DurationVar(&o.timeout, "timeout", policy.DefaultTimeout, "CPU time one decision may use (and 20 times that in wall time)")
	f.Uint64Var(&o.memory, "memory", policy.DefaultMemoryLimit, "memory limit of the policy in bytes")
	f.BoolVarP(&o.quiet, "quiet", "q", false, "print only differences and the summary")
	_ = cmd.MarkFlagRequired("reports")
	return cmd
}

func readJSONL[T any](path string, read func(io.Reader) ([]T, error)) ([]T, error) {
	if path == "-" {
		v, err := read(os.Stdin)
		if err != nil {
			return nil, fmt.Errorf("stdin: %w", err)
		}
		return v, nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	v, err := read(f)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return v, nil
}

func runPolicyTest(ctx context.Context, stdout, stderr io.Writer, ref string, o policyTestOpts) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if o.timeout <= 0 {
		return fmt.Errorf("--timeout %v: want a positive duration", o.timeout)
	}
	if o.memory < 1<<20 {
		return fmt.Errorf("--memory %d: want at least 1 MiB (a Go-built policy needs 8)", o.memory)
	}
	reports, err := readJSONL(o.reports, policy.ReadReports)
	if err != nil {
		return err
	}
	if len(reports) == 0 {
		return fmt.Errorf("%s: no reports", o.reports)
	}
	var exps []policy.Expectation
	if o.expect != "" {
		if exps, err = readJSONL(o.expect, policy.ReadExpectations); err != nil {
			return err
		}
	}
	h, err := policy.NewHost(ctx, policy.Options{
		Timeout: o.timeout, MemoryLimitBytes: o.memory,
		// Every report is tried even if the policy keeps failing.
		MaxFailures: len(reports) + 1,
		Logger:      slog.New(slog.NewTextHandler(io.Discard, nil)),
	})
	if err != nil {
		return err
	}
	defer h.Close(ctx)
	p, err := h.LoadRef(ctx, ref)
	if err != nil {
		return err
	}
	expByTurn := map[uint64]policy.Expectation{}
	for _, e := range exps {
		expByTurn[e.Turn] = e
	}
	w := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	if !o.quiet {
		fmt.Fprintln(w, "TURN\tDECISION\tLATENCY\tREASON")
	}
	var diffs []string
	var lat []time.Duration
	failures := 0
	for i := range reports {
		r := &reports[i]
		d, err := p.Decide(ctx, r)
		if err != nil {
			return err
		}
		lat = append(lat, d.Latency)
		mode := d.Mode.String()
		if d.Fallback {
			failures++
			mode += " (fallback)"
		}
		if !o.quiet {
			fmt.Fprintf(w, "%d\t%s\t%v\t%s\n", r.Turn, mode, d.Latency.Round(100*time.Nanosecond), d.Reason)
		}
		if e, ok := expByTurn[r.Turn]; ok {
			delete(expByTurn, r.Turn)
			if e.Mode != d.Mode || (e.Reason != "" && e.Reason != d.Reason) {
				diffs = append(diffs, fmt.Sprintf("turn %d: got %s %q, want %s %q", r.Turn, d.Mode, d.Reason, e.Mode, e.Reason))
			}
		}
	}
	if err := w.Flush(); err != nil {
		return err
	}
	for turn := range expByTurn {
		diffs = append(diffs, fmt.Sprintf("turn %d: expected %s, but no report has this turn", turn, expByTurn[turn].Mode))
	}
	slices.Sort(diffs)
	for _, d := range diffs {
		fmt.Fprintln(stdout, "DIFF", d)
	}
	summary := fmt.Sprintf("%s: %d reports, %d fallbacks", p.Name(), len(reports), failures)
	if len(lat) > 0 {
		slices.Sort(lat)
		summary += fmt.Sprintf(", latency p50 %v p99 %v", lat[len(lat)/2], lat[len(lat)*99/100])
	}
	if o.expect != "" {
		summary += fmt.Sprintf(", %d differences from %s", len(diffs), o.expect)
	}
	fmt.Fprintln(stderr, summary)
	if len(diffs) > 0 {
		return exitError{code: 1}
	}
	return nil
}

func newBenchPolicyCmd() *cobra.Command {
	var n int
	cmd := &cobra.Command{
		Use:   "policy [NAME|FILE.wasm ...]",
		Short: "Per-decision latency of WASM policies vs the same rule as native Go (p50, p99, ratio)",
		Long: `Loads each policy (default: every built-in), measures its load time (cold
compile, then from the host's compiled-module cache), warms it up, then times N
decisions on a typical report, next to the same rule run as a native Go
function (built-ins only). Targets: p50 <= 20 µs, p99 <= 200 µs, load from
cache <= 5 ms.`,
		Example: "  rewind bench policy\n  rewind bench policy effects --n 100000\n  rewind bench policy ./policy.wasm",
		RunE: func(cmd *cobra.Command, args []string) error {
			if len(args) == 0 {
				args = policies.Names()
			}
			return runBenchPolicy(cmd.Context(), cmd.OutOrStdout(), args, n)
		},
	}
	cmd.Flags().IntVar(&n, "n", 20000, "timed decisions per policy")
	return cmd
}

// benchPolicyReport is a typical turn: files written by a transient child.
func benchPolicyReport() effect.Report {
	return effect.Report{
		Version: effect.Version, Sandbox: "sb-bench", Turn: 12, Backend: effect.BackendEBPF, DurationUS: 41000,
		FS: effect.FS{Modified: 2, Created: 1, BytesWritten: 4096, UpperNonEmpty: true,
			Samples: []effect.PathSample{{Op: "modify", Path: "/src/app.py"}, {Op: "create", Path: "/src/test_app.py"}}},
		Proc: effect.Proc{Forked: 1, Execs: 1, Exited: 1, Alive: 2, ExecSamples: []effect.Exec{{PID: 77, Comm: "sed", Argv0: "sed"}}},
		Mem:  effect.Mem{Exact: true},
	}
}

func runBenchPolicy(ctx context.Context, out io.Writer, refs []string, n int) error {
	if ctx == nil {
		ctx = context.Background()
	}
	if n < 100 {
		return fmt.Errorf("--n %d: need at least 100 decisions", n)
	}
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	w := tabwriter.NewWriter(out, 0, 4, 2, ' ', 0)
	fmt.Fprintln(w, "POLICY\tLOAD COLD\tLOAD CACHED\tP50\tP99\tNATIVE P50\tNATIVE P99\tP50 RATIO\tFALLBACKS")
	for _, ref := range refs {
		// Cold: a fresh host compiles the module.
		h, err := policy.NewHost(ctx, policy.Options{Logger: quiet})
		if err != nil {
			return err
		}
		t0 := time.Now()
		p, err := h.LoadRef(ctx, ref)
		cold := time.Since(t0)
		if err != nil {
			h.Close(ctx)
			return err
		}
		p.Close(ctx)
		// Cached: the same host loads it again (compiled module reused,
		// one instance created); the median of 7 loads.
		var loads []time.Duration
		for i := 0; i < 7; i++ {
			t0 = time.Now()
			p, err = h.LoadRef(ctx, ref)
			loads = append(loads, time.Since(t0))
			if err != nil {
				h.Close(ctx)
				return err
			}
			if i < 6 {
				p.Close(ctx)
			}
		}
		slices.Sort(loads)
		cached := loads[len(loads)/2]
		rule, native := rules.ByName(ref)
		r := benchPolicyReport()
		for i := 0; i < 2000; i++ {
			_, _ = p.Decide(ctx, &r)
		}
		var wl, nl []time.Duration
		fallbacks := 0
		for i := 0; i < n; i++ {
			t0 := time.Now()
			d, _ := p.Decide(ctx, &r)
			wl = append(wl, time.Since(t0))
			if d.Fallback {
				fallbacks++
			}
			if native {
				t1 := time.Now()
				_, _ = rule(&r)
				nl = append(nl, time.Since(t1))
			}
		}
		h.Close(ctx)
		slices.Sort(wl)
		w50, w99 := wl[len(wl)/2], wl[len(wl)*99/100]
		n50s, n99s, ratio := "-", "-", "-"
		if native {
			slices.Sort(nl)
			n50, n99 := nl[len(nl)/2], nl[len(nl)*99/100]
			n50s, n99s = n50.String(), n99.String()
			ratio = fmt.Sprintf("%.0fx", float64(w50)/float64(max(n50, 1)))
		}
		fmt.Fprintf(w, "%s\t%v\t%v\t%v\t%v\t%s\t%s\t%s\t%d\n", p.Name(), cold.Round(time.Millisecond), cached.Round(10*time.Microsecond),
			w50, w99, n50s, n99s, ratio, fallbacks)
	}
	return w.Flush()
}
