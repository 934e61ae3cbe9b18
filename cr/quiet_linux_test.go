package cr

import (
	"os/exec"
	"testing"
	"time"

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
					// Woken by a line, it runs and sleeps again.
					if _, err := stdin.Write([]byte("line\n")); err != nil {
						t.Fatal(err)
					}
					deadline := time.Now().Add(5 * time.Second)
					for quietAfter(q, pidfd) && time.Now().Before(deadline) {
						time.Sleep(time.Millisecond)
					}
					if quietAfter(q, pidfd) {
						t.Fatal("quietAfter true for a process that ran")
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
