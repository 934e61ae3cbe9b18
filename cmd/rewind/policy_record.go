package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"os/signal"
	"syscall"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/policy"
	"github.com/rewind-sandbox/rewind/state"
)

type policyRecordOpts struct {
	socket, out, expect string
	follow              bool
	poll                time.Duration // long-poll of one --follow request
}

func newPolicyRecordCmd() *cobra.Command {
	o := policyRecordOpts{poll: 30 * time.Second}
	cmd := &cobra.Command{
		Use:   "record SANDBOX [--out FILE.jsonl] [--expect FILE.jsonl] [--follow]",
		Short: "Write a sandbox's recent effect reports as JSONL, for rewind policy test",
		Long: `Writes the effect reports of the sandbox's recent turns, one effect.Report
per line, oldest first: the input of "rewind policy test --reports". The
daemon keeps the last 256 turns of each sandbox in memory (not across a
daemon restart); a warning says when older ones were dropped.

With --expect, also writes the decision the sandbox's policy took on each
report ({"turn":N,"mode":"...","reason":"..."}, the input of "rewind
policy test --expect"; turns where the policy failed or was not asked are
left out), so a policy can be checked against what the daemon decided.
With --follow, keeps writing reports as turns happen until interrupted.`,
		Example: `  rewind policy record agent1 --out turns.jsonl --expect decided.jsonl
  rewind policy test effects --reports turns.jsonl --expect decided.jsonl
  rewind policy record agent1 --follow | jq -c .fs`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			ctx := cmd.Context()
			if ctx == nil {
				ctx = context.Background()
			}
			if o.follow {
				var stop context.CancelFunc
				ctx, stop = signal.NotifyContext(ctx, os.Interrupt, syscall.SIGTERM)
				defer stop()
			}
			sock := o.socket
			if sock == "" {
				sock = client.SocketFromEnv()
			}
			c := client.New(sock)
			defer c.Close()
			return runPolicyRecord(ctx, c, cmd.OutOrStdout(), cmd.ErrOrStderr(), args[0], o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.socket, "socket", "", "daemon socket (default $REWIND_SOCKET or the daemon's default)")
	f.StringVarP(&o.out, "out", "o", "-", "JSONL file of reports to write, - for stdout")
	f.StringVar(&o.expect, "expect", "", "also write the policy's decisions to this JSONL file")
	f.BoolVarP(&o.follow, "follow", "f", false, "keep recording new turns until interrupted")
	return cmd
}

// createOut opens path for writing ("-" is stdout).
func createOut(path string, stdout io.Writer) (io.Writer, func() error, error) {
	if path == "-" {
		return stdout, func() error { return nil }, nil
	}
	f, err := os.Create(path)
	if err != nil {
		return nil, nil, err
	}
	return f, f.Close, nil
}

func runPolicyRecord(ctx context.Context, c *client.Client, stdout, stderr io.Writer, name string, o policyRecordOpts) (err error) {
	out, closeOut, err := createOut(o.out, stdout)
	if err != nil {
		return err
	}
	defer func() { err = errors.Join(err, closeOut()) }()
	var exp io.Writer
	if o.expect != "" {
		var closeExp func() error
		if exp, closeExp, err = createOut(o.expect, stdout); err != nil {
			return err
		}
		defer func() { err = errors.Join(err, closeExp()) }()
	}
	enc := json.NewEncoder(out)
	var expEnc *json.Encoder
	if exp != nil {
		expEnc = json.NewEncoder(exp)
	}
	var after, n, decided, first, last uint64
	for round := 0; ; round++ {
		// The first request answers what the daemon holds; with --follow,
		// later ones wait for new turns.
		wait := time.Duration(0)
		if round > 0 {
			wait = o.poll
		}
		page, err := c.Reports(ctx, name, after, wait)
		if err != nil {
			if o.follow && ctx.Err() != nil {
				break
			}
			return fmt.Errorf("policy record %s: %w", name, err)
		}
		if page.Dropped > 0 {
			fmt.Fprintf(stderr, "rewind: %d earlier reports of %s are no longer held by the daemon\n", page.Dropped, name)
		}
		for i := range page.Reports {
			tr := &page.Reports[i]
			if err := enc.Encode(tr.Report); err != nil {
				return fmt.Errorf("write %s: %w", o.out, err)
			}
			if n == 0 {
				first = tr.Report.Turn
			}
			last = tr.Report.Turn
			n++
			if e, ok := expectation(tr); ok && expEnc != nil {
				if err := expEnc.Encode(e); err != nil {
					return fmt.Errorf("write %s: %w", o.expect, err)
				}
				decided++
			}
		}
		after = page.Last
		if !o.follow || ctx.Err() != nil {
			break
		}
	}
	summary := fmt.Sprintf("recorded %d reports of %s", n, name)
	if n > 0 {
		summary += fmt.Sprintf(" (turns %d-%d)", first, last)
	}
	if o.out != "-" {
		summary += " to " + o.out
	}
	if o.expect != "" {
		summary += fmt.Sprintf(", %d policy decisions to %s", decided, o.expect)
	}
	fmt.Fprintln(stderr, summary)
	return nil
}

// expectation is the policy's decision on a recorded turn, when it made one.
func expectation(tr *state.TurnReport) (policy.Expectation, bool) {
	if tr.Decision == "" || tr.Fallback || tr.Report == nil {
		return policy.Expectation{}, false
	}
	m, err := policy.ParseMode(string(tr.Decision))
	if err != nil {
		return policy.Expectation{}, false
	}
	return policy.Expectation{Turn: tr.Report.Turn, Mode: m, Reason: tr.Reason}, true
}
