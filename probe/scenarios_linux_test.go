package probe

import (
	"encoding/json"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// env is what one scenario runs in.
type env struct {
	t       *testing.T
	backend string
	cg      string
	dir     string // the sandbox's working directory
	bash    *pshell
	py      *pshell
	port    int    // a listener of the test, outside the sandbox
	remote  string // a non-loopback address of this host
}

type scenario struct {
	name  string
	bash  bool // start a persistent bash before the turn
	py    bool // start a persistent python3 REPL before the turn
	setup func(e *env)
	turn  func(e *env)
	check func(e *env, r *effect.Report)
}

func writeFile(t *testing.T, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func makeTree(t *testing.T, root string, n int) {
	for i := 0; i < n; i++ {
		writeFile(t, filepath.Join(root, fmt.Sprintf("d%d", i%5), fmt.Sprintf("f%d.txt", i)), fmt.Sprintf("line %d\nneedle %d\n", i, i))
	}
}

// Expectation helpers: each fails the test with the report's JSON on error.
func expect(e *env, r *effect.Report, ok bool, format string, args ...any) {
	e.t.Helper()
	if !ok {
		e.t.Errorf("%s: "+format, append([]any{e.backend}, args...)...)
	}
}

// quiet checks what a read-only one-shot command must leave at zero.
func quiet(e *env, r *effect.Report) {
	e.t.Helper()
	expect(e, r, !r.FSChanged(), "FS changed: %+v", r.FS)
	expect(e, r, r.Proc.NewLongLived == 0 && r.Proc.Exited == 0 && r.Proc.CwdChanges == 0, "proc: %+v", r.Proc)
	expect(e, r, r.Mem.PagesWritten == 0, "pages written %d (%+v)", r.Mem.PagesWritten, r.Mem.PerProc)
	expect(e, r, !r.NetChanged(), "net: %+v", r.Net)
	expect(e, r, r.LostEvents == 0, "lost %d", r.LostEvents)
}

func execed(e *env, r *effect.Report, comm string) {
	e.t.Helper()
	if e.backend != effect.BackendEBPF {
		return
	}
	expect(e, r, r.Proc.Execs >= 1, "execs = %d", r.Proc.Execs)
	found := false
	for _, x := range r.Proc.ExecSamples {
		if x.Comm == comm && strings.HasSuffix(x.Argv0, "/"+comm) {
			found = true
		}
	}
	expect(e, r, found, "no exec sample of %s in %+v", comm, r.Proc.ExecSamples)
}

func hasSample(r *effect.Report, op, suffix string) bool {
	for _, s := range r.FS.Samples {
		if s.Op == op && strings.HasSuffix(s.Path, suffix) {
			return true
		}
	}
	return false
}

// fsOnly checks a one-shot command that changed files and nothing else.
func fsOnly(e *env, r *effect.Report) {
	e.t.Helper()
	expect(e, r, r.FSChanged(), "FS unchanged")
	expect(e, r, r.Proc.NewLongLived == 0 && r.Proc.Exited == 0 && r.Proc.CwdChanges == 0, "proc: %+v", r.Proc)
	expect(e, r, r.Mem.PagesWritten == 0, "pages written %d", r.Mem.PagesWritten)
	expect(e, r, !r.NetChanged(), "net: %+v", r.Net)
	expect(e, r, r.LostEvents == 0, "lost %d", r.LostEvents)
}

// shellOnly checks a persistent-process turn that changed no file.
func shellOnly(e *env, r *effect.Report, alive uint64) {
	e.t.Helper()
	expect(e, r, !r.FSChanged(), "FS changed: %+v", r.FS)
	expect(e, r, r.Proc.Alive == alive, "alive = %d, want %d", r.Proc.Alive, alive)
	expect(e, r, r.Mem.PagesWritten >= 1 && !r.Mem.Exact, "pages written %d exact %v", r.Mem.PagesWritten, r.Mem.Exact)
	expect(e, r, r.ProcChanged(), "ProcChanged false")
	expect(e, r, r.LostEvents == 0, "lost %d", r.LostEvents)
}

var scenarios = []scenario{
	{
		name:  "cat",
		setup: func(e *env) { writeFile(e.t, filepath.Join(e.dir, "a.txt"), "hello\n") },
		turn: func(e *env) {
			if out := runIn(e.t, e.cg, e.dir, "cat", "a.txt"); out != "hello\n" {
				e.t.Fatalf("cat: %q", out)
			}
		},
		check: func(e *env, r *effect.Report) {
			quiet(e, r)
			execed(e, r, "cat")
			expect(e, r, r.Proc.Alive == 0, "alive = %d", r.Proc.Alive)
		},
	},
	{
		name:  "grep -r",
		setup: func(e *env) { makeTree(e.t, filepath.Join(e.dir, "src"), 40) },
		turn: func(e *env) {
			if out := runIn(e.t, e.cg, e.dir, "grep", "-r", "needle 7", "src"); !strings.Contains(out, "f7.txt") {
				e.t.Fatalf("grep: %q", out)
			}
		},
		check: func(e *env, r *effect.Report) { quiet(e, r); execed(e, r, "grep") },
	},
	{
		name:  "ls -R",
		setup: func(e *env) { makeTree(e.t, filepath.Join(e.dir, "src"), 40) },
		turn: func(e *env) {
			if out := runIn(e.t, e.cg, e.dir, "ls", "-R"); !strings.Contains(out, "f39.txt") {
				e.t.Fatalf("ls: %q", out)
			}
		},
		check: func(e *env, r *effect.Report) { quiet(e, r); execed(e, r, "ls") },
	},
	{
		name: "echo x > f",
		turn: func(e *env) { runIn(e.t, e.cg, e.dir, "sh", "-c", "echo x > f") },
		check: func(e *env, r *effect.Report) {
			fsOnly(e, r)
			expect(e, r, r.FS.Created == 1, "created = %d", r.FS.Created)
			expect(e, r, hasSample(r, "create", "f"), "samples %+v", r.FS.Samples)
			if e.backend == effect.BackendUserspace {
				expect(e, r, r.FS.BytesWritten == 2 && r.FS.UpperNonEmpty, "fs %+v", r.FS)
			}
			b, _ := os.ReadFile(filepath.Join(e.dir, "f"))
			expect(e, r, string(b) == "x\n", "f = %q", b)
		},
	},
	{
		name: "pip-install burst",
		turn: func(e *env) {
			runIn(e.t, e.cg, e.dir, "python3", "-c", `
import os
os.makedirs("site/pkg/sub")
for i in range(400):
    with open("site/pkg/sub/m%d.py" % i, "w") as f:
        f.write("x = %d\n" % i)
`)
		},
		check: func(e *env, r *effect.Report) {
			fsOnly(e, r)
			expect(e, r, r.FS.Created >= 400, "created = %d", r.FS.Created)
			expect(e, r, len(r.FS.Samples) == effect.MaxSamples, "%d samples", len(r.FS.Samples))
		},
	},
	{
		name:  "rm -rf",
		setup: func(e *env) { makeTree(e.t, filepath.Join(e.dir, "junk"), 50) },
		turn:  func(e *env) { runIn(e.t, e.cg, e.dir, "rm", "-rf", "junk") },
		check: func(e *env, r *effect.Report) {
			fsOnly(e, r)
			expect(e, r, r.FS.Deleted == 56, "deleted = %d, want 50 files + 6 dirs", r.FS.Deleted)
			expect(e, r, r.FS.Created == 0, "created = %d", r.FS.Created)
			_, err := os.Stat(filepath.Join(e.dir, "junk"))
			expect(e, r, os.IsNotExist(err), "junk still there: %v", err)
		},
	},
	{
		name: "mkdir",
		turn: func(e *env) { runIn(e.t, e.cg, e.dir, "mkdir", "newdir") },
		check: func(e *env, r *effect.Report) {
			fsOnly(e, r)
			expect(e, r, r.FS.Created == 1, "created = %d", r.FS.Created)
			expect(e, r, hasSample(r, "create", "newdir"), "samples %+v", r.FS.Samples)
		},
	},
	{
		name:  "cd in persistent bash",
		bash:  true,
		setup: func(e *env) { os.Mkdir(filepath.Join(e.dir, "sub"), 0o755) },
		turn:  func(e *env) { e.bash.run("cd sub") },
		check: func(e *env, r *effect.Report) {
			shellOnly(e, r, 1)
			expect(e, r, r.Proc.CwdChanges == 1 && r.Proc.NewLongLived == 0 && r.Proc.Exited == 0, "proc %+v", r.Proc)
			cwd, _ := os.Readlink(fmt.Sprintf("/proc/%d/cwd", e.bash.pid()))
			expect(e, r, cwd == filepath.Join(e.dir, "sub"), "bash cwd %s", cwd)
			if e.backend == effect.BackendEBPF {
				expect(e, r, r.Proc.Forked == 0 && r.Proc.Execs == 0, "proc %+v", r.Proc)
			}
		},
	},
	{
		name: "export in persistent bash",
		bash: true,
		turn: func(e *env) { e.bash.run("export V=1") },
		check: func(e *env, r *effect.Report) {
			shellOnly(e, r, 1)
			expect(e, r, r.Proc.CwdChanges == 0 && r.Proc.NewLongLived == 0 && r.Proc.Exited == 0, "proc %+v", r.Proc)
			if out := e.bash.run(`echo "V=$V"`); len(out) != 1 || out[0] != "V=1" {
				e.t.Errorf("bash lost the variable: %q", out)
			}
		},
	},
	{
		name:  "python list grows",
		py:    true,
		setup: func(e *env) { e.py.run("x = []") },
		turn:  func(e *env) { e.py.run("x.extend(range(2000000))") },
		check: func(e *env, r *effect.Report) {
			shellOnly(e, r, 1)
			expect(e, r, r.Mem.PagesWritten >= 5000, "pages written %d", r.Mem.PagesWritten)
			expect(e, r, len(r.Mem.PerProc) == 1 && r.Mem.PerProc[0].PID == e.py.pid(), "per proc %+v", r.Mem.PerProc)
			expect(e, r, r.Proc.NewLongLived == 0 && r.Proc.CwdChanges == 0, "proc %+v", r.Proc)
			if out := e.py.run("print(len(x))"); len(out) != 1 || out[0] != "2000000" {
				e.t.Errorf("python: %q", out)
			}
		},
	},
	{
		name: "background server",
		bash: true,
		turn: func(e *env) {
			e.bash.run(`python3 -c 'import socket,time; s=socket.socket(); s.bind(("127.0.0.1",0)); s.listen(); print("PORT", s.getsockname()[1], flush=True); time.sleep(3600)' &`)
			e.bash.waitLine(hasPrefixLine("PORT "))
		},
		check: func(e *env, r *effect.Report) {
			expect(e, r, !r.FSChanged(), "FS changed: %+v", r.FS)
			expect(e, r, r.Proc.NewLongLived == 1 && r.Proc.Alive == 2, "proc %+v", r.Proc)
			expect(e, r, len(r.Proc.LongLived) == 1 && r.Proc.LongLived[0].Comm == "python3", "long lived %+v", r.Proc.LongLived)
			expect(e, r, r.Net.Listens == 1 && r.Net.RemoteConnects == 0, "net %+v", r.Net)
			expect(e, r, r.LostEvents == 0, "lost %d", r.LostEvents)
		},
	},
	{
		name:  "kill background job",
		bash:  true,
		setup: func(e *env) { e.bash.run("sleep 3600 &") },
		turn:  func(e *env) { e.bash.run("kill %1; wait") },
		check: func(e *env, r *effect.Report) {
			shellOnly(e, r, 1)
			expect(e, r, r.Proc.Exited == 1 && r.Proc.NewLongLived == 0, "proc %+v", r.Proc)
			if e.backend == effect.BackendEBPF {
				expect(e, r, r.Proc.SignalsSent >= 1, "signals %d", r.Proc.SignalsSent)
			}
		},
	},
	{
		name: "client to loopback listener",
		turn: func(e *env) {
			runIn(e.t, e.cg, e.dir, "python3", "-c", fmt.Sprintf(
				`import socket; s=socket.create_connection(("127.0.0.1",%d)); s.sendall(b"hello"); s.close()`, e.port))
		},
		check: func(e *env, r *effect.Report) {
			quiet(e, r)
			if e.backend == effect.BackendEBPF {
				expect(e, r, r.Net.BytesSent >= 5, "bytes sent %d", r.Net.BytesSent)
			}
		},
	},
	{
		name: "connection to a non-loopback address",
		py:   true,
		setup: func(e *env) {
			e.py.run("import socket")
		},
		turn: func(e *env) {
			e.py.run(fmt.Sprintf(`s = socket.create_connection((%q, %d))`, e.remote, e.port))
		},
		check: func(e *env, r *effect.Report) {
			want := fmt.Sprintf("%s:%d", e.remote, e.port)
			expect(e, r, r.Net.RemoteConnects == 1 && len(r.Net.Remotes) == 1 && r.Net.Remotes[0] == want, "net %+v, want %s", r.Net, want)
			expect(e, r, r.NetChanged(), "NetChanged false")
		},
	},
}

// nonLoopbackAddr returns an IPv4 address of this host that is not loopback.
func nonLoopbackAddr(t *testing.T) string {
	addrs, err := net.InterfaceAddrs()
	if err != nil {
		t.Fatal(err)
	}
	for _, a := range addrs {
		if n, ok := a.(*net.IPNet); ok && n.IP.To4() != nil && !n.IP.IsLoopback() {
			return n.IP.String()
		}
	}
	testenv.Require(t, false, "a non-loopback IPv4 address")
	return ""
}

// listen accepts connections and drains them until the test ends.
func listen(t *testing.T, addr string) int {
	l, err := net.Listen("tcp4", addr)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { l.Close() })
	go func() {
		for {
			c, err := l.Accept()
			if err != nil {
				return
			}
			go func() { io.Copy(io.Discard, c); c.Close() }()
		}
	}()
	return l.Addr().(*net.TCPAddr).Port
}

func runScenarios(t *testing.T, p Probe, fsFromSource bool) map[string]*effect.Report {
	reports := map[string]*effect.Report{}
	remote := nonLoopbackAddr(t)
	port := listen(t, "0.0.0.0:0")
	for _, sc := range scenarios {
		t.Run(sc.name, func(t *testing.T) {
			e := &env{t: t, backend: p.Backend(), cg: newCgroup(t), dir: t.TempDir(), port: port, remote: remote}
			if sc.bash {
				e.bash = startShell(t, e.cg, e.dir, false)
			}
			if sc.py {
				e.py = startShell(t, e.cg, e.dir, true)
			}
			if sc.setup != nil {
				sc.setup(e)
			}
			tg := Target{Sandbox: "sbx-" + filepath.Base(e.cg), CgroupV2Dir: e.cg}
			if fsFromSource {
				tg.FS = NewDirSource(e.dir)
			}
			w, err := p.Begin(tg)
			if err != nil {
				t.Fatalf("Begin: %v", err)
			}
			sc.turn(e)
			r, err := w.End()
			if err != nil {
				t.Fatalf("End: %v", err)
			}
			if r.Backend != p.Backend() || r.Turn != 1 || r.Version != effect.Version || r.Sandbox != tg.Sandbox {
				t.Errorf("header: %+v", r)
			}
			sc.check(e, r)
			js, _ := json.Marshal(r)
			t.Logf("report: %s", js)
			reports[sc.name] = r
		})
	}
	return reports
}

// policyView is what the built-in policies read from a report: both
// backends must agree on it.
type policyView struct {
	FSChanged, NetChanged, MemWritten   bool
	NewLongLived, Exited, CwdChanges    uint64
	Listens, RemoteConnects, LostEvents uint64
}

func viewOf(r *effect.Report) policyView {
	return policyView{
		FSChanged: r.FSChanged(), NetChanged: r.NetChanged(), MemWritten: r.Mem.PagesWritten > 0,
		NewLongLived: r.Proc.NewLongLived, Exited: r.Proc.Exited, CwdChanges: r.Proc.CwdChanges,
		Listens: r.Net.Listens, RemoteConnects: r.Net.RemoteConnects, LostEvents: r.LostEvents,
	}
}

// TestScenarios runs every scenario with the userspace backend and the eBPF
// backend (with an FSSource, as the daemon does, and without one, which
// attaches the per-syscall hook), then checks that the backends agree on
// what a policy reads.
func TestScenarios(t *testing.T) {
	testenv.RequireRoot(t)
	results := map[string]map[string]*effect.Report{}
	t.Run("userspace", func(t *testing.T) {
		p, err := Open(Options{Backend: BackendUserspace})
		if err != nil {
			t.Fatal(err)
		}
		defer p.Close()
		results["userspace"] = runScenarios(t, p, true)
	})
	for _, mode := range []struct {
		name     string
		fsSource bool
	}{{"ebpf-fs-source", true}, {"ebpf-syscalls", false}} {
		t.Run(mode.name, func(t *testing.T) {
			p, err := Open(Options{Backend: BackendEBPF})
			testenv.RequireNoErr(t, err, "eBPF probe")
			defer p.Close()
			results[mode.name] = runScenarios(t, p, mode.fsSource)
			ep := p.(*ebpfProbe)
			ep.attachMu.Lock()
			attached := ep.sysExitLink != nil
			ep.attachMu.Unlock()
			if attached == mode.fsSource {
				t.Errorf("sys_exit hook attached = %v with fs source = %v", attached, mode.fsSource)
			}
		})
	}
	for _, sc := range scenarios {
		u, e := results["userspace"][sc.name], results["ebpf-fs-source"][sc.name]
		if u == nil || e == nil {
			continue // already failed
		}
		if vu, ve := viewOf(u), viewOf(e); vu != ve {
			t.Errorf("%s: backends disagree:\n userspace %+v\n ebpf      %+v", sc.name, vu, ve)
		}
	}
}
