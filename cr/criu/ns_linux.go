package criu

import (
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"runtime"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// nsKind is a namespace a thread can enter.
type nsKind struct {
	name string
	flag int
}

// sandboxNS are the namespaces criu runs in: all of a sandbox's but the
// user one, so criu sees nothing foreign to dump. mnt is last: /proc is
// the sandbox's after it.
var sandboxNS = []nsKind{
	{"ipc", unix.CLONE_NEWIPC}, {"uts", unix.CLONE_NEWUTS}, {"net", unix.CLONE_NEWNET},
	{"pid", unix.CLONE_NEWPID}, {"mnt", unix.CLONE_NEWNS},
}

// startInNamespaces starts cmd from a new OS thread that entered nsPID's
// IPC, UTS, network, PID and mount namespaces (the child is born in them),
// or from the caller's when nsPID is 0.
func startInNamespaces(nsPID int, cmd *exec.Cmd) error {
	if nsPID == 0 {
		return cmd.Start()
	}
	return startIn(nsPID, sandboxNS, cmd)
}

// startIn starts cmd from a new OS thread that entered the namespaces
// kinds of nsPID. The thread is never given back: it ends with its
// goroutine (the runtime starts no thread from it). It is never the
// process's main thread: that one does not end with a goroutine locked
// to it, it stays (parked) in the namespaces it entered, and
// /proc/PID/ns shows the main thread's: the next startIn into the
// process's own namespaces would have entered those (a sandbox's, even
// after the sandbox is gone, whose mounts it would keep).
func startIn(nsPID int, kinds []nsKind, cmd *exec.Cmd) error {
	var nsfd []int
	defer func() {
		for _, fd := range nsfd {
			unix.Close(fd)
		}
	}()
	for _, k := range kinds {
		fd, err := unix.Open("/proc/"+strconv.Itoa(nsPID)+"/ns/"+k.name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("namespace %s of %d: %w", k.name, nsPID, err)
		}
		nsfd = append(nsfd, fd)
	}
	errc := make(chan error, 1)
	go func() {
		if err := lockNonMainThread(); err != nil {
			errc <- err
			return
		}
		// Never unlocked: see above.
		errc <- func() error {
			// setns into a mount namespace needs a thread of its own
			// file-system context (root, cwd), not the process's.
			if err := unix.Unshare(unix.CLONE_FS); err != nil {
				return fmt.Errorf("unshare fs: %w", err)
			}
			for i, k := range kinds {
				if err := unix.Setns(nsfd[i], k.flag); err != nil {
					return fmt.Errorf("enter namespace %s of %d: %w", k.name, nsPID, err)
				}
			}
			return cmd.Start()
		}()
	}()
	return <-errc
}

// lockNonMainThread locks the calling goroutine to an OS thread other
// than the process's main one, which it leaves as it found it.
func lockNonMainThread() error {
	for i := 0; i < 1000; i++ {
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			return nil
		}
		runtime.UnlockOSThread()
		// Let the scheduler put this goroutine on another thread.
		runtime.Gosched()
		if i > 10 {
			time.Sleep(10 * time.Microsecond)
		}
	}
	return fmt.Errorf("no thread but the main one to enter namespaces from")
}

// RaiseLastPID moves the next pid of nsInit's PID namespace to a random
// value in the upper half of pid_max, unless it is there already. It never
// moves the counter back: pids are then handed out in increasing order, so
// a pid an image holds is not given to a later process of the sandbox (a
// later template, spare or server), which would make the image
// unrestorable there. One shell in the namespace does it (see raiseIn).
func RaiseLastPID(nsInit int) error {
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		return err
	}
	pidMax, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil || pidMax < 1024 {
		return fmt.Errorf("pid_max %q", b)
	}
	low := pidMax / 2
	return raiseIn(nsInit, low, low+rand.IntN(pidMax/4))
}

// RaiseLastPIDTo moves the next pid of nsInit's PID namespace to min
// unless it is there or above already (it never moves the counter back).
// A restore into a sandbox just started (a fork child, a sandbox started
// again after a restart) calls it: criu itself, which runs in the
// sandbox's PID namespace, would take the first free pids, which are the
// image's; with the counter at the image's highest pid, criu gets one
// above them all. One shell in the namespace (see raiseIn).
func RaiseLastPIDTo(nsInit, min int) error {
	return raiseIn(nsInit, min, min)
}

// raiseIn sets the counter of nsInit's PID namespace to to when it is
// below below. ns_last_pid is that of the PID namespace of the process
// that reads or writes it, so a process started in that namespace does
// it: the host's shell (dash, on the host's /proc; only the PID namespace
// is entered). The shell does not read the counter: its own pid ($$, a
// pid of that namespace) is the counter as its birth left it, which is
// what a read would have said. One shell and its builtins: reading the
// file took a cat and a subshell besides (a shell's read builtin reads a
// byte at a time, and a sysctl file answers a read past its start with
// end of file), three process starts where exec is the cost, some 12 ms
// of CPU each for a fork child on this kind of VM.
func raiseIn(nsInit, below, to int) error {
	const f = "/proc/sys/kernel/ns_last_pid"
	cmd := exec.Command("/bin/sh", "-c", fmt.Sprintf(`if [ $$ -lt %d ]; then echo %d >%s; fi`, below, to, f))
	var errb strings.Builder
	cmd.Stderr = &errb
	if err := startIn(nsInit, []nsKind{{"pid", unix.CLONE_NEWPID}}, cmd); err != nil {
		return err
	}
	if err := cmd.Wait(); err != nil {
		return fmt.Errorf("raise ns_last_pid to %d: %v: %s", to, err, errb.String())
	}
	return nil
}
