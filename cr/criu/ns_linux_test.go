package criu

import (
	"os"
	"os/exec"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// newPIDNS starts a process in a new PID namespace and returns that
// namespace's init (host pid) and a reader of its counter.
func newPIDNS(t *testing.T) (int, func() int) {
	t.Helper()
	testenv.RequireRoot(t)
	target := exec.Command("unshare", "--pid", "--fork", "sleep", "60")
	if err := target.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = target.Process.Kill(); _ = target.Wait() })
	var nsInit int
	deadline := time.Now().Add(10 * time.Second)
	for nsInit == 0 && time.Now().Before(deadline) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(target.Process.Pid) + "/task/" + strconv.Itoa(target.Process.Pid) + "/children")
		nsInit, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		time.Sleep(5 * time.Millisecond)
	}
	if nsInit == 0 {
		t.Fatal("no namespace init")
	}
	lastPID := func() int {
		t.Helper()
		out, err := exec.Command("nsenter", "-t", strconv.Itoa(nsInit), "-p", "--", "cat", "/proc/sys/kernel/ns_last_pid").Output()
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(out)))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	return nsInit, lastPID
}

// TestRaiseLastPID: a new PID namespace's counter goes to the upper half of
// pid_max, and stays where it is on a second call.
func TestRaiseLastPID(t *testing.T) {
	nsInit, lastPID := newPIDNS(t)
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	pidMax, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if l := lastPID(); l >= pidMax/2 {
		t.Fatalf("a new namespace's counter is %d already", l)
	}
	if err := RaiseLastPID(nsInit); err != nil {
		t.Fatal(err)
	}
	first := lastPID()
	if first < pidMax/2 || first >= pidMax*3/4+1 {
		t.Fatalf("counter %d, want within [%d, %d]", first, pidMax/2, pidMax*3/4)
	}
	if err := RaiseLastPID(nsInit); err != nil {
		t.Fatal(err)
	}
	// The second call's shell takes a pid, and so does the test's read.
	if got := lastPID(); got != first+2 {
		t.Fatalf("counter %d after a second call, want %d (moved only by its shell and the test's read)", got, first+2)
	}
}

// TestRaiseLastPIDTo: the counter moves up to the value asked, and never
// back.
func TestRaiseLastPIDTo(t *testing.T) {
	nsInit, lastPID := newPIDNS(t)
	if l := lastPID(); l >= 500 {
		t.Fatalf("a new namespace's counter is %d already", l)
	}
	if err := RaiseLastPIDTo(nsInit, 500); err != nil {
		t.Fatal(err)
	}
	// The call's own shell took a pid before the write, the test's read
	// takes the next.
	if got := lastPID(); got != 501 {
		t.Fatalf("counter %d after raising to 500, want 501 (the test's read)", got)
	}
	if err := RaiseLastPIDTo(nsInit, 100); err != nil {
		t.Fatal(err)
	}
	if got := lastPID(); got != 503 {
		t.Fatalf("counter %d after a lower raise, want 503 (moved only by the call's shell and the test's read)", got)
	}
}

// TestStartInLeavesMainThread: entering another process's namespaces to
// start a program never leaves the process's main thread in them (it
// would stay there, parked, and /proc/PID/ns would show them). It failed
// in about one run of two before lockNonMainThread, when a run of
// TestCommandUsesHostLoader preceded TestSwrkStartsInNamespacesAndCancels.
func TestStartInLeavesMainThread(t *testing.T) {
	testenv.RequireRoot(t)
	own := func() string {
		l, err := os.Readlink("/proc/" + strconv.Itoa(os.Getpid()) + "/ns/mnt")
		if err != nil {
			t.Fatal(err)
		}
		return l
	}
	before := own()
	target := exec.Command("unshare", "--mount", "--propagation", "private", "--fork", "sleep", "60")
	if err := target.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = target.Process.Kill(); _ = target.Wait() })
	var inner int
	waitFor := time.Now().Add(10 * time.Second)
	for inner == 0 {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(target.Process.Pid) + "/task/" + strconv.Itoa(target.Process.Pid) + "/children")
		inner, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		if inner == 0 && time.Now().After(waitFor) {
			t.Fatal("unshare started no child")
		}
		time.Sleep(time.Millisecond)
	}
	for i := 0; i < 50; i++ {
		cmd := exec.Command("/bin/true")
		if err := startIn(inner, []nsKind{{"mnt", unix.CLONE_NEWNS}}, cmd); err != nil {
			t.Fatal(err)
		}
		if err := cmd.Wait(); err != nil {
			t.Fatal(err)
		}
		if got := own(); got != before {
			t.Fatalf("start %d: the process's mount namespace is %s now, was %s", i, got, before)
		}
	}
}
