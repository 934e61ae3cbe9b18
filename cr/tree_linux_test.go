package cr

import (
	"os"
	"os/exec"
	"strconv"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestGroupStopped: a multi-threaded process is group-stopped only once
// every thread is, and a process that is gone counts as stopped.
func TestGroupStopped(t *testing.T) {
	py, err := exec.LookPath("python3")
	testenv.Require(t, err == nil, "python3")
	cmd := exec.Command(py, "-c", "import threading, time\nfor i in range(3):\n    threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\nprint('up', flush=True)\ntime.sleep(100)\n")
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	defer cmd.Process.Kill()
	buf := make([]byte, 3)
	if _, err := out.Read(buf); err != nil {
		t.Fatal(err)
	}
	if groupStopped(pid) {
		t.Fatal("a running process counts as stopped")
	}
	if err := syscall.Kill(pid, syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for !groupStopped(pid) {
		if time.Now().After(deadline) {
			t.Fatal("the stopped process never counts as stopped")
		}
		time.Sleep(time.Millisecond)
	}
	for _, tid := range threadIDs(t, pid) {
		if st, err := procState(tid); err != nil || st != 'T' {
			t.Errorf("thread %d: state %c (%v) once the group counts as stopped", tid, st, err)
		}
	}
	if n := len(threadIDs(t, pid)); n < 4 {
		t.Fatalf("%d threads, want 4", n)
	}
	syscall.Kill(pid, syscall.SIGCONT)
	if groupStopped(pid) {
		// SIGCONT is asynchronous, but the threads sleep in the kernel
		// right after it: wait for that.
		deadline = time.Now().Add(5 * time.Second)
		for groupStopped(pid) && time.Now().Before(deadline) {
			time.Sleep(time.Millisecond)
		}
		if groupStopped(pid) {
			t.Fatal("a continued process still counts as stopped")
		}
	}
	cmd.Process.Kill()
	cmd.Wait()
	if !groupStopped(pid) {
		t.Fatal("a process that is gone does not count as stopped")
	}
}

func threadIDs(t *testing.T, pid int) []int {
	t.Helper()
	ents, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		t.Fatal(err)
	}
	var tids []int
	for _, e := range ents {
		if tid, err := strconv.Atoi(e.Name()); err == nil {
			tids = append(tids, tid)
		}
	}
	return tids
}
