package cr

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// pipeSessions returns RestoreOptions.Pipes adopting every copy's pipes;
// the sessions are sent on the returned channel with the copies' pids.
func pipeSessions(t testing.TB) (func(Proc) func(int, *os.File, *os.File) error, chan session, chan int) {
	ch, pids := make(chan session, 64), make(chan int, 64)
	return func(Proc) func(int, *os.File, *os.File) error {
		return func(pid int, in, out *os.File) error {
			t.Cleanup(func() { in.Close(); out.Close() })
			ch <- session{in: in, out: bufio.NewReader(out)}
			pids <- pid
			return nil
		}
	}, ch, pids
}

// pipeFds lists the descriptors of pid that are pipes.
func pipeFds(t testing.TB, pid int) []string {
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var out []string
	for _, e := range ents {
		if l, err := os.Readlink(filepath.Join(dir, e.Name())); err == nil && strings.HasPrefix(l, "pipe:") {
			out = append(out, e.Name()+"="+l)
		}
	}
	return out
}

func TestRestorePipes(t *testing.T) {
	for _, warm := range []bool{false, true} {
		t.Run(fmt.Sprintf("warm=%v", warm), func(t *testing.T) {
			sb := startSandbox(t, "bash", "--norc", "--noprofile")
			live := session{in: sb.in, out: sb.out}
			x := filepath.Join(t.TempDir(), "x")
			if err := os.Mkdir(x, 0o755); err != nil {
				t.Fatal(err)
			}
			bashChat(t, live, fmt.Sprintf("cd %s; export V=1; f() { echo fun-$1; }", x))
			e := newEngine(t, Config{Warm: warm, Logger: testLogger()})
			ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c1"})
			if err != nil {
				t.Fatal(err)
			}
			bashChat(t, live, "cd /; export V=2; f() { echo other; }")
			pipes, sessions, pids := pipeSessions(t)
			stdioAsked := 0
			stdio := func(Proc) (*Stdio, error) { stdioAsked++; return nil, nil }
			want := fmt.Sprintf("%s 1 fun-x", x)
			var prev session
			for i := 0; i < 3; i++ {
				if warm && !waitUntil(ctxT(t), 30*time.Second, func() bool { return e.SparesReady(sb.ID()) }) {
					t.Fatal("no warm spare")
				}
				switched := false
				res, err := e.Restore(ctxT(t), sb, "c1", RestoreOptions{SwitchFS: func() error { switched = true; return nil }, Pipes: pipes, Stdio: stdio})
				if err != nil {
					t.Fatal(err)
				}
				if !switched || res.Path != "template" || len(res.Procs) != 1 || stdioAsked != 0 {
					t.Fatalf("restore %d: %+v switched=%v, Stdio asked %d times", i, res, switched, stdioAsked)
				}
				if len(res.Phases) == 0 {
					t.Fatalf("restore %d: no phases", i)
				}
				if pid := <-pids; pid != res.Procs[0].PID {
					t.Fatalf("pipes hook got pid %d, the copy is %d", pid, res.Procs[0].PID)
				}
				if !dying(ck.Procs[0].PID) {
					t.Fatalf("old shell %d still alive", ck.Procs[0].PID)
				}
				s := <-sessions
				// Its own pipes on 0, 1 and 2 and no other descriptor of
				// them (it would never see its stdin end).
				fds := pipeFds(t, res.Procs[0].PID)
				if len(fds) != 3 || !strings.HasPrefix(fds[0], "0=") || fds[1][2:] != fds[2][2:] || fds[0][2:] == fds[1][2:] {
					t.Fatalf("restore %d: the copy's pipes: %v", i, fds)
				}
				if got := bashChat(t, s, `echo "$PWD $V $(f x)"; echo to-stderr >&2`); got != want+"\nto-stderr" {
					t.Fatalf("restore %d: restored shell: %q, want %q and stderr", i, got, want)
				}
				if prev.out != nil {
					// The previous copy was killed: its output ends.
					if l, err := prev.out.ReadString('\n'); err == nil {
						t.Fatalf("previous copy still prints %q", l)
					}
				}
				prev = s
			}
			spare := func() {
				if warm && !waitUntil(ctxT(t), 30*time.Second, func() bool { return e.SparesReady(sb.ID()) }) {
					t.Fatal("no warm spare")
				}
			}
			// Without a pipes hook for the process, Stdio is asked.
			spare()
			fresh, fsessions := freshStdio(t, sb)
			if _, err := e.Restore(ctxT(t), sb, "c1", RestoreOptions{Stdio: fresh, Pipes: func(Proc) func(int, *os.File, *os.File) error { return nil }}); err != nil {
				t.Fatal(err)
			}
			if got := bashChat(t, <-fsessions, `echo "$PWD $V $(f x)"`); got != want {
				t.Fatalf("restore with Stdio: %q, want %q", got, want)
			}

		})
	}
}

// A warm spare holds pipes of its own; a restore that asks for no stdio
// gives the copy /dev/null instead, as a forked copy has.
func TestWarmSpareWithoutStdio(t *testing.T) {
	sb := startSandbox(t, "python3", "-c", "import time\nwhile True: time.sleep(1000)")
	waitAsleep(t, sb)
	e := newEngine(t, Config{Warm: true, Logger: testLogger()})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctxT(t), 30*time.Second, func() bool { return e.SparesReady(sb.ID()) }) {
		t.Fatal("no warm spare")
	}
	sp := e.TemplatePIDs(sb.ID())
	var want unix.CPUSet // the sandbox's processes inherit the test's
	if err := unix.SchedGetaffinity(0, &want); err != nil {
		t.Fatal(err)
	}
	res, err := e.Restore(ctxT(t), sb, "c1", RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Procs) != 1 || !slices.Contains(sp, res.Procs[0].PID) {
		t.Fatalf("restore %+v did not take the spare (helpers were %v)", res, sp)
	}
	// The spare was pinned to the tracer's CPU while made ready; the copy
	// runs with the process's own affinity.
	var got unix.CPUSet
	if err := unix.SchedGetaffinity(res.Procs[0].PID, &got); err != nil || got != want {
		t.Fatalf("copy's CPU affinity %v (%v), want %v", got, err, want)
	}
	for fd := 0; fd < 3; fd++ {
		if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", res.Procs[0].PID, fd)); l != "/dev/null" {
			t.Fatalf("copy without stdio: fd %d is %q (%v)", fd, l, err)
		}
	}
}
