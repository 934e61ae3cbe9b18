package cr

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/sandbox"
)

var realSeq atomic.Int64

// startReal starts a real sandbox (package sandbox) on a minimal root.
func startReal(t testing.TB) *sandbox.Sandbox {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat(filepath.Dir(sandbox.DefaultFreezerParent))
	testenv.Require(t, err == nil, "cgroup v1 freezer")
	root := t.TempDir()
	binds, err := sandbox.MinimalRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sb, err := sandbox.Start(ctx, sandbox.Config{
		ID:    fmt.Sprintf("crtest-%d-%d", os.Getpid(), realSeq.Add(1)),
		Root:  root,
		Binds: binds,
	})
	if err != nil {
		t.Fatalf("sandbox.Start: %v", err)
	}
	t.Cleanup(func() {
		if err := sb.Close(); err != nil {
			t.Errorf("sandbox Close: %v", err)
		}
	})
	return sb
}

// sessionStdio is the daemon side of seam #3: fresh channels held by the
// init, adopted as session id once the copy runs.
func sessionStdio(ctx context.Context, sb *sandbox.Sandbox, id string) func(Proc) (*Stdio, error) {
	return func(Proc) (*Stdio, error) {
		ch, err := sb.NewChannels()
		if err != nil {
			return nil, err
		}
		nIn, nOut, err := ch.InitFDs(ctx)
		if err != nil {
			ch.Close()
			return nil, err
		}
		in, out := ch.ChildFiles()
		outPath := fmt.Sprintf("/proc/1/fd/%d", nOut)
		return &Stdio{
			Stdin:  fmt.Sprintf("/proc/1/fd/%d", nIn),
			Stdout: outPath,
			Stderr: outPath,
			Files:  [3]*os.File{in, out, out},
			Started: func(pid int) error {
				_, err := sb.AdoptSession(id, pid, ch)
				return err
			},
		}, nil
	}
}

func TestRealSandboxBash(t *testing.T) {
	sb := startReal(t)
	ctx := ctxT(t)
	cfg := Config{Warm: true}
	if _, err := os.Stat(DefaultCRIUPathForTests()); err == nil {
		cfg.ImagesDir = t.TempDir()
	}
	e := newEngine(t, cfg)
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/"})
	if err != nil {
		t.Fatal(err)
	}
	send := func(s *sandbox.Session, cmd string) string {
		t.Helper()
		out, err := s.Send(ctx, cmd, sandbox.SendOptions{})
		if err != nil {
			t.Fatalf("send %q: %v", cmd, err)
		}
		return out
	}
	send(ss, "mkdir -p /tmp/x && cd /tmp/x && export V=1 && f() { echo fn-$1; }")
	barrier := false
	ck, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c1", Barrier: func() error { barrier = true; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Mode != ModeTemplate || !barrier || len(ck.Procs) != 1 {
		t.Fatalf("checkpoint %+v barrier %v", ck, barrier)
	}
	send(ss, "cd / && export V=2 && f() { echo other; }")
	want := "/tmp/x 1 fn-x\n"
	res, err := e.Restore(ctx, sb, "c1", RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "template" {
		t.Fatalf("path %q", res.Path)
	}
	if got := send(sb.Session("main"), `echo "$PWD $V $(f x)"`); got != want {
		t.Fatalf("restored session: %q, want %q", got, want)
	}
	// A second checkpoint freezes the sandbox with c1's stopped template
	// (and spare) in it; both checkpoints stay restorable.
	send(sb.Session("main"), "export V=3")
	if ck2, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c2"}); err != nil || ck2.Mode != ModeTemplate {
		t.Fatalf("second checkpoint %+v %v", ck2, err)
	}
	for _, c := range []struct{ id, want string }{{"c1", want}, {"c2", "/tmp/x 3 fn-x\n"}, {"c1", want}} {
		if _, err := e.Restore(ctx, sb, c.id, RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")}); err != nil {
			t.Fatal(err)
		}
		if got := send(sb.Session("main"), `echo "$PWD $V $(f x)"`); got != c.want {
			t.Fatalf("restore %s: %q, want %q", c.id, got, c.want)
		}
	}
	if cfg.ImagesDir == "" {
		return
	}
	if err := e.WaitImage(ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	if err := e.Evict("c1"); err != nil {
		t.Fatal(err)
	}
	res, err = e.Restore(ctx, sb, "c1", RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" {
		t.Fatalf("path %q", res.Path)
	}
	if got := send(sb.Session("main"), `echo "$PWD $V $(f x)"`); got != want {
		t.Fatalf("session restored from image: %q, want %q", got, want)
	}
	// The CRIU-restored process lives in the sandbox's cgroups.
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sb.Session("main").PID()))
	if err != nil || !strings.Contains(string(cg), "freezer:/rewind/"+sb.ID()) || !strings.Contains(string(cg), "0::/rewind/"+sb.ID()) {
		t.Fatalf("restored process cgroups: %s %v", cg, err)
	}
	// The restored session's exit code is reported (it is a child of init).
	send(sb.Session("main"), "exit 3")
	s := sb.Session("main")
	select {
	case <-s.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("session did not end")
	}
	if s.ExitCode() != 3 {
		t.Fatalf("exit code %d", s.ExitCode())
	}
}

// Regression (deadlock seen with the daemon): an image being written while
// the next checkpoint freezes the sandbox, and a restore and a drop right
// behind it, all complete.
func TestRealSandboxCheckpointDuringImageDump(t *testing.T) {
	sb := startReal(t)
	ctx := ctxT(t)
	needCRIU(t)
	e := newEngine(t, Config{Warm: true, ImagesDir: t.TempDir()})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "py", Argv: []string{"python3", "-u", "-c", pyLoop}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ss.Send(ctx, "buf = bytearray(b'\\x01') * (100 << 20); n = 1", sandbox.SendOptions{Until: regexp.MustCompile("__END__")}); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() {
		for i := 0; i < 3; i++ {
			if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: fmt.Sprint("d", i)}); err != nil {
				done <- err
				return
			}
		}
		if _, err := e.Restore(ctx, sb, "d0", RestoreOptions{Stdio: sessionStdio(ctx, sb, "py")}); err != nil {
			done <- err
			return
		}
		e.Drop("d1")
		done <- e.WaitImage(ctx, "d2")
	}()
	select {
	case err := <-done:
		if err != nil {
			t.Fatal(err)
		}
	case <-time.After(90 * time.Second):
		t.Fatal("checkpoint/restore/drop while images are written did not complete")
	}
	out, err := sb.Session("py").Send(ctx, "print(n, len(buf))", sandbox.SendOptions{Until: regexp.MustCompile("__END__")})
	if err != nil || !strings.Contains(out, fmt.Sprintf("1 %d\n", 100<<20)) {
		t.Fatalf("restored python: %q %v", out, err)
	}
}

// A sandbox process killing the templates (pkill matches them too) must not
// make a restore silently drop a process: the image path takes over.
func TestRealSandboxTemplatesKilledFromInside(t *testing.T) {
	sb := startReal(t)
	ctx := ctxT(t)
	needCRIU(t)
	e := newEngine(t, Config{Warm: true, ImagesDir: t.TempDir()})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "srv", Argv: []string{"python3", "-u", "-c", "import sys, time\nsys.stdin.read()\n# marker-srv-xyz"}}); err != nil {
		t.Fatal(err)
	}
	ck, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c"})
	if err != nil || len(ck.Procs) != 2 {
		t.Fatalf("checkpoint %+v %v", ck, err)
	}
	if err := e.WaitImage(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	waitUntil(ctx, 30*time.Second, func() bool { return e.SparesReady(sb.ID()) })
	if _, err := sb.Session("main").Send(ctx, "pkill -9 -f marker-srv-xyz; echo done", sandbox.SendOptions{Until: regexp.MustCompile("done")}); err != nil {
		t.Fatal(err)
	}
	stdio := func(p Proc) (*Stdio, error) {
		id := map[string]string{"bash": "main", "python3": "srv"}[p.Comm]
		return sessionStdio(ctx, sb, id)(p)
	}
	res, err := e.Restore(ctx, sb, "c", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err) // the image exists: the restore must take it
	}
	if res.Path != "criu" {
		t.Fatalf("path %q, want criu (templates were killed)", res.Path)
	}
	procs, err := e.Processes(sb)
	if err != nil {
		t.Fatal(err)
	}
	var comms []string
	for _, p := range procs {
		comms = append(comms, p.Comm)
	}
	if len(procs) != 2 || len(res.Procs) != 2 {
		// What became of the reported copies (a CI run once found the
		// python copy gone right after the restore).
		var fates []string
		for _, r := range res.Procs {
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", r.PID))
			fates = append(fates, fmt.Sprintf("%s %d: %q %v", r.Orig.Comm, r.PID, st, err))
		}
		for _, id := range []string{"main", "srv"} {
			if ss := sb.Session(id); ss != nil {
				select {
				case <-ss.Done():
					fates = append(fates, fmt.Sprintf("session %s (pid %d) exited, code %d", id, ss.PID(), ss.ExitCode()))
				default:
					fates = append(fates, fmt.Sprintf("session %s runs as pid %d", id, ss.PID()))
				}
			}
		}
		t.Fatalf("restore (path %s) brought back %v (%d reported): %v", res.Path, comms, len(res.Procs), fates)
	}
}

// A restore into a real sandbox kills every process that was not there at
// the checkpoint (a session started since, and what a session started in
// the background) and gives the restored shell pipes it adopts as its
// session (sandbox.AdoptPipes), warm spare or fresh fork.
func TestRealSandboxRestoreKillsNewcomersAndAdoptsPipes(t *testing.T) {
	for _, warm := range []bool{false, true} {
		t.Run(fmt.Sprintf("warm=%v", warm), func(t *testing.T) {
			sb := startReal(t)
			ctx := ctxT(t)
			e := newEngine(t, Config{Warm: warm})
			sb.OnClose(func() { e.DropSandbox(sb.ID()) })
			if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/"}); err != nil {
				t.Fatal(err)
			}
			send := func(cmd string) string {
				t.Helper()
				out, err := sb.Session("main").Send(ctx, cmd+"; echo __END__", sandbox.SendOptions{Until: regexp.MustCompile("__END__\n")})
				if err != nil {
					t.Fatalf("send %q: %v", cmd, err)
				}
				return strings.TrimSuffix(out, "__END__\n")
			}
			send("mkdir -p /tmp/x && cd /tmp/x && export V=1")
			if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c1"}); err != nil {
				t.Fatal(err)
			}
			send("cd / && export V=2")
			bg := send("sleep 1000 & echo $!")
			other, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "other", Argv: []string{"sleep", "1000"}})
			if err != nil {
				t.Fatal(err)
			}
			newcomers := []int{other.PID()}
			if kids, err := children(sb.Session("main").PID()); err != nil || len(kids) != 1 {
				t.Fatalf("background job of the shell (%s): %v %v", bg, kids, err)
			} else {
				newcomers = append(newcomers, kids[0])
			}
			if warm && !waitUntil(ctx, 30*time.Second, func() bool { return e.SparesReady(sb.ID()) }) {
				t.Fatal("no warm spare")
			}
			pipes := func(Proc) func(int, *os.File, *os.File) error {
				return func(pid int, in, out *os.File) error {
					_, err := sb.AdoptPipes("main", pid, in, out)
					return err
				}
			}
			res, err := e.Restore(ctx, sb, "c1", RestoreOptions{Pipes: pipes, Stdio: sessionStdio(ctx, sb, "main")})
			if err != nil {
				t.Fatal(err)
			}
			for _, pid := range newcomers {
				if !dying(pid) {
					t.Fatalf("process %d started after the checkpoint survived the restore", pid)
				}
			}
			if got := send(`echo "$PWD $V"; echo err >&2`); got != "/tmp/x 1\nerr\n" {
				t.Fatalf("restored shell: %q", got)
			}
			if pid := sb.Session("main").PID(); pid != res.Procs[0].PID {
				t.Fatalf("session main is process %d, the copy is %d", pid, res.Procs[0].PID)
			}
		})
	}
}
