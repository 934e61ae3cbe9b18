package cr

import (
	"bytes"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

func needCRIU(t testing.TB) *criu.Runner {
	t.Helper()
	r, err := criu.NewRunner("", "")
	testenv.RequireNoErr(t, err, "criu")
	t.Cleanup(func() { _ = r.Close() })
	return r
}

func TestCRIURunnerInNamespace(t *testing.T) {
	sb := startSandbox(t, "sleep", "1000")
	r := needCRIU(t)
	procs, err := descendants(sb.InitPID(), nil)
	if err != nil || len(procs) != 1 {
		t.Fatalf("procs %+v %v", procs, err)
	}
	p := procs[0]
	if err := unix.Kill(p.PID, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctxT(t), 10*time.Second, func() bool { st, _ := procState(p.PID); return st == 'T' }) {
		t.Fatal("target did not stop")
	}
	dir := filepath.Join(t.TempDir(), "img")
	if err := r.Dump(ctxT(t), criu.DumpOptions{NSInit: sb.InitPID(), Pid: p.NSPID, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	// Without LeaveRunning criu killed it; init reaps it.
	if !waitUntil(ctxT(t), 10*time.Second, func() bool { _, err := os.Stat("/proc/" + itoa(p.PID)); return err != nil }) {
		t.Fatal("dumped process still there")
	}
	nspid, err := r.Restore(ctxT(t), criu.RestoreOptions{NSInit: sb.InitPID(), Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if nspid != p.NSPID {
		t.Fatalf("restored ns pid %d, want %d", nspid, p.NSPID)
	}
	var got []Proc
	waitUntil(ctxT(t), 10*time.Second, func() bool {
		got, _ = descendants(sb.InitPID(), nil)
		return len(got) == 1 && got[0].PPID == sb.InitPID()
	})
	if len(got) != 1 || got[0].NSPID != p.NSPID || got[0].PPID != sb.InitPID() {
		t.Fatalf("after restore: %+v", got)
	}
	var st byte
	if !waitUntil(ctxT(t), 10*time.Second, func() bool { st, _ = procState(got[0].PID); return st == 'T' }) {
		t.Fatalf("restored state %c, want T", st)
	}
}

func TestTemplateMissRestoresFromImage(t *testing.T) {
	for _, lazy := range []bool{false, true} {
		t.Run(fmt.Sprintf("lazy=%v", lazy), func(t *testing.T) { testTemplateMiss(t, lazy) })
	}
}

func testTemplateMiss(t *testing.T, lazy bool) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	x := t.TempDir()
	bashChat(t, live, "cd "+x+"; export V=1; f() { echo fun-$1; }")
	e := newEngine(t, Config{ImagesDir: t.TempDir(), LazyPages: lazy})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitImage(ctxT(t), "c1"); err != nil {
		t.Fatal(err)
	}
	parts, _ := e.Parts("c1")
	if !parts.Image || !parts.Template {
		t.Fatalf("parts %+v", parts)
	}
	if err := e.Evict("c1"); err != nil {
		t.Fatal(err)
	}
	if parts, _ := e.Parts("c1"); parts.Template {
		t.Fatal("template still there after Evict")
	}
	bashChat(t, live, "cd /; export V=2; f() { echo other; }")
	want := x + " 1 fun-x"
	stdio, sessions := freshStdio(t, sb)
	first := "criu"
	if lazy {
		first = "criu-lazy"
	}
	for i, path := range []string{first, "template"} {
		res, err := e.Restore(ctxT(t), sb, "c1", RestoreOptions{Stdio: stdio})
		if err != nil {
			t.Fatal(err)
		}
		if res.Path != path {
			t.Fatalf("restore %d took path %q, want %q", i, res.Path, path)
		}
		if got := bashChat(t, <-sessions, `echo "$PWD $V $(f x)"`); got != want {
			t.Fatalf("restore %d (%s): %q, want %q", i, path, got, want)
		}
	}
}

const unixServer = `
import socketserver, sys
class H(socketserver.StreamRequestHandler):
    def handle(self):
        self.wfile.write(b"pong " + self.rfile.readline())
socketserver.UnixStreamServer(sys.argv[1], H).serve_forever()
`

// ask sends line to the unix socket server at path and returns its answer.
func ask(path, line string) (string, error) {
	var last error
	for i := 0; i < 100; i++ {
		c, err := net.DialTimeout("unix", path, 5*time.Second)
		if err != nil {
			last = err
			time.Sleep(100 * time.Millisecond)
			continue
		}
		_ = c.SetDeadline(time.Now().Add(10 * time.Second))
		fmt.Fprintln(c, line)
		b, err := io.ReadAll(c)
		c.Close()
		return strings.TrimSpace(string(b)), err
	}
	return "", last
}

func TestProcessTreeViaCRIU(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	x := t.TempDir()
	sock := filepath.Join(x, "srv.sock")
	if err := os.WriteFile(filepath.Join(x, "srv.py"), []byte(unixServer), 0o644); err != nil {
		t.Fatal(err)
	}
	bashChat(t, live, fmt.Sprintf("cd %s; export V=1; f() { echo fun-$1; }; python3 srv.py %s >/dev/null 2>&1 & SRV=$!; sleep 1000 & BG=$!", x, sock))
	if got, err := ask(sock, "one"); err != nil || got != "pong one" {
		t.Fatalf("server before checkpoint: %q %v", got, err)
	}
	e := newEngine(t, Config{ImagesDir: t.TempDir(), Logger: testLogger()})
	ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "tree"})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Mode != ModeCRIU || ck.Reason == "" || len(ck.Procs) != 3 {
		t.Fatalf("checkpoint %+v", ck)
	}
	if err := e.WaitImage(ctxT(t), "tree"); err != nil {
		t.Fatalf("a CRIU-mode checkpoint is its image: %v", err)
	}
	before := bashChat(t, live, `echo "$SRV $BG $(jobs -p | tr '\n' ' ')"`)
	bashChat(t, live, "kill $SRV $BG; wait; cd /; export V=2")
	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, "tree", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" || len(res.Procs) != 1 {
		t.Fatalf("restore %+v (checkpoint procs %+v)", res, ck.Procs)
	}
	if p, err := readProc(res.Procs[0].PID); err != nil || p.NSPID != ck.Procs[0].NSPID {
		t.Fatalf("restored root %+v %v, want ns pid %d", p, err, ck.Procs[0].NSPID)
	}
	s := <-sessions
	if got := bashChat(t, s, `echo "$PWD $V $(f x)"`); got != x+" 1 fun-x" {
		t.Fatalf("restored shell: %q", got)
	}
	if got := bashChat(t, s, `echo "$SRV $BG $(jobs -p | tr '\n' ' ')"`); got != before {
		t.Fatalf("jobs after restore %q, before %q", got, before)
	}
	if got := bashChat(t, s, `kill -0 $BG && kill -0 $SRV && echo alive`); got != "alive" {
		t.Fatalf("background jobs: %q", got)
	}
	if got, err := ask(sock, "two"); err != nil || got != "pong two" {
		t.Fatalf("server after restore: %q %v", got, err)
	}
}

// DefaultCRIUPathForTests is where the criu binary is looked for first.
func DefaultCRIUPathForTests() string {
	p, err := criu.Find("")
	if err != nil {
		return criu.DefaultPath
	}
	return p
}

func TestRestoreIntoOtherSandboxes(t *testing.T) {
	needCRIU(t)
	a := startSandbox(t, "bash", "--norc", "--noprofile")
	x := t.TempDir()
	bashChat(t, session{in: a.in, out: a.out}, "cd "+x+"; export V=orig; f() { echo fun-$1; }")
	images := t.TempDir()
	e := newEngine(t, Config{ImagesDir: images})
	if _, err := e.Checkpoint(ctxT(t), a, CheckpointOptions{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitImage(ctxT(t), "c"); err != nil {
		t.Fatal(err)
	}
	// Three fresh sandboxes receive independent copies, restored at the
	// same time from the one image (a fork's fan-out).
	const n = 3
	ss := make([]session, n)
	bs := make([]*testSandbox, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for i := range n {
		b := startSandbox(t, "sleep", "1000")
		bs[i] = b
		stdio, sessions := freshStdio(t, b)
		wg.Add(1)
		go func() {
			defer wg.Done()
			res, err := e.Restore(ctxT(t), b, "c", RestoreOptions{Stdio: stdio})
			if err == nil && (res.Path != "criu" || len(res.Procs) != 1) {
				err = fmt.Errorf("restore into %s: %+v", b.ID(), res)
			}
			if err == nil {
				ss[i] = <-sessions
			}
			errs[i] = err
		}()
	}
	wg.Wait()
	for _, err := range errs {
		if err != nil {
			t.Fatal(err)
		}
	}
	// Each run logged to a file of its own; a successful one's log is
	// left as restore.log.
	if left, _ := filepath.Glob(filepath.Join(images, "*", "*", "*", "restore-*.log")); len(left) != 0 {
		t.Errorf("run logs left behind: %v", left)
	}
	logs, _ := filepath.Glob(filepath.Join(images, "*", "*", "*", criu.RestoreLog))
	if len(logs) != 1 {
		t.Fatalf("restore logs %v, want one", logs)
	}
	if b, err := os.ReadFile(logs[0]); err != nil || !bytes.Contains(b, []byte("Restore finished successfully")) {
		t.Errorf("restore.log is not one successful run's (%v):\n%s", err, b)
	}
	for i, s := range ss {
		bashChat(t, s, fmt.Sprintf("export V=copy%d", i))
	}
	for i, s := range ss {
		if got := bashChat(t, s, `echo "$PWD $V $(f x)"`); got != fmt.Sprintf("%s copy%d fun-x", x, i) {
			t.Fatalf("copy %d: %q", i, got)
		}
		procs, err := e.Processes(bs[i])
		if err != nil || len(procs) != 1 || procs[0].Comm != "bash" {
			t.Fatalf("sandbox %d processes %+v %v", i, procs, err)
		}
	}
	// Fork refuses a foreign sandbox (Restore is the way in).
	if _, err := e.Fork(ctxT(t), bs[0], "c", 1, RestoreOptions{}); err == nil {
		t.Fatal("foreign fork succeeded")
	}
}

func TestLoadImagesAfterRestart(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	bashChat(t, live, "export V=before-restart")
	images := t.TempDir()
	e1, err := New(Config{ImagesDir: images})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e1.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	if err := e1.WaitImage(ctxT(t), "c"); err != nil {
		t.Fatal(err)
	}
	if err := e1.Close(); err != nil { // the daemon goes away: templates die, images stay
		t.Fatal(err)
	}

	bashChat(t, live, "export V=after")
	e2 := newEngine(t, Config{ImagesDir: images})
	loaded, err := e2.LoadImages()
	if err != nil || len(loaded) != 1 || loaded[0].ID != "c" || loaded[0].Mode != ModeTemplate {
		t.Fatalf("loaded %+v, %v", loaded, err)
	}
	stdio, sessions := freshStdio(t, sb)
	res, err := e2.Restore(ctxT(t), sb, "c", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" {
		t.Fatalf("path %q", res.Path)
	}
	if got := bashChat(t, <-sessions, "echo $V"); got != "before-restart" {
		t.Fatalf("restored: %q", got)
	}
}

func TestPython200MBFromImage(t *testing.T) {
	for _, lazy := range []bool{false, true} {
		t.Run(fmt.Sprintf("lazy=%v", lazy), func(t *testing.T) {
			needCRIU(t)
			sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
			live := session{in: sb.in, out: sb.out}
			pyChat(t, live, "a = [i * 7 for i in range(5_600_000)]; d = {str(i): i * i for i in range(100_000)}")
			const probe = "print(sum(a), len(a), a[123456], len(d), d['777'], d.get('x'))"
			want := pyChat(t, live, probe)
			e := newEngine(t, Config{ImagesDir: t.TempDir(), LazyPages: lazy})
			if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "py"}); err != nil {
				t.Fatal(err)
			}
			if err := e.WaitImage(ctxT(t), "py"); err != nil {
				t.Fatal(err)
			}
			if err := e.Evict("py"); err != nil {
				t.Fatal(err)
			}
			pyChat(t, live, "a[123456] = -1; del a[100:]; d['x'] = 1")
			stdio, sessions := freshStdio(t, sb)
			res, err := e.Restore(ctxT(t), sb, "py", RestoreOptions{Stdio: stdio})
			if err != nil {
				t.Fatal(err)
			}
			if !strings.HasPrefix(res.Path, "criu") {
				t.Fatalf("path %q", res.Path)
			}
			if got := pyChat(t, <-sessions, probe); got != want {
				t.Fatalf("restored python: %q, want %q", got, want)
			}
		})
	}
}

// TestTreeCheckpointSkipsExitedProcess: a process listed for a CRIU-path
// checkpoint that exits before it is stopped (a short-lived command) is left
// out; the checkpoint of the others succeeds and restores.
func TestTreeCheckpointSkipsExitedProcess(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	bashChat(t, live, "V=tree; sleep 1000 & true")
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	procs, err := e.Processes(sb)
	if err != nil || len(procs) != 2 {
		t.Fatalf("processes %+v %v", procs, err)
	}
	gone := exec.Command("true")
	if err := gone.Run(); err != nil {
		t.Fatal(err)
	}
	// Listed as a child of init, exited by the time it is stopped.
	procs = append(procs, Proc{PID: gone.Process.Pid, NSPID: 4000, PPID: sb.InitPID(), Threads: 1, Comm: "true"})
	c := &ckpt{rec: Checkpoint{ID: "exited", Sandbox: sb.ID(), Mode: ModeCRIU, Procs: procs}}
	if err := e.checkpointTrees(ctxT(t), c, sb, procs, nil); err != nil {
		t.Fatalf("checkpoint with an exited process: %v", err)
	}
	if len(c.rec.Procs) != 2 || len(c.images) != 1 {
		t.Fatalf("checkpoint kept %+v, %d images", c.rec.Procs, len(c.images))
	}
	e.add(c)
	bashChat(t, live, "kill %1; wait; V=changed")
	stdio, sessions := freshStdio(t, sb)
	if _, err := e.Restore(ctxT(t), sb, "exited", RestoreOptions{Stdio: stdio}); err != nil {
		t.Fatal(err)
	}
	if got := bashChat(t, <-sessions, `echo "$V $(jobs -r | wc -l)"`); got != "tree 1" {
		t.Fatalf("restored shell: %q", got)
	}
}
