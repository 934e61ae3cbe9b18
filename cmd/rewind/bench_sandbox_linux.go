package main

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"syscall"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/sandbox"
)

// sandboxBenchRow is one operation of `rewind bench sandbox`.
type sandboxBenchRow struct {
	Op         string  `json:"op"`
	Baseline   string  `json:"baseline"`
	N          int     `json:"n"`
	P50US      float64 `json:"p50_us"`
	P99US      float64 `json:"p99_us"`
	BaseP50US  float64 `json:"baseline_p50_us"`
	BaseP99US  float64 `json:"baseline_p99_us"`
	RatioP50   float64 `json:"p50_over_baseline"`
	rewind, bl latencies
}

func newBenchSandboxCmd() *cobra.Command {
	var n int
	var asJSON bool
	cmd := &cobra.Command{
		Use:   "sandbox",
		Short: "Sandbox start, exec, session send and freeze/thaw latency next to plain-process baselines",
		Long: `Starts sandboxes directly (no daemon) on a small root made of the host's /usr and /etc
(read-only) and measures, N times each, interleaved with its baseline:
  start         sandbox.Start until the init is ready   vs  os/exec of /bin/true
  start (spare) Spares.Start on a warm spare init        vs  os/exec of /bin/true
  exec          one-shot Exec of /bin/true              vs  os/exec of /bin/true
  session send  Send("echo x") to bash until "x"        vs  the same over pipes to a host bash
  freeze+thaw   cgroup freezer on 4 processes           vs  SIGSTOP (until stopped) + SIGCONT of 4
Needs root, cgroup v1 freezer and cgroup v2.`,
		Example: "  sudo rewind bench sandbox\n  sudo rewind bench sandbox --n 500 --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return fmt.Errorf("bench sandbox needs root")
			}
			rows, err := runSandboxBench(cmd.Context(), n)
			if err != nil {
				return err
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), map[string]any{"rows": rows})
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "OP\tN\tP50\tP99\tBASELINE\tBASE P50\tBASE P99\tP50 RATIO")
			for _, r := range rows {
				fmt.Fprintf(tw, "%s\t%d\t%.0f µs\t%.0f µs\t%s\t%.0f µs\t%.0f µs\t%.2fx\n", r.Op, r.N, r.P50US, r.P99US, r.Baseline, r.BaseP50US, r.BaseP99US, r.RatioP50)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().IntVar(&n, "n", 100, "iterations per operation")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func runSandboxBench(ctx context.Context, n int) ([]sandboxBenchRow, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	if n < 1 {
		n = 1
	}
	root, err := os.MkdirTemp("", "rewind-bench-sandbox-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(root)
	binds, err := sandbox.MinimalRoot(root)
	if err != nil {
		return nil, err
	}
	cfg := func(i int) sandbox.Config {
		return sandbox.Config{ID: fmt.Sprintf("bench-%d-%d", os.Getpid(), i), Root: root, Binds: binds}
	}
	timeIt := func(f func() error) (time.Duration, error) {
		t0 := time.Now()
		err := f()
		return time.Since(t0), err
	}
	runTrue := func() error { return exec.Command("/bin/true").Run() }
	rows := []sandboxBenchRow{
		{Op: "start", Baseline: "os/exec /bin/true"},
		{Op: "start (spare)", Baseline: "os/exec /bin/true"},
		{Op: "exec", Baseline: "os/exec /bin/true"},
		{Op: "session send", Baseline: "host bash over pipes"},
		{Op: "freeze+thaw", Baseline: "SIGSTOP+SIGCONT"},
	}
	// start
	for i := 0; i < n; i++ {
		var sb *sandbox.Sandbox
		d, err := timeIt(func() (err error) { sb, err = sandbox.Start(ctx, cfg(i)); return err })
		if err != nil {
			return nil, err
		}
		if err := sb.Close(); err != nil {
			return nil, err
		}
		b, err := timeIt(runTrue)
		if err != nil {
			return nil, err
		}
		rows[0].rewind, rows[0].bl = append(rows[0].rewind, d), append(rows[0].bl, b)
	}
	// start from a warm spare (the pool refills between iterations, untimed)
	spares := sandbox.NewSpares(1, "", fmt.Sprintf("bench-%d-", os.Getpid()), nil)
	for i := 0; i < n; i++ {
		for spares.Ready() == 0 {
			time.Sleep(100 * time.Microsecond)
		}
		c := cfg(i)
		c.ID = ""
		var sb *sandbox.Sandbox
		d, err := timeIt(func() (err error) { sb, err = spares.Start(ctx, c); return err })
		if err != nil {
			spares.Close()
			return nil, err
		}
		if err := sb.Close(); err != nil {
			spares.Close()
			return nil, err
		}
		b, err := timeIt(runTrue)
		if err != nil {
			spares.Close()
			return nil, err
		}
		rows[1].rewind, rows[1].bl = append(rows[1].rewind, d), append(rows[1].bl, b)
	}
	spares.Close()
	sb, err := sandbox.Start(ctx, cfg(n))
	if err != nil {
		return nil, err
	}
	defer sb.Close()
	// exec
	for i := 0; i < n; i++ {
		d, err := timeIt(func() error {
			code, err := sb.Exec(ctx, sandbox.ExecRequest{Argv: []string{"/bin/true"}})
			if err == nil && code != 0 {
				err = fmt.Errorf("exec: exit %d", code)
			}
			return err
		})
		if err != nil {
			return nil, err
		}
		b, err := timeIt(runTrue)
		if err != nil {
			return nil, err
		}
		rows[2].rewind, rows[2].bl = append(rows[2].rewind, d), append(rows[2].bl, b)
	}
	// session send
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "bench", Argv: []string{"bash"}})
	if err != nil {
		return nil, err
	}
	host := exec.Command("bash")
	hin, _ := host.StdinPipe()
	hout, _ := host.StdoutPipe()
	if err := host.Start(); err != nil {
		return nil, err
	}
	defer func() { hin.Close(); _ = host.Wait() }()
	hr := bufio.NewReader(hout)
	until := regexp.MustCompile(`x\n$`)
	for i := 0; i < n; i++ {
		d, err := timeIt(func() error {
			out, err := ss.Send(ctx, "echo x", sandbox.SendOptions{Until: until})
			if err == nil && out != "x\n" {
				err = fmt.Errorf("send: got %q", out)
			}
			return err
		})
		if err != nil {
			return nil, err
		}
		b, err := timeIt(func() error {
			if _, err := io.WriteString(hin, "echo x\n"); err != nil {
				return err
			}
			_, err := hr.ReadString('\n')
			return err
		})
		if err != nil {
			return nil, err
		}
		rows[3].rewind, rows[3].bl = append(rows[3].rewind, d), append(rows[3].bl, b)
	}
	// freeze+thaw: bash session, init, a sleeper and a shell loop inside; 4
	// sleepers on the host.
	if _, err := sb.Exec(ctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", "sleep 100000 & (while :; do sleep 0.01; done) & true"}}); err != nil {
		return nil, err
	}
	var hostProcs []*exec.Cmd
	defer func() {
		for _, c := range hostProcs {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}()
	for i := 0; i < 4; i++ {
		c := exec.Command("sleep", "100000")
		if err := c.Start(); err != nil {
			return nil, err
		}
		hostProcs = append(hostProcs, c)
	}
	for i := 0; i < n; i++ {
		d, err := timeIt(func() error {
			if err := sb.Freeze(ctx); err != nil {
				return err
			}
			return sb.Thaw(ctx)
		})
		if err != nil {
			return nil, err
		}
		b, _ := timeIt(func() error {
			for _, c := range hostProcs {
				_ = c.Process.Signal(syscall.SIGSTOP)
			}
			for _, c := range hostProcs {
				for !procStopped(c.Process.Pid) {
				}
			}
			for _, c := range hostProcs {
				_ = c.Process.Signal(syscall.SIGCONT)
			}
			return nil
		})
		rows[4].rewind, rows[4].bl = append(rows[4].rewind, d), append(rows[4].bl, b)
	}
	us := func(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }
	for i := range rows {
		r := &rows[i]
		r.N = len(r.rewind)
		r.P50US, r.P99US = us(r.rewind.pct(0.5)), us(r.rewind.pct(0.99))
		r.BaseP50US, r.BaseP99US = us(r.bl.pct(0.5)), us(r.bl.pct(0.99))
		if r.BaseP50US > 0 {
			r.RatioP50 = r.P50US / r.BaseP50US
		}
	}
	return rows, nil
}

// procStopped reports whether pid is in the stopped state (T).
func procStopped(pid int) bool {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return true
	}
	s := string(b)
	for i := len(s) - 1; i > 0; i-- {
		if s[i] == ')' {
			return i+2 < len(s) && s[i+2] == 'T'
		}
	}
	return false
}
