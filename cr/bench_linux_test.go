package cr

import (
	"fmt"
	"os"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"
)

// Benchmarks: go test -run '^$' -bench . -benchtime 20x ./cr/
// Each reports p50/p95 in ms; the baseline (a plain fork() of the same
// process, measured inside it) is reported next to the template numbers.

// benchSizes are the extra bytes the python target holds; python itself is
// ~9 MB, so the targets' RSS is about 15 MB and 200 MB.
var benchSizes = []struct {
	name  string
	bytes int
}{
	{"15MB", 6 << 20},
	{"200MB", 191 << 20},
}

func benchTarget(b *testing.B, size int) (*testSandbox, session) { return benchTargetT(b, size) }

func benchTargetT(b testing.TB, size int) (*testSandbox, session) {
	b.Helper()
	sb := startSandbox(b, "python3", "-u", "-c", pyLoop)
	s := session{in: sb.in, out: sb.out}
	pyChat(b, s, fmt.Sprintf("import os, time; buf = bytearray(b'\\x01') * %d", size))
	return sb, s
}

func rssMB(pid int) float64 {
	p, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(p), "\n") {
		if v, ok := strings.CutPrefix(l, "VmRSS:"); ok {
			kb, _ := strconv.Atoi(strings.Fields(v)[0])
			return float64(kb) / 1024
		}
	}
	return 0
}

func report(b *testing.B, ds []time.Duration) {
	if len(ds) == 0 {
		return
	}
	sort.Slice(ds, func(i, j int) bool { return ds[i] < ds[j] })
	ms := func(d time.Duration) float64 { return float64(d) / 1e6 }
	b.ReportMetric(ms(ds[len(ds)/2]), "p50-ms")
	b.ReportMetric(ms(ds[len(ds)*95/100]), "p95-ms")
	b.ReportMetric(0, "ns/op")
}

// lastSession is a Stdio provider that keeps only the newest session.
type lastSession struct {
	b   testing.TB
	sb  *testSandbox
	cur session
	fn  func(Proc) (*Stdio, error)
	ch  chan session
}

func newLastSession(b testing.TB, sb *testSandbox) *lastSession {
	l := &lastSession{b: b, sb: sb}
	l.fn, l.ch = freshStdio(b, sb)
	return l
}

func (l *lastSession) take() session {
	if l.cur.in != nil {
		l.cur.in.Close()
	}
	l.cur = <-l.ch
	return l.cur
}

func BenchmarkForkBaseline(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			sb, s := benchTarget(b, sz.bytes)
			kids, _ := children(sb.InitPID())
			b.Logf("rss %.0f MB", rssMB(kids[0]))
			out := pyExec(b, s, fmt.Sprintf(`
ts = []
for i in range(%d):
    t0 = time.perf_counter_ns(); p = os.fork()
    if p == 0: os._exit(0)
    ts.append(time.perf_counter_ns() - t0); os.waitpid(p, 0)
print(" ".join(map(str, ts)))`[1:], b.N))
			var ds []time.Duration
			for _, f := range strings.Fields(out) {
				n, _ := strconv.ParseInt(f, 10, 64)
				ds = append(ds, time.Duration(n))
			}
			report(b, ds)
		})
	}
}

func BenchmarkTemplateRestore(b *testing.B) {
	for _, warm := range []bool{false, true} {
		for _, sz := range benchSizes {
			b.Run(fmt.Sprintf("warm=%v/%s", warm, sz.name), func(b *testing.B) {
				sb, s := benchTarget(b, sz.bytes)
				e := newEngine(b, Config{Warm: warm})
				if _, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: "c"}); err != nil {
					b.Fatal(err)
				}
				ls := newLastSession(b, sb)
				var ds []time.Duration
				for i := 0; i < b.N; i++ {
					if warm {
						waitSpare(e, "c")
					}
					t0 := time.Now()
					if _, err := e.Restore(ctxT(b), sb, "c", RestoreOptions{Stdio: ls.fn}); err != nil {
						b.Fatal(err)
					}
					ds = append(ds, time.Since(t0))
					s = ls.take()
				}
				if got := pyChat(b, s, "print(len(buf))"); got != strconv.Itoa(sz.bytes) {
					b.Fatalf("restored copy answers %q", got)
				}
				report(b, ds)
			})
		}
	}
}

func BenchmarkTemplateFork(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			sb, _ := benchTarget(b, sz.bytes)
			e := newEngine(b, Config{})
			if _, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: "c"}); err != nil {
				b.Fatal(err)
			}
			var ds []time.Duration
			for i := 0; i < b.N; i++ {
				t0 := time.Now()
				cs, err := e.Fork(ctxT(b), sb, "c", 1, RestoreOptions{})
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(t0))
				killPid(cs[0][0].PID)
			}
			report(b, ds)
		})
	}
}

func killPid(pid int) {
	p, err := os.FindProcess(pid)
	if err == nil {
		_ = p.Kill()
	}
}

func waitSpare(e *Engine, id string) {
	waitUntil(ctxBG(), 30*time.Second, func() bool {
		e.mu.Lock()
		defer e.mu.Unlock()
		c := e.ckpts[id]
		for _, tm := range c.templates {
			if tm.spare == nil {
				return false
			}
		}
		return true
	})
}

func BenchmarkCRIURestore(b *testing.B) {
	for _, lazy := range []bool{false, true} {
		for _, sz := range benchSizes {
			b.Run(fmt.Sprintf("lazy=%v/%s", lazy, sz.name), func(b *testing.B) {
				needCRIU(b)
				sb, _ := benchTarget(b, sz.bytes)
				e := newEngine(b, Config{ImagesDir: b.TempDir(), LazyPages: lazy})
				if _, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: "c"}); err != nil {
					b.Fatal(err)
				}
				if err := e.WaitImage(ctxT(b), "c"); err != nil {
					b.Fatal(err)
				}
				ls := newLastSession(b, sb)
				var ds []time.Duration
				var s session
				for i := 0; i < b.N; i++ {
					if err := e.Evict("c"); err != nil {
						b.Fatal(err)
					}
					t0 := time.Now()
					res, err := e.Restore(ctxT(b), sb, "c", RestoreOptions{Stdio: ls.fn})
					if err != nil {
						b.Fatal(err)
					}
					ds = append(ds, time.Since(t0))
					if res.Path != e.imagePath() {
						b.Fatalf("path %s", res.Path)
					}
					s = ls.take()
				}
				if got := pyChat(b, s, "print(len(buf))"); got != strconv.Itoa(sz.bytes) {
					b.Fatalf("restored copy answers %q", got)
				}
				report(b, ds)
			})
		}
	}
}

func BenchmarkCheckpointFrozen(b *testing.B) {
	for _, sz := range benchSizes {
		b.Run(sz.name, func(b *testing.B) {
			sb, _ := benchTarget(b, sz.bytes)
			e := newEngine(b, Config{})
			var ds []time.Duration
			for i := 0; i < b.N; i++ {
				ck, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: strconv.Itoa(i)})
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, ck.Frozen)
				e.Drop(ck.ID)
			}
			report(b, ds)
		})
	}
}

// BenchmarkFirstWrite measures, after a restore, how long the restored
// process takes to write one byte in every page of its buffer the first
// time (copy-on-write faults) against a second pass (no faults), with and
// without async-warm.
func BenchmarkFirstWrite(b *testing.B) {
	for _, sz := range benchSizes {
		for _, warm := range []bool{false, true} {
			b.Run(fmt.Sprintf("%s/warm=%v", sz.name, warm), func(b *testing.B) {
				sb, _ := benchTarget(b, sz.bytes)
				e := newEngine(b, Config{Warm: warm})
				if _, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: "c"}); err != nil {
					b.Fatal(err)
				}
				ls := newLastSession(b, sb)
				var first, second []time.Duration
				for i := 0; i < b.N; i++ {
					if warm {
						waitSpare(e, "c")
					}
					if _, err := e.Restore(ctxT(b), sb, "c", RestoreOptions{Stdio: ls.fn}); err != nil {
						b.Fatal(err)
					}
					s := ls.take()
					out := pyExec(b, s, `
def touch():
    t0 = time.perf_counter_ns()
    for i in range(0, len(buf), 4096): buf[i] = 2
    return time.perf_counter_ns() - t0
print(touch(), touch())`[1:])
					f := strings.Fields(out)
					if len(f) != 2 {
						b.Fatalf("bad output %q", out)
					}
					n1, _ := strconv.ParseInt(f[0], 10, 64)
					n2, _ := strconv.ParseInt(f[1], 10, 64)
					first = append(first, time.Duration(n1))
					second = append(second, time.Duration(n2))
				}
				sort.Slice(second, func(i, j int) bool { return second[i] < second[j] })
				b.ReportMetric(float64(second[len(second)/2])/1e6, "second-pass-p50-ms")
				report(b, first)
			})
		}
	}
}

// pyExec runs a multi-line snippet in the python loop (which reads one line
// per command).
func pyExec(t testing.TB, s session, code string) string {
	t.Helper()
	return pyChat(t, s, fmt.Sprintf("exec(%q)", code))
}

// BenchmarkFanOut: time until N copies of one checkpoint all run (Fork
// returns once every copy is released), and the memory they add (private
// dirty bytes of all copies right after the fork).
func BenchmarkFanOut(b *testing.B) {
	for _, n := range []int{16, 32, 64} {
		b.Run(fmt.Sprintf("copies=%d/15MB", n), func(b *testing.B) {
			sb, _ := benchTarget(b, 6<<20)
			e := newEngine(b, Config{})
			if _, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: "c"}); err != nil {
				b.Fatal(err)
			}
			var ds []time.Duration
			var dirty int64
			for i := 0; i < b.N; i++ {
				// Every copy gets its own stdin pipe (kept open, so the
				// copies wait for input like a real session).
				var keep []*os.File
				stdio := func(Proc) (*Stdio, error) {
					r, w, err := os.Pipe()
					if err != nil {
						return nil, err
					}
					keep = append(keep, w)
					return &Stdio{Stdin: fmt.Sprintf("%s/%d/fd/%d", sb.hostProc, os.Getpid(), r.Fd()), Started: func(int) error { return r.Close() }}, nil
				}
				t0 := time.Now()
				cs, err := e.Fork(ctxT(b), sb, "c", n, RestoreOptions{Stdio: stdio})
				if err != nil {
					b.Fatal(err)
				}
				ds = append(ds, time.Since(t0))
				dirty = 0
				for _, c := range cs {
					dirty += privateDirty(c[0].PID)
					killPid(c[0].PID)
				}
				for _, w := range keep {
					w.Close()
				}
			}
			report(b, ds)
			b.ReportMetric(float64(dirty)/float64(n)/1024, "KiB-private/copy")
		})
	}
}
