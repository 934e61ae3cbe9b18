package cr

import "golang.org/x/sys/unix"

// quietCalls are the system calls a process may sleep in and still be
// quiet (see quietBefore): waking from them with SIGKILL pending, it
// returns without changing any file. Reads are among them: a read changes
// no file, wherever it reads from.
var quietCalls = map[int]bool{
	unix.SYS_READ: true, unix.SYS_READV: true, unix.SYS_PREAD64: true, unix.SYS_PREADV: true, unix.SYS_PREADV2: true,
	unix.SYS_RECVFROM: true, unix.SYS_RECVMSG: true, unix.SYS_RECVMMSG: true,
	unix.SYS_ACCEPT: true, unix.SYS_ACCEPT4: true,
	unix.SYS_WAIT4: true, unix.SYS_WAITID: true,
	unix.SYS_NANOSLEEP: true, unix.SYS_CLOCK_NANOSLEEP: true, unix.SYS_PAUSE: true,
	unix.SYS_SELECT: true, unix.SYS_PSELECT6: true, unix.SYS_POLL: true, unix.SYS_PPOLL: true,
	unix.SYS_EPOLL_WAIT: true, unix.SYS_EPOLL_PWAIT: true, unix.SYS_EPOLL_PWAIT2: true,
	unix.SYS_RT_SIGSUSPEND: true, unix.SYS_RT_SIGTIMEDWAIT: true, unix.SYS_FUTEX: true,
}
