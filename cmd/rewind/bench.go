package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"sort"
	"strconv"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
)

// newBenchCmd is `rewind bench`; areas add their benchmarks as
// subcommands here (one line each).
func newBenchCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:     "bench",
		Short:   "Benchmarks that print rewind's numbers next to a baseline",
		Example: "  rewind bench turn --n 200",
	}
	cmd.AddCommand(newBenchTurnCmd())
	cmd.AddCommand(newBenchMCTSCmd())
	cmd.AddCommand(newBenchFanoutCmd())
	cmd.AddCommand(newBenchPolicyCmd())
	cmd.AddCommand(newBenchSandboxCmd())
	cmd.AddCommand(newBenchFSCmd())
	cmd.AddCommand(newBenchCRCmd())
	return cmd
}

type latencies []time.Duration

func (l latencies) pct(p float64) time.Duration {
	if len(l) == 0 {
		return 0
	}
	s := append(latencies(nil), l...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

func usf(d time.Duration) string { return fmt.Sprintf("%.0f µs", float64(d.Nanoseconds())/1000) }

func newBenchTurnCmd() *cobra.Command {
	var o clientOpts
	var n int
	var keep bool
	var base []string
	cmd := &cobra.Command{
		Use:   "turn",
		Short: "Harness-visible latency of turn for skip, fs and full decisions (p50, p99)",
		Long: `Creates a sandbox, then for each decision runs N rounds of "act, then turn": the act
(an exec that writes a file for fs and full, nothing for skip) is not timed, the turn call is.
The baseline is the daemon's cheapest call (GET /v1/version) over the same socket: the
transport floor. Targets: skip and fs <= 1 ms, full <= 5 ms (the checkpoint itself is async).`,
		Example: "  rewind bench turn\n  rewind bench turn --n 500 --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			c, err := o.connect(cmd)
			if err != nil {
				return err
			}
			res, err := benchTurn(cmd.Context(), c, n, base, keep, cmd.ErrOrStderr())
			if err != nil {
				return err
			}
			if o.json {
				return printJSON(cmd.OutOrStdout(), res)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "CALL\tN\tP50\tP99\tP50/BASELINE\tTARGET")
			for _, r := range res.Rows {
				fmt.Fprintf(tw, "%s\t%d\t%s\t%s\t%.1fx\t%s\n", r.Call, r.N, usf(time.Duration(r.P50US*1000)), usf(time.Duration(r.P99US*1000)), r.Ratio, r.Target)
			}
			tw.Flush()
			fmt.Fprintf(cmd.OutOrStdout(), "back ends: %v\n", res.Backends)
			return nil
		},
	}
	cmd.Flags().IntVar(&n, "n", 200, "rounds per decision")
	cmd.Flags().BoolVar(&keep, "keep", false, "keep the benchmark sandbox")
	cmd.Flags().StringArrayVar(&base, "base", nil, "base directories of the benchmark sandbox (default: the host's root)")
	o.add(cmd)
	return cmd
}

type benchRow struct {
	Call   string  `json:"call"`
	N      int     `json:"n"`
	P50US  float64 `json:"p50_us"`
	P99US  float64 `json:"p99_us"`
	Ratio  float64 `json:"p50_over_baseline"`
	Target string  `json:"target"`
}

type benchResult struct {
	Rows     []benchRow        `json:"rows"`
	Backends map[string]string `json:"backends"`
}

func benchTurn(ctx context.Context, c *client.Client, n int, base []string, keep bool, progress io.Writer) (*benchResult, error) {
	v, err := c.Version(ctx)
	if err != nil {
		return nil, err
	}
	name := "bench-turn-" + strconv.Itoa(os.Getpid())
	if _, err := c.Create(ctx, api.CreateRequest{Name: name, Bases: base}); err != nil {
		return nil, err
	}
	if !keep {
		defer c.Remove(context.WithoutCancel(ctx), name)
	}
	act := func(i int) error {
		code, err := c.Exec(ctx, name, api.ExecRequest{Argv: []string{"sh", "-c", "echo " + strconv.Itoa(i) + " > /tmp/bench-turn"}}, io.Discard, io.Discard)
		if err == nil && code != 0 {
			err = fmt.Errorf("exec exited %d", code)
		}
		if v.Backends["proc"] == "fake" && err != nil {
			_, err = c.Exec(ctx, name, api.ExecRequest{Argv: []string{"write", "/tmp/bench-turn", strconv.Itoa(i)}}, io.Discard, io.Discard)
		}
		return err
	}
	// A first full checkpoint so skip and fs have a parent.
	if err := act(0); err != nil {
		return nil, err
	}
	if _, err := c.Turn(ctx, name, api.TurnRequest{Mode: "full", Wait: true}); err != nil {
		return nil, err
	}
	res := &benchResult{Backends: v.Backends}
	var baseline latencies
	for i := 0; i < n; i++ {
		t := time.Now()
		if _, err := c.Version(ctx); err != nil {
			return nil, err
		}
		baseline = append(baseline, time.Since(t))
	}
	b50 := baseline.pct(0.5)
	res.Rows = append(res.Rows, benchRow{Call: "baseline (GET /v1/version)", N: n, P50US: us(b50), P99US: us(baseline.pct(0.99)), Ratio: 1, Target: "-"})
	for _, mode := range []string{"skip", "fs", "full"} {
		fmt.Fprintf(progress, "bench turn --mode %s: %d rounds\n", mode, n)
		var l latencies
		for i := 0; i < n; i++ {
			if mode != "skip" {
				if err := act(i); err != nil {
					return nil, err
				}
			}
			t := time.Now()
			r, err := c.Turn(ctx, name, api.TurnRequest{Mode: mode})
			d := time.Since(t)
			if err != nil {
				return nil, err
			}
			if string(r.Decision) != mode {
				return nil, fmt.Errorf("turn --mode %s decided %s", mode, r.Decision)
			}
			l = append(l, d)
		}
		target := "<= 1 ms"
		if mode == "full" {
			target = "<= 5 ms"
		}
		res.Rows = append(res.Rows, benchRow{Call: "turn --mode " + mode, N: n, P50US: us(l.pct(0.5)), P99US: us(l.pct(0.99)),
			Ratio: float64(l.pct(0.5)) / float64(max(b50, 1)), Target: target})
	}
	return res, nil
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }
