package inject

import (
	"unsafe"

	"golang.org/x/sys/unix"
)

func ptraceRegs(req int, pid int, r *unix.PtraceRegs) error {
	_, _, e := unix.RawSyscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), 0, uintptr(unsafe.Pointer(r)), 0, 0)
	if e != 0 {
		return e
	}
	return nil
}
