package cr

import (
	"bufio"
	"context"
	"fmt"
	"github.com/rewind-sandbox/rewind/internal/mountinfo"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/sandbox"
	"golang.org/x/sys/unix"
)

// The test binary doubles as a minimal sandbox init: run as PID 1 of a new
// PID namespace, it starts os.Args[1:] in its own session and reaps every
// child, like the sandbox package's init.
func TestMain(m *testing.M) {
	sandbox.MaybeRunInit()
	// Descriptors inherited from whoever started the test binary must not
	// reach the test sandboxes (CRIU cannot dump a host /dev/null fd from a
	// foreign mount namespace).
	must(unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC))
	if os.Getenv("CR_TEST_INIT") == "1" {
		testInit()
		return
	}
	os.Exit(m.Run())
}

func testInit() {
	// Like the sandbox: a private mount namespace whose /proc shows this
	// PID namespace; the host's /proc stays reachable at $CR_TEST_HOSTPROC
	// so tests can hand pipes to restored processes.
	if hp := os.Getenv("CR_TEST_HOSTPROC"); hp != "" {
		must(unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""))
		detachForeignMounts()
		must(unix.Mount("/proc", hp, "", unix.MS_BIND|unix.MS_REC, ""))
		must(unix.Mount("proc", "/proc", "proc", 0, ""))
	}
	// Like the sandbox init: nothing but stdio reaches the children.
	must(unix.CloseRange(3, ^uint(0), unix.CLOSE_RANGE_CLOEXEC))
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "CR_TEST_") {
			env = append(env, kv)
		}
	}
	_, err := syscall.ForkExec(os.Args[1], os.Args[1:], &syscall.ProcAttr{
		Env: env, Files: []uintptr{0, 1, 2}, Sys: &syscall.SysProcAttr{Setsid: true},
	})
	if err != nil {
		fmt.Fprintln(os.Stderr, "test init:", err)
		os.Exit(1)
	}
	for {
		var ws unix.WaitStatus
		if _, err := unix.Wait4(-1, &ws, unix.WALL, nil); err == unix.ECHILD {
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// detachForeignMounts drops the overlay and FUSE mounts other tests (run in
// parallel) have on the host from this private mount namespace: CRIU parses
// every mount of the namespace and fails on some of them.
func detachForeignMounts() {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return
	}
	for _, m := range mountinfo.Parse(b) {
		if m.FSType == "overlay" || strings.HasPrefix(m.FSType, "fuse") {
			_ = unix.Unmount(m.MountPoint, unix.MNT_DETACH)
		}
	}
}

func must(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "test init:", err)
		os.Exit(1)
	}
}

// testSandbox is a PID namespace with the test init as PID 1 and one
// program as its child.
type testSandbox struct {
	id       string
	hostProc string // host /proc as seen inside
	init     *exec.Cmd
	in       *os.File
	out      *bufio.Reader
}

func (s *testSandbox) ID() string   { return s.id }
func (s *testSandbox) InitPID() int { return s.init.Process.Pid }

// systemLookPath finds a program in the system's directories before $PATH:
// a $PATH entry ahead of them may hold wrappers (pyenv's python3 is a bash
// script that forks subshells while it starts), and a test's sandbox must
// run the program itself, one process, when the test checkpoints it.
func systemLookPath(name string) (string, error) {
	if !strings.Contains(name, "/") {
		for _, dir := range []string{"/usr/bin", "/bin", "/usr/sbin", "/sbin"} {
			p := filepath.Join(dir, name)
			if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() && st.Mode()&0o111 != 0 {
				return p, nil
			}
		}
	}
	return exec.LookPath(name)
}

func startSandbox(t testing.TB, argv ...string) *testSandbox {
	t.Helper()
	testenv.RequireRoot(t)
	path, err := systemLookPath(argv[0])
	testenv.RequireNoErr(t, err, argv[0])
	exe, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	inR, inW, _ := os.Pipe()
	outR, outW, _ := os.Pipe()
	cmd := exec.Command(exe, append([]string{path}, argv[1:]...)...)
	hostProc := t.TempDir()
	cmd.Env = append(os.Environ(), "CR_TEST_INIT=1", "CR_TEST_HOSTPROC="+hostProc)
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, os.Stderr
	// No Pdeathsig: it fires when the forking *thread* exits, and that OS
	// thread may later become an engine's tracer thread, which exits on
	// Engine.Close.
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: unix.CLONE_NEWPID | unix.CLONE_NEWNS}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	inR.Close()
	outW.Close()
	sb := &testSandbox{id: fmt.Sprintf("%s-%d", t.Name(), cmd.Process.Pid), hostProc: hostProc, init: cmd, in: inW, out: bufio.NewReader(outR)}
	t.Cleanup(func() {
		_ = cmd.Process.Kill() // PID 1 dies: the kernel kills the namespace
		_ = cmd.Wait()
		inW.Close()
		outR.Close()
	})
	deadline := time.Now().Add(30 * time.Second)
	initComm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", sb.InitPID()))
	for {
		// Wait for the child to have exec'd (not the init's fork before
		// exec, which still has the init's session).
		kids, _ := children(sb.InitPID())
		if len(kids) > 0 {
			comm, err := os.ReadFile(fmt.Sprintf("/proc/%d/comm", kids[0]))
			if err == nil && string(comm) != string(initComm) {
				break
			}
		}
		if time.Now().After(deadline) {
			t.Fatal("init started no child")
		}
		time.Sleep(5 * time.Millisecond)
	}
	return sb
}

// chat writes cmd and returns the output lines up to the marker line.
func chat(t testing.TB, w *os.File, r *bufio.Reader, cmd, marker string) string {
	t.Helper()
	if _, err := fmt.Fprintln(w, cmd); err != nil {
		t.Fatalf("write %q: %v", cmd, err)
	}
	type res struct {
		s   string
		err error
	}
	ch := make(chan res, 1)
	go func() {
		var b strings.Builder
		for {
			l, err := r.ReadString('\n')
			if err != nil {
				ch <- res{b.String(), err}
				return
			}
			if strings.TrimSpace(l) == marker {
				ch <- res{strings.TrimSpace(b.String()), nil}
				return
			}
			b.WriteString(l)
		}
	}()
	select {
	case x := <-ch:
		if x.err != nil {
			t.Fatalf("reading reply to %q: %v (got %q)", cmd, x.err, x.s)
		}
		return x.s
	case <-time.After(60 * time.Second):
		t.Fatalf("no reply to %q", cmd)
	}
	return ""
}

// session is a stdin/stdout pair of a (restored) process.
type session struct {
	in  *os.File
	out *bufio.Reader
}

// freshStdio returns RestoreOptions.Stdio creating new pipes for every
// copy; the test ends are sent on the returned channel.
func freshStdio(t testing.TB, sb *testSandbox) (func(Proc) (*Stdio, error), chan session) {
	ch := make(chan session, 64)
	return func(Proc) (*Stdio, error) {
		inR, inW, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		outR, outW, err := os.Pipe()
		if err != nil {
			return nil, err
		}
		self := os.Getpid()
		st := &Stdio{
			Stdin:  fmt.Sprintf("%s/%d/fd/%d", sb.hostProc, self, inR.Fd()),
			Stdout: fmt.Sprintf("%s/%d/fd/%d", sb.hostProc, self, outW.Fd()),
			Stderr: fmt.Sprintf("%s/%d/fd/%d", sb.hostProc, self, outW.Fd()),
			Files:  [3]*os.File{inR, outW, outW},
			Started: func(int) error {
				inR.Close()
				outW.Close()
				return nil
			},
		}
		t.Cleanup(func() { inW.Close(); outR.Close() })
		ch <- session{in: inW, out: bufio.NewReader(outR)}
		return st, nil
	}, ch
}

func newEngine(t testing.TB, cfg Config) *Engine {
	t.Helper()
	e, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = e.Close() })
	return e
}

// waitAsleep waits until every process of sb is asleep in a call that it
// blocks in (see quietCalls): a program checkpointed while it still starts
// up (the dynamic loader between reading a library and mapping it) has
// files open whose offsets its template shares with it, and the original
// moves them on (templates share their open file descriptions).
func waitAsleep(t testing.TB, sb *testSandbox) {
	t.Helper()
	ok := waitUntil(ctxT(t), 30*time.Second, func() bool {
		procs, err := descendants(sb.InitPID(), nil)
		if err != nil || len(procs) == 0 {
			return false
		}
		for _, p := range procs {
			if _, maybe := quietBefore(p.PID); !maybe {
				return false
			}
		}
		return true
	})
	if !ok {
		t.Fatal("the sandbox's processes are not asleep after 30 s")
	}
}

func ctxT(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	t.Cleanup(cancel)
	return ctx
}

func testLogger() *slog.Logger {
	return slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelDebug}))
}

func ctxBG() context.Context { return context.Background() }
