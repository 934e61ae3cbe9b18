package sandbox

import (
	"os"
	"os/exec"
	"regexp"
	"runtime"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"

	"golang.org/x/sys/unix"
)

// dirtySignalsEnv makes the test binary restart itself with signal 32
// ignored and SIGUSR1 blocked ("1"), and marks the restarted binary ("2").
const dirtySignalsEnv = "REWIND_TEST_DIRTY_SIGNALS"

// dirtySignals is the state a daemon may inherit from its environment:
// signal 32 (glibc's SIGCANCEL, which the Go runtime never handles without
// cgo) ignored, SIGUSR1 blocked.
const (
	dirtyIgnored = 32
	dirtyBlocked = unix.SIGUSR1
)

// maybeDirtySignals re-executes the test binary with the dirty signal state
// when asked to by TestInheritedSignalState (exec keeps ignored
// dispositions and the mask).
func maybeDirtySignals() {
	if os.Getenv(dirtySignalsEnv) != "1" {
		return
	}
	runtime.LockOSThread()
	act := [4]uintptr{1} // SIG_IGN
	if _, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, dirtyIgnored, uintptr(unsafe.Pointer(&act)), 0, 8, 0, 0); e != 0 {
		panic(e)
	}
	var set unix.Sigset_t
	set.Val[0] = 1 << (dirtyBlocked - 1)
	if err := unix.PthreadSigmask(unix.SIG_BLOCK, &set, nil); err != nil {
		panic(err)
	}
	env := []string{dirtySignalsEnv + "=2"}
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, dirtySignalsEnv+"=") {
			env = append(env, kv)
		}
	}
	panic(syscall.Exec("/proc/self/exe", os.Args, env))
}

// statusMask returns a hex mask line (SigIgn, SigBlk) of /proc/self/status.
func statusMask(t *testing.T, name string) uint64 {
	t.Helper()
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(l, name+":"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			if err != nil {
				t.Fatal(err)
			}
			return m
		}
	}
	t.Fatalf("no %s in /proc/self/status", name)
	return 0
}

// TestInheritedSignalState runs the test binary again with an ignored and a
// blocked signal inherited from its parent and checks that the sandbox
// processes it starts have empty SigIgn and SigBlk all the same.
func TestInheritedSignalState(t *testing.T) {
	requireSandbox(t)
	if os.Getenv(dirtySignalsEnv) == "2" {
		// The restarted binary: the daemon really has the dirty state...
		if statusMask(t, "SigIgn")&(1<<(dirtyIgnored-1)) == 0 {
			t.Fatal("signal 32 not ignored in the restarted test binary")
		}
		if statusMask(t, "SigBlk")&(1<<(dirtyBlocked-1)) == 0 {
			t.Fatal("SIGUSR1 not blocked in the restarted test binary")
		}
		// ...and its sandbox processes do not.
		for _, tty := range []bool{false, true} {
			sb := startTest(t, nil)
			if tty {
				sess, err := sb.StartSession(testCtx(t), SessionConfig{ID: "s", Argv: []string{"/bin/sh"}, TTY: true})
				if err != nil {
					t.Fatal(err)
				}
				masks := regexp.MustCompile(`([0-9a-f]{16}:)+END`)
				out, err := sess.Send(testCtx(t), "grep -E 'SigIgn|SigBlk' /proc/self/status | cut -f2 | sort -u | tr '\\n' :; echo END", SendOptions{Until: masks})
				if err != nil {
					t.Fatal(err)
				}
				if got := masks.FindString(out); got != "0000000000000000:END" {
					t.Fatalf("tty session process starts with ignored or blocked signals: %q", out)
				}
				continue
			}
			if out := sh(t, sb, "grep -E 'SigIgn|SigBlk' /proc/self/status | cut -f2 | sort -u"); out != "0000000000000000\n" {
				t.Fatalf("sandbox process starts with ignored or blocked signals: %q", out)
			}
		}
		return
	}
	cmd := exec.Command("/proc/self/exe", "-test.run=^TestInheritedSignalState$", "-test.count=1", "-test.v")
	cmd.Env = append(os.Environ(), dirtySignalsEnv+"=1")
	out, err := cmd.CombinedOutput()
	if err != nil || !strings.Contains(string(out), "--- PASS: TestInheritedSignalState") {
		t.Fatalf("test binary with inherited signal state: %v\n%s", err, out)
	}
}
