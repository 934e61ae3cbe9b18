package cr

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

// pin is a process's CPU affinity changed for the time it is injected.
type pin struct {
	pid  int
	orig unix.CPUSet
	ok   bool
}

// pinHere moves pid onto the CPU the calling thread runs on, so the
// ptrace round trips of an injection (tracer and tracee waking each other
// once per injected call) stay on one CPU: a wakeup across CPUs costs an
// inter-processor interrupt, tens of microseconds in a VM. undo puts the
// process's own affinity back.
func pinHere(pid int) *pin {
	var cpu uint32
	if _, _, e := unix.RawSyscall(unix.SYS_GETCPU, uintptr(unsafe.Pointer(&cpu)), 0, 0); e != 0 {
		return nil
	}
	p := &pin{pid: pid}
	if unix.SchedGetaffinity(pid, &p.orig) != nil || !p.orig.IsSet(int(cpu)) {
		return nil // not allowed there: leave it alone
	}
	var one unix.CPUSet
	one.Set(int(cpu))
	if unix.SchedSetaffinity(pid, &one) != nil {
		return nil
	}
	p.ok = true
	return p
}

// undo restores the affinity pinHere changed.
func (p *pin) undo() {
	if p != nil && p.ok {
		_ = unix.SchedSetaffinity(p.pid, &p.orig)
	}
}
