package main

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/sandbox"
)

// crBenchRow is one line of `rewind bench cr`.
type crBenchRow struct {
	Op        string  `json:"op"`
	RSSMB     int     `json:"rss_mb"`
	N         int     `json:"n"`
	P50MS     float64 `json:"p50_ms"`
	P95MS     float64 `json:"p95_ms"`
	Baseline  string  `json:"baseline,omitempty"`
	BaseP50MS float64 `json:"baseline_p50_ms,omitempty"`
	Ratio     float64 `json:"p50_over_baseline,omitempty"`
	// Phases are the p50 of each step of the restore (template path),
	// in the engine's order.
	Phases []crBenchPhase `json:"phases,omitempty"`
	// PrivateKiBPerCopy is, for the fork rows, the private dirty memory
	// of one copy right after the fork (smaps_rollup), averaged.
	PrivateKiBPerCopy float64 `json:"private_kib_per_copy,omitempty"`
}

// crBenchPhase is the p50 of one step of a restore.
type crBenchPhase struct {
	Name  string  `json:"name"`
	P50MS float64 `json:"p50_ms"`
}

// phaseP50s summarizes the phases of many restores, in first-seen order.
func phaseP50s(all [][]cr.Phase) []crBenchPhase {
	var names []string
	by := map[string]latencies{}
	for _, ps := range all {
		for _, p := range ps {
			if _, ok := by[p.Name]; !ok {
				names = append(names, p.Name)
			}
			by[p.Name] = append(by[p.Name], p.D)
		}
	}
	out := make([]crBenchPhase, 0, len(names))
	for _, n := range names {
		out = append(out, crBenchPhase{Name: n, P50MS: msOf(by[n], 0.5)})
	}
	return out
}

func newBenchCRCmd() *cobra.Command {
	var n int
	var sizes string
	var asJSON, noCollapse bool
	cmd := &cobra.Command{
		Use:   "cr",
		Short: "Process checkpoint/restore: template vs CRIU restore, frozen time, first-write with and without warm",
		Long: `Starts a real sandbox (host /usr and /etc read-only) with a python3 session holding a buffer
so that its RSS is about each --sizes value (MB), and measures N times each:
  restore template       Restore by forking the template (fresh stdio, session adopted)
  restore template+warm  the same with a pre-forked, pre-faulted spare (Config.Warm)
  restore criu           template evicted: CRIU restore of the image, then fork
  restore criu lazy      the same with CRIU lazy pages (userfaultfd)
  checkpoint frozen      how long the agent is stopped per checkpoint (template path); the
                         engine's background work (collapsing memory into huge pages,
                         warming spares) is let finish between operations, as an agent's
                         think time would; "first" is the first checkpoint alone
  first write            writing one byte per page after a restore (copy-on-write faults),
                         without and with warm; baseline: the same loop a second time
  fork K copies          Fork of 16, 32 and 64 live copies (each with pipes of its own) until
                         all run, and each copy's private memory right after; baseline: K
                         times a plain fork() (computed from its p50)
Baseline for restores: a plain fork() of the same process, timed inside it before the
first checkpoint; "fork() at the end" times it again in the last restored process
(after the engine collapsed its memory into huge pages, unless --no-collapse).
Needs root, cgroups and (for the criu rows) CRIU.`,
		Example: "  sudo rewind bench cr\n  sudo rewind bench cr --n 50 --sizes 15,200,1024 --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if os.Geteuid() != 0 {
				return fmt.Errorf("bench cr needs root")
			}
			var szs []int
			for _, f := range strings.Split(sizes, ",") {
				v, err := strconv.Atoi(strings.TrimSpace(f))
				if err != nil || v < 12 {
					return fmt.Errorf("bad --sizes entry %q (MB, at least 12)", f)
				}
				szs = append(szs, v)
			}
			var rows []crBenchRow
			for _, sz := range szs {
				r, err := runCRBench(cmd.Context(), n, sz, noCollapse)
				if err != nil {
					return fmt.Errorf("bench cr at %d MB: %w", sz, err)
				}
				rows = append(rows, r...)
			}
			if asJSON {
				return printJSON(cmd.OutOrStdout(), map[string]any{"rows": rows})
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 0, 2, ' ', 0)
			fmt.Fprintln(tw, "OP\tRSS\tN\tP50\tP95\tBASELINE\tBASE P50\tP50 RATIO")
			for _, r := range rows {
				ratio := "-"
				if r.Baseline != "" {
					ratio = fmt.Sprintf("%.2fx", r.Ratio)
				}
				fmt.Fprintf(tw, "%s\t%d MB\t%d\t%.3f ms\t%.3f ms\t%s\t%.3f ms\t%s\n", r.Op, r.RSSMB, r.N, r.P50MS, r.P95MS, r.Baseline, r.BaseP50MS, ratio)
			}
			if err := tw.Flush(); err != nil {
				return err
			}
			for _, r := range rows {
				if len(r.Phases) == 0 {
					continue
				}
				fmt.Fprintf(cmd.OutOrStdout(), "%s %d MB, p50 by step:", r.Op, r.RSSMB)
				for _, p := range r.Phases {
					fmt.Fprintf(cmd.OutOrStdout(), " %s %.3f", p.Name, p.P50MS)
				}
				fmt.Fprintln(cmd.OutOrStdout(), " (ms)")
			}
			for _, r := range rows {
				if r.PrivateKiBPerCopy > 0 {
					fmt.Fprintf(cmd.OutOrStdout(), "%s %d MB: %.0f KiB private memory per copy right after the fork\n", r.Op, r.RSSMB, r.PrivateKiBPerCopy)
				}
			}
			return nil
		},
	}
	cmd.Flags().IntVar(&n, "n", 20, "iterations per operation")
	cmd.Flags().StringVar(&sizes, "sizes", "15,200", "target RSS values in MB, comma separated")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	cmd.Flags().BoolVar(&noCollapse, "no-collapse", false, "keep the processes' memory in small pages (cr.Config.NoCollapse)")
	return cmd
}

const crBenchLoop = `
import sys, os, time
while True:
    line = sys.stdin.readline()
    if not line:
        break
    try:
        exec(line)
    except Exception as ex:
        print("ERR", ex)
    print("__END__", flush=True)
`

var crBenchEnd = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`__END__\n`) })

type crBench struct {
	ctx context.Context
	sb  *sandbox.Sandbox
}

func (b *crBench) send(code string) (string, error) {
	s := b.sb.Session("main")
	if s == nil {
		return "", fmt.Errorf("no session")
	}
	out, err := s.Send(b.ctx, fmt.Sprintf("exec(%q)", code), sandbox.SendOptions{Until: crBenchEnd()})
	if err != nil {
		return "", err
	}
	out = strings.TrimSuffix(out, "__END__\n")
	if strings.HasPrefix(out, "ERR") {
		return "", fmt.Errorf("python: %s", strings.TrimSpace(out))
	}
	return strings.TrimSpace(out), nil
}

// pipes adopts the pipes of a template copy as session "main".
func (b *crBench) pipes(cr.Proc) func(pid int, stdin, output *os.File) error {
	return func(pid int, stdin, output *os.File) error {
		_, err := b.sb.AdoptPipes("main", pid, stdin, output)
		return err
	}
}

// stdio gives a restored copy fresh channels adopted as session "main".
func (b *crBench) stdio(cr.Proc) (*cr.Stdio, error) {
	ch, err := b.sb.NewChannels()
	if err != nil {
		return nil, err
	}
	nIn, nOut, err := ch.InitFDs(b.ctx)
	if err != nil {
		ch.Close()
		return nil, err
	}
	in, out := ch.ChildFiles()
	op := fmt.Sprintf("/proc/1/fd/%d", nOut)
	return &cr.Stdio{
		Stdin: fmt.Sprintf("/proc/1/fd/%d", nIn), Stdout: op, Stderr: op,
		Files: [3]*os.File{in, out, out},
		Started: func(pid int) error {
			_, err := b.sb.AdoptSession("main", pid, ch)
			return err
		},
	}, nil
}

func msOf(l latencies, p float64) float64 { return float64(l.pct(p)) / 1e6 }

func runCRBench(ctx context.Context, n, rssMB int, noCollapse bool) ([]crBenchRow, error) {
	if ctx == nil {
		ctx = context.Background()
	}
	n = max(n, 1)
	root, err := os.MkdirTemp("", "rewind-bench-cr-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(root)
	binds, err := sandbox.MinimalRoot(root)
	if err != nil {
		return nil, err
	}
	sb, err := sandbox.Start(ctx, sandbox.Config{ID: fmt.Sprintf("bench-cr-%d", os.Getpid()), Root: root, Binds: binds})
	if err != nil {
		return nil, err
	}
	defer sb.Close()
	images, err := os.MkdirTemp("", "rewind-bench-cr-images-")
	if err != nil {
		return nil, err
	}
	defer os.RemoveAll(images)
	b := &crBench{ctx: ctx, sb: sb}
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"python3", "-u", "-c", crBenchLoop}}); err != nil {
		return nil, err
	}
	base, err := b.send("print(open('/proc/self/statm').read().split()[1])")
	if err != nil {
		return nil, err
	}
	pages, _ := strconv.Atoi(base)
	extra := max(rssMB<<20-pages*4096, 1<<20)
	if _, err := b.send(fmt.Sprintf("buf = bytearray(b'\\x01') * %d", extra)); err != nil {
		return nil, err
	}
	// Baseline: plain fork() inside the process.
	forkL, err := b.forks(n)
	if err != nil {
		return nil, err
	}
	var rows []crBenchRow
	row := func(op string, l latencies, baseline string, bl latencies) {
		r := crBenchRow{Op: op, RSSMB: rssMB, N: len(l), P50MS: msOf(l, 0.5), P95MS: msOf(l, 0.95)}
		if baseline != "" {
			r.Baseline, r.BaseP50MS = baseline, msOf(bl, 0.5)
			if r.BaseP50MS > 0 {
				r.Ratio = r.P50MS / r.BaseP50MS
			}
		}
		rows = append(rows, r)
	}
	row("fork() baseline", forkL, "", nil)
	for _, warm := range []bool{false, true} {
		quiet := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelError}))
		e, err := cr.New(cr.Config{Warm: warm, ImagesDir: images, Logger: quiet, NoCollapse: noCollapse})
		if err != nil {
			return nil, err
		}
		err = func() error {
			defer e.Close()
			defer e.DropSandbox(sb.ID())
			var frozen, restore, first, second latencies
			var steps [][]cr.Phase
			for i := 0; i < n; i++ {
				ck, err := e.Checkpoint(ctx, sb, cr.CheckpointOptions{ID: fmt.Sprintf("f%d", i)})
				if err != nil {
					return err
				}
				frozen = append(frozen, ck.Frozen)
				if i > 0 {
					e.Drop(ck.ID)
				}
				settle(e, sb.ID(), warm)
			}
			for i := 0; i < n; i++ {
				settle(e, sb.ID(), warm)
				t0 := time.Now()
				res, err := e.Restore(ctx, sb, "f0", cr.RestoreOptions{Stdio: b.stdio, Pipes: b.pipes})
				if err != nil {
					return err
				}
				restore = append(restore, time.Since(t0))
				steps = append(steps, res.Phases)
				out, err := b.send("def touch():\n    t0 = time.perf_counter_ns()\n    for i in range(0, len(buf), 4096): buf[i] = 2\n    return time.perf_counter_ns() - t0\nprint(touch(), touch())")
				if err != nil {
					return err
				}
				f := strings.Fields(out)
				if len(f) == 2 {
					v1, _ := strconv.ParseInt(f[0], 10, 64)
					v2, _ := strconv.ParseInt(f[1], 10, 64)
					first, second = append(first, time.Duration(v1)), append(second, time.Duration(v2))
				}
			}
			if !warm {
				row("checkpoint frozen", frozen, "", nil)
				row("checkpoint frozen, first", frozen[:1], "", nil)
				row("restore template", restore, "fork()", forkL)
				rows[len(rows)-1].Phases = phaseP50s(steps)
				row("first write (no warm)", first, "second pass", second)
				if err := b.fanOut(e, min(n, 5), forkL, row, func() *crBenchRow { return &rows[len(rows)-1] }); err != nil {
					return err
				}
				// CRIU: evict the template, restore from the image.
				if err := e.WaitImage(ctx, "f0"); err != nil {
					return fmt.Errorf("image: %w", err)
				}
				var crl latencies
				for i := 0; i < min(n, 10); i++ {
					if err := e.Evict("f0"); err != nil {
						return err
					}
					t0 := time.Now()
					res, err := e.Restore(ctx, sb, "f0", cr.RestoreOptions{Stdio: b.stdio, Pipes: b.pipes})
					if err != nil {
						return err
					}
					if res.Path != "criu" {
						return fmt.Errorf("restore took path %s", res.Path)
					}
					crl = append(crl, time.Since(t0))
				}
				row("restore criu (evicted)", crl, "fork()", forkL)
				// The same with lazy pages (userfaultfd), from a second
				// engine that loads the images (as after a restart).
				if err := e.Evict("f0"); err != nil {
					return err
				}
				el, err := cr.New(cr.Config{ImagesDir: images, LazyPages: true, Logger: quiet})
				if err != nil {
					return err
				}
				defer el.Close()
				if _, err := el.LoadImages(); err != nil {
					return err
				}
				var lazyL latencies
				for i := 0; i < min(n, 10); i++ {
					_ = el.Evict("f0")
					t0 := time.Now()
					res, err := el.Restore(ctx, sb, "f0", cr.RestoreOptions{Stdio: b.stdio, Pipes: b.pipes})
					if err != nil {
						return err
					}
					if res.Path != "criu-lazy" {
						return fmt.Errorf("restore took path %s", res.Path)
					}
					lazyL = append(lazyL, time.Since(t0))
				}
				row("restore criu lazy-pages", lazyL, "fork()", forkL)
			} else {
				row("restore template+warm", restore, "fork()", forkL)
				rows[len(rows)-1].Phases = phaseP50s(steps)
				row("first write (warm)", first, "second pass", second)
			}
			if got, err := b.send("print(len(buf))"); err != nil || got != strconv.Itoa(extra) {
				return fmt.Errorf("restored process answers %q, %v", got, err)
			}
			return nil
		}()
		if err != nil {
			return nil, err
		}
	}
	endL, err := b.forks(n)
	if err != nil {
		return nil, err
	}
	row("fork() at the end", endL, "", nil)
	return rows, nil
}

// fanOut times Engine.Fork of 16, 32 and 64 copies of checkpoint f0
// (rounds times each; the copies get pipes of their own, made inside
// them, and are killed after each round) against as many plain fork()
// calls of the process (computed: the count times fork()'s p50), and
// records each copy's private memory right after the fork.
func (b *crBench) fanOut(e *cr.Engine, rounds int, forkL latencies, row func(string, latencies, string, latencies), last func() *crBenchRow) error {
	for _, k := range []int{16, 32, 64} {
		var took latencies
		var dirty int64
		for j := 0; j < rounds; j++ {
			var mu sync.Mutex
			var keep []*os.File
			pipes := func(cr.Proc) func(int, *os.File, *os.File) error {
				return func(_ int, in, out *os.File) error {
					mu.Lock()
					keep = append(keep, in, out)
					mu.Unlock()
					return nil
				}
			}
			t0 := time.Now()
			copies, err := e.Fork(b.ctx, b.sb, "f0", k, cr.RestoreOptions{Pipes: pipes})
			if err != nil {
				return fmt.Errorf("fork %d copies: %w", k, err)
			}
			took = append(took, time.Since(t0))
			dirty = 0
			for _, c := range copies {
				for _, r := range c {
					dirty += privateDirtyOf(r.PID)
					_ = unix.Kill(r.PID, unix.SIGKILL)
				}
			}
			mu.Lock()
			for _, f := range keep {
				f.Close()
			}
			mu.Unlock()
			settle(e, b.sb.ID(), false)
		}
		row(fmt.Sprintf("fork %d copies", k), took, fmt.Sprintf("%d x fork()", k), latencies{time.Duration(k) * forkL.pct(0.5)})
		last().PrivateKiBPerCopy = float64(dirty) / float64(k) / 1024
	}
	return nil
}

// privateDirtyOf returns Private_Dirty of pid in bytes (0 if unreadable).
func privateDirtyOf(pid int) int64 {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Private_Dirty:"); ok {
			if f := strings.Fields(v); len(f) > 0 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// forks times n plain fork() calls inside the session's process.
func (b *crBench) forks(n int) (latencies, error) {
	out, err := b.send(fmt.Sprintf("ts = []\nfor i in range(%d):\n    t0 = time.perf_counter_ns(); p = os.fork()\n    if p == 0: os._exit(0)\n    ts.append(time.perf_counter_ns() - t0); os.waitpid(p, 0)\nprint(' '.join(map(str, ts)))", n))
	if err != nil {
		return nil, err
	}
	var l latencies
	for _, f := range strings.Fields(out) {
		v, _ := strconv.ParseInt(f, 10, 64)
		l = append(l, time.Duration(v))
	}
	return l, nil
}

// settle waits until the engine's background work for sb is done: memory
// collapses and, with warm, the spares.
func settle(e *cr.Engine, sb string, warm bool) {
	deadline := time.Now().Add(30 * time.Second)
	for time.Now().Before(deadline) && (e.Collapsing(sb) || (warm && !e.SparesReady(sb))) {
		time.Sleep(time.Millisecond)
	}
}
