package cr

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

// TestQuiet: a process asleep in a read of a pipe or in nanosleep may be
// quiet (quietBefore); one that runs, one with several threads and one
// asleep in a write may not, and groupExiting sees each of them exit
// after SIGKILL. quietAfter holds while the process stays asleep and
// fails once it ran.
func TestQuiet(t *testing.T) {
	for _, tc := range []struct {
		name  string
		argv  []string
		quiet bool
	}{
		{"asleep in read", []string{"/bin/sh", "-c", "while read x; do :; done"}, true},
		{"asleep in nanosleep", []string{"/bin/sleep", "60"}, true},
		{"spinning", []string{"/bin/sh", "-c", "while :; do :; done"}, false},
		{"several threads", []string{"/usr/bin/python3", "-c", "import threading, time\nfor i in range(3): threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\ntime.sleep(60)"}, false},
		{"asleep in a write", []string{"/bin/sh", "-c", "exec /bin/sh -c 'while :; do echo x; done' | sleep 60"}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(tc.argv[0], tc.argv[1:]...)
			stdin, err := cmd.StdinPipe()
			if err != nil {
				t.Fatal(err)
			}
			defer stdin.Close()
			if err := cmd.Start(); err != nil {
				t.Fatal(err)
			}
			pid := cmd.Process.Pid
			defer cmd.Wait()
			defer cmd.Process.Kill()
			if tc.name == "asleep in a write" {
				// The writer is the pipeline's first process: a child.
				deadline := time.Now().Add(5 * time.Second)
				for time.Now().Before(deadline) {
					if kids, _ := children(pid); len(kids) == 2 {
						pid = kids[0]
						break
					}
					time.Sleep(10 * time.Millisecond)
				}
			}
			// Let it settle where it sleeps (or spins).
			time.Sleep(200 * time.Millisecond)
			q, maybe := quietBefore(pid)
			pidfd, err := unix.PidfdOpen(pid, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(pidfd)
			if maybe != tc.quiet {
				t.Fatalf("quietBefore = %v, want %v", maybe, tc.quiet)
			}
			if maybe {
				if !quietAfter(q, pidfd) {
					t.Fatal("quietAfter false for a process left asleep")
				}
				if tc.name == "asleep in read" {
					// Woken by a line, it runs and sleeps again. The
					// line leaving the pipe proves it ran (a loaded
					// machine may take a while to give it a CPU).
					if _, err := stdin.Write([]byte("line\n")); err != nil {
						t.Fatal(err)
					}
					unread := func() int {
						// FIONREAD (TIOCINQ) works on either end of a pipe.
						n, err := unix.IoctlGetInt(int(stdin.(interface{ Fd() uintptr }).Fd()), unix.TIOCINQ)
						if err != nil {
							t.Fatalf("FIONREAD: %v", err)
						}
						return n
					}
					deadline := time.Now().Add(30 * time.Second)
					for unread() > 0 && time.Now().Before(deadline) {
						time.Sleep(time.Millisecond)
					}
					for quietAfter(q, pidfd) && time.Now().Before(deadline) {
						time.Sleep(time.Millisecond)
					}
					if quietAfter(q, pidfd) {
						n, _ := schedCount(pid)
						t.Fatalf("quietAfter true for a process that ran (%d bytes left unread; run count %d, %d at the probe)", unread(), n, q.pcount)
					}
				}
			}
			if err := unix.Kill(pid, unix.SIGKILL); err != nil {
				t.Fatal(err)
			}
			if !waitUntil(ctxT(t), 5*time.Second, func() bool { return groupExiting(pid) }) {
				t.Fatal("not exiting 5 s after SIGKILL")
			}
		})
	}
}

// dying reports whether pid, killed by a restore, starts exiting within
// seconds: a restore returns once the processes it killed are exiting,
// or asleep with SIGKILL pending (quiet: see quietBefore), which they
// reach when they next get a CPU.
func dying(pid int) bool {
	deadline := time.Now().Add(10 * time.Second)
	for !exiting(pid) {
		if time.Now().After(deadline) {
			return false
		}
		time.Sleep(time.Millisecond)
	}
	return true
}

// membersTarget is a Target whose processes are the listed pids.
type membersTarget struct {
	id   string
	pids []int
}

func (m membersTarget) ID() string                 { return m.id }
func (m membersTarget) InitPID() int               { return 1 }
func (m membersTarget) MemberPIDs() ([]int, error) { return m.pids, nil }

// TestSignalLiveStopsQuiet: signalLive stops a process asleep in a read
// (quiet) instead of killing it, at SCHED_IDLE; woken afterwards by input,
// it runs none of its own code (the line it would act on is never acted
// on), and finish kills it. A spinning process is killed at once and
// waited for. A reader that the machine gives no CPU to reach its stop
// before the check is killed and waited for instead (correct, but not the
// path under test): the test checks that it never ran and tries again.
func TestSignalLiveStopsQuiet(t *testing.T) {
	testenv.RequireRoot(t)
	e := newEngine(t, Config{})
	spin := exec.Command("/bin/sh", "-c", "while :; do :; done")
	if err := spin.Start(); err != nil {
		t.Fatal(err)
	}
	defer spin.Wait()
	defer spin.Process.Kill()
	spid := spin.Process.Pid
	ks := e.signalLive(membersTarget{id: "signal-live-spin", pids: []int{spid}}, nil)
	if len(ks.wait) != 1 || ks.wait[0] != spid || len(ks.quiet) != 0 {
		t.Fatalf("wait %v, quiet %v: want the spinner (%d) waited for", ks.wait, ks.quiet, spid)
	}
	if !waitUntil(ctxT(t), 5*time.Second, func() bool { return groupExiting(spid) }) {
		t.Fatal("spinner not exiting 5 s after signalLive")
	}
	for try := 1; ; try++ {
		if stopQuietReader(t, e) {
			return
		}
		if try == 5 {
			t.Fatal("the reader never reached its stop before signalLive's check in 5 tries")
		}
	}
}

// stopQuietReader runs TestSignalLiveStopsQuiet's reader once; false when
// signalLive found it on its way to the stop (and killed it).
func stopQuietReader(t *testing.T, e *Engine) bool {
	t.Helper()
	mark := filepath.Join(t.TempDir(), "ran")
	quiet := exec.Command("/bin/sh", "-c", "read x; echo ran > "+mark)
	stdin, err := quiet.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	defer stdin.Close()
	if err := quiet.Start(); err != nil {
		t.Fatal(err)
	}
	defer quiet.Wait()
	defer quiet.Process.Kill()
	qpid := quiet.Process.Pid
	// The reader must be asleep in its read before the signal (on a
	// loaded machine a fixed pause was not always enough).
	if !waitUntil(ctxT(t), 5*time.Second, func() bool { _, ok := quietBefore(qpid); return ok }) {
		t.Fatal("reader not asleep in its read 5 s after it started")
	}
	ks := e.signalLive(membersTarget{id: "signal-live", pids: []int{qpid}}, nil)
	if len(ks.wait) == 1 && ks.wait[0] == qpid && len(ks.quiet) == 0 {
		if !waitUntil(ctxT(t), 5*time.Second, func() bool { return groupExiting(qpid) }) {
			t.Fatal("reader found running not exiting 5 s after signalLive")
		}
		stdin.Write([]byte("go\n"))
		time.Sleep(50 * time.Millisecond)
		if _, err := os.Stat(mark); err == nil {
			t.Fatal("the killed reader ran its own code")
		}
		t.Log("the reader was on its way to the stop: killed; again")
		return false
	}
	if len(ks.quiet) != 1 || ks.quiet[0].pid != qpid || len(ks.stopped) != 1 || len(ks.wait) != 0 {
		t.Fatalf("quiet %v, stopped %v, wait %v: want the reader (%d) quiet", ks.quiet, ks.stopped, ks.wait, qpid)
	}
	if a, err := unix.SchedGetAttr(qpid, 0); err != nil || a.Policy != unix.SCHED_IDLE {
		t.Fatalf("reader's policy %+v (%v), want SCHED_IDLE", a, err)
	}
	// Woken by a line, it must stop before it acts on it.
	if _, err := stdin.Write([]byte("go\n")); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctxT(t), 5*time.Second, func() bool { st, err := readStat(qpid); return err == nil && st.state == "T" }) {
		t.Fatal("reader not stopped 5 s after signalLive")
	}
	time.Sleep(100 * time.Millisecond)
	if _, err := os.Stat(mark); err == nil {
		t.Fatal("the stopped reader ran its own code")
	}
	if exiting(qpid) {
		t.Fatal("reader exiting before finish")
	}
	ks.finish()
	ks.finish() // a second call is harmless
	if !waitUntil(ctxT(t), 5*time.Second, func() bool { return groupExiting(qpid) }) {
		t.Fatal("reader not exiting 5 s after finish")
	}
	if _, err := os.Stat(mark); err == nil {
		t.Fatal("the killed reader ran its own code")
	}
	return true
}
