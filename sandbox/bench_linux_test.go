package sandbox

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"time"
)

// Every benchmark measures rewind and its baseline in the same loop and
// reports both (µs per operation) and their ratio.

func report(b *testing.B, rewind, baseline time.Duration, n int) {
	r := float64(rewind.Microseconds()) / float64(n)
	base := float64(baseline.Microseconds()) / float64(n)
	b.ReportMetric(r, "rewind-µs/op")
	b.ReportMetric(base, "baseline-µs/op")
	if base > 0 {
		b.ReportMetric(r/base, "ratio")
	}
	b.ReportMetric(0, "ns/op")
}

// BenchmarkStart: sandbox start (until the init is ready) vs a plain
// os/exec start+wait of /bin/true. Close is reported separately.
func BenchmarkStart(b *testing.B) {
	requireSandbox(b)
	root, binds := testRoot(b)
	var rw, base, closing time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		sb, err := Start(context.Background(), Config{ID: fmt.Sprintf("bench-%d-%d", os.Getpid(), i), Root: root, Binds: binds})
		if err != nil {
			b.Fatal(err)
		}
		rw += time.Since(t0)
		t1 := time.Now()
		if err := sb.Close(); err != nil {
			b.Fatal(err)
		}
		closing += time.Since(t1)
		t2 := time.Now()
		if err := exec.Command("/bin/true").Run(); err != nil {
			b.Fatal(err)
		}
		base += time.Since(t2)
	}
	report(b, rw, base, b.N)
	b.ReportMetric(float64(closing.Microseconds())/float64(b.N), "close-µs/op")
}

// BenchmarkStartSpare: sandbox start on a spare init (Spares) vs a plain
// os/exec start+wait of /bin/true. Spares are refilled between iterations
// (not timed): this is the latency of one start from a warm pool.
func BenchmarkStartSpare(b *testing.B) {
	requireSandbox(b)
	root, binds := testRoot(b)
	sp := NewSpares(1, "", "bench-", nil)
	defer sp.Close()
	var rw, base time.Duration
	for i := 0; i < b.N; i++ {
		for sp.Ready() == 0 {
			time.Sleep(100 * time.Microsecond)
		}
		t0 := time.Now()
		sb, err := sp.Start(context.Background(), Config{Root: root, Binds: binds})
		if err != nil {
			b.Fatal(err)
		}
		rw += time.Since(t0)
		if err := sb.Close(); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		if err := exec.Command("/bin/true").Run(); err != nil {
			b.Fatal(err)
		}
		base += time.Since(t2)
	}
	report(b, rw, base, b.N)
}

// BenchmarkExec: one-shot exec round trip of `true` (and of `echo` with its
// output captured) vs os/exec on the host.
func BenchmarkExec(b *testing.B) {
	for _, argv := range [][]string{{"/bin/true"}, {"/bin/echo", "hello"}} {
		b.Run(strings.TrimPrefix(argv[0], "/bin/"), func(b *testing.B) {
			sb := startTest(b, nil)
			ctx := context.Background()
			var rw, base time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				code, err := sb.Exec(ctx, ExecRequest{Argv: argv, Stdout: io.Discard})
				if err != nil || code != 0 {
					b.Fatal(code, err)
				}
				rw += time.Since(t0)
				t1 := time.Now()
				cmd := exec.Command(argv[0], argv[1:]...)
				cmd.Stdout = io.Discard
				if err := cmd.Run(); err != nil {
					b.Fatal(err)
				}
				base += time.Since(t1)
			}
			report(b, rw, base, b.N)
		})
	}
}

// BenchmarkSessionSend: Send("echo x") to a bash session until its answer
// vs the same round trip to a bash on the host over plain pipes.
func BenchmarkSessionSend(b *testing.B) {
	sb := startTest(b, nil)
	ctx := context.Background()
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "b", Argv: []string{"bash"}})
	if err != nil {
		b.Fatal(err)
	}
	host := exec.Command("bash")
	in, _ := host.StdinPipe()
	outp, _ := host.StdoutPipe()
	if err := host.Start(); err != nil {
		b.Fatal(err)
	}
	defer func() { in.Close(); _ = host.Wait() }()
	rd := bufio.NewReader(outp)
	until := regexp.MustCompile(`x\n$`)
	var rw, base time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if out, err := ss.Send(ctx, "echo x", SendOptions{Until: until}); err != nil || out != "x\n" {
			b.Fatal(out, err)
		}
		rw += time.Since(t0)
		t1 := time.Now()
		if _, err := io.WriteString(in, "echo x\n"); err != nil {
			b.Fatal(err)
		}
		if line, err := rd.ReadString('\n'); err != nil || line != "x\n" {
			b.Fatal(line, err)
		}
		base += time.Since(t1)
	}
	report(b, rw, base, b.N)
}

// BenchmarkFreezeThaw: freezing and thawing a sandbox running a bash
// session, a sleeper and a shell loop (cgroup v1 freezer) vs stopping the
// same number of host processes with SIGSTOP (waiting until all are
// stopped) and SIGCONT. (Busy loops make both sides wait for the CPU: on 2
// cores every runnable task must be scheduled once to freeze.)
//
// "kept": as sandboxes run, with their empty sibling cgroup held frozen
// (keepFreezerActive); "toggling": that cgroup thawed for the run, so each
// freeze and thaw turns the kernel's freezer static key on and off (what
// every checkpoint paid before, unless another cgroup was frozen).
func BenchmarkFreezeThaw(b *testing.B) {
	for _, kept := range []bool{true, false} {
		name := "kept"
		if !kept {
			name = "toggling"
		}
		b.Run(name, func(b *testing.B) { benchFreezeThaw(b, kept) })
	}
}

func benchFreezeThaw(b *testing.B, kept bool) {
	sb := startTest(b, nil)
	ctx := context.Background()
	if !kept && sb.keepDir != "" {
		state := filepath.Join(sb.keepDir, "freezer.state")
		if err := os.WriteFile(state, []byte("THAWED"), 0); err != nil {
			b.Fatal(err)
		}
		defer os.WriteFile(state, []byte("FROZEN"), 0)
	}
	if _, err := sb.StartSession(ctx, SessionConfig{ID: "b", Argv: []string{"bash"}}); err != nil {
		b.Fatal(err)
	}
	if _, err := sb.Exec(ctx, ExecRequest{Argv: []string{"sh", "-c", "sleep 1000 & (while :; do sleep 0.01; done) & true"}}); err != nil {
		b.Fatal(err)
	}
	procs, _ := sb.Processes()
	var hostProcs []*exec.Cmd
	for range procs {
		c := exec.Command("sleep", "1000")
		if err := c.Start(); err != nil {
			b.Fatal(err)
		}
		hostProcs = append(hostProcs, c)
	}
	defer func() {
		for _, c := range hostProcs {
			_ = c.Process.Kill()
			_ = c.Wait()
		}
	}()
	var fr, th, base time.Duration
	for i := 0; i < b.N; i++ {
		t0 := time.Now()
		if err := sb.Freeze(ctx); err != nil {
			b.Fatal(err)
		}
		t1 := time.Now()
		if err := sb.Thaw(ctx); err != nil {
			b.Fatal(err)
		}
		t2 := time.Now()
		fr += t1.Sub(t0)
		th += t2.Sub(t1)
		for _, c := range hostProcs {
			_ = c.Process.Signal(syscall.SIGSTOP)
		}
		for _, c := range hostProcs {
			for !stopped(c.Process.Pid) {
			}
		}
		for _, c := range hostProcs {
			_ = c.Process.Signal(syscall.SIGCONT)
		}
		base += time.Since(t2)
	}
	report(b, fr+th, base, b.N)
	b.ReportMetric(float64(fr.Microseconds())/float64(b.N), "freeze-µs/op")
	b.ReportMetric(float64(th.Microseconds())/float64(b.N), "thaw-µs/op")
	b.ReportMetric(float64(len(procs)), "procs")
}

func stopped(pid int) bool {
	p, err := readProcess(pid)
	return err != nil || p.State == "T"
}
