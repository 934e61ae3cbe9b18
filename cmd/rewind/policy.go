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

	"github.com/rewind-sandbox/rewind/policies"
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
  rewind policy test effects --reports reports.jsonl --expect expect.jsonl`,
	}
	cmd.AddCommand(newPolicyListCmd(), newPolicyTestCmd())
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
	f.StringVar(&o.reports, "reports", "", "JSONL file of effect reports (required)")
	f.StringVar(&o.expect, "expect", "", "JSONL file of expected decisions")
	f.DurationVar(&o.timeout, "timeout", policy.DefaultTimeout, "deadline of one decision")
	f.Uint64Var(&o.memory, "memory", policy.DefaultMemoryLimit, "memory limit of the policy in bytes")
	f.BoolVarP(&o.quiet, "quiet", "q", false, "print only differences and the summary")
	_ = cmd.MarkFlagRequired("reports")
	return cmd
}

func readJSONL[T any](path string, read func(io.Reader) ([]T, error)) ([]T, error) {
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
