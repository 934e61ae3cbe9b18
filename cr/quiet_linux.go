package cr

import (
	"bytes"
	"os"
	"strconv"
	"strings"

	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// A killed process must not change the sandbox's file system once a
// restore switches it: the kill waits until every thread of it has begun
// to exit (groupExiting), so that no system call of it is still running.
// That wait is a wait for the scheduler: a process woken by SIGKILL must
// get a CPU to reach its exit, 0.05-0.3 ms on an idle 2-core machine and
// milliseconds when the machine is loaded.
//
// A process that was asleep in a system call that cannot change a file
// when the signal arrived, and has not run since, needs no such wait: all
// it will ever do is return from that call with an error and exit. quiet
// takes that proof in two halves around the signal: before it (quietBefore)
// the process is single-threaded and asleep, /proc/PID/syscall names the
// call it sleeps in (the kernel reads it only while the task is off CPU,
// and says "running" otherwise), and /proc/PID/schedstat gives how many
// times it was put on a CPU; after it (quietAfter) that count is
// unchanged, so the process stayed asleep in that call from before the
// first read until after the signal. Anything else (several threads, a
// call outside quietCalls, a page fault: no call at all) is waited for.
//
// What a quiet process's exit still writes back (dirty pages of a shared
// file mapping) is flushed by the restore's SwitchFS, as for any process.

// quietProbe is what quietBefore found of one process.
type quietProbe struct {
	pid    int
	start  uint64 // start time, so that a reused pid is never taken for it
	pcount uint64 // times put on a CPU (schedstat's third field)
}

// quietBefore probes pid before it is signalled; ok is false unless the
// process may turn out quiet.
func quietBefore(pid int) (quietProbe, bool) {
	st, err := readStat(pid)
	if err != nil || st.threads != 1 || st.state != "S" {
		return quietProbe{}, false
	}
	n, err := schedCount(pid)
	if err != nil {
		return quietProbe{}, false
	}
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "syscall"))
	if err != nil {
		return quietProbe{}, false
	}
	f := bytes.Fields(b)
	if len(f) == 0 {
		return quietProbe{}, false
	}
	nr, err := strconv.Atoi(string(f[0])) // "running", or -1 outside a call
	if err != nil || !quietCalls[nr] {
		return quietProbe{}, false
	}
	return quietProbe{pid: pid, start: st.start, pcount: n}, true
}

// quietAfter reports whether the process probed did not run since the
// probe; pidfd refers to it (opened after the probe, with the start time
// unchanged since, or the count differs): while it has not exited, its
// pid names it, and a process that exited ran.
func quietAfter(q quietProbe, pidfd int) bool {
	pfd := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	if n, err := unix.Poll(pfd, 0); err != nil || n > 0 {
		return false // exited (it ran), or not known: the kill waits
	}
	n, err := schedCount(q.pid)
	return err == nil && n == q.pcount
}

// same reports whether pid is still the process q was taken of (a
// listing leaves a quiet process out: it has nothing left to do but exit).
func (q quietProbe) same(pid int) bool {
	st, err := readStat(pid)
	return err == nil && st.start == q.start
}

// statFields is what quietBefore reads of /proc/PID/stat.
type statFields struct {
	state   string
	threads int
	start   uint64
}

func readStat(pid int) (statFields, error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "stat"))
	if err != nil {
		return statFields{}, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return statFields{}, os.ErrInvalid
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return statFields{}, os.ErrInvalid
	}
	var s statFields
	s.state = f[0]
	if s.threads, err = strconv.Atoi(f[17]); err != nil {
		return statFields{}, err
	}
	if s.start, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return statFields{}, err
	}
	return s, nil
}

// schedCount returns how many times pid was put on a CPU.
func schedCount(pid int) (uint64, error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "schedstat"))
	if err != nil {
		return 0, err
	}
	f := bytes.Fields(b)
	if len(f) < 3 {
		return 0, os.ErrInvalid
	}
	return strconv.ParseUint(string(f[2]), 10, 64)
}

// stoppedSince reports whether the process probed (pidfd refers to it, as
// for quietAfter) is the one probed and is now in a stop: single-threaded
// (as the probe found it: a new thread would have had to run code), it
// runs nothing until it is continued or killed.
func stoppedSince(q quietProbe, pidfd int) bool {
	pfd := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
	if n, err := unix.Poll(pfd, 0); err != nil || n > 0 {
		return false
	}
	st, err := readStat(q.pid)
	return err == nil && st.start == q.start && st.threads == 1 && st.state == "T"
}
