package inject

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"

	"golang.org/x/sys/unix"
)

// ReadMem reads len(b) bytes of the stopped process at addr into b.
func (p *Proc) ReadMem(addr uint64, b []byte) error {
	local := []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}
	n, err := unix.ProcessVMReadv(p.pid, local, remote, 0)
	if err != nil {
		return fmt.Errorf("read memory of %d: %w", p.pid, err)
	}
	if n != len(b) {
		return fmt.Errorf("read memory of %d: short read %d/%d", p.pid, n, len(b))
	}
	return nil
}

// stdioPipes gives the stopped process two new pipes, one as its stdin and
// one as its stdout and stderr, and returns their other ends in the caller:
// w writes the process's stdin, r reads what it prints. The pipes are made
// inside the process (injected pipe2) and their far ends taken over with
// pidfd_getfd, so no path has to be reachable from the process's mount
// namespace. Both files are non-blocking (deadlines work on them). The
// process keeps the pipes' original descriptors as well, so it never sees
// an EOF on its stdin: end it with a kill.
func (p *Proc) stdioPipes() (w, r *os.File, err error) {
	addr := p.ScratchAddr()
	var fds [4]int // stdin read, stdin write, output read, output write
	for i := 0; i < 2; i++ {
		if _, err := p.rawSyscall(unix.SYS_PIPE2, uintptr(addr+uint64(8*i)), unix.O_CLOEXEC); err != nil {
			return nil, nil, fmt.Errorf("pipes of %d: %w", p.pid, err)
		}
	}
	var buf [16]byte
	if err := p.ReadMem(addr, buf[:]); err != nil {
		return nil, nil, err
	}
	for i := range fds {
		fds[i] = int(int32(binary.LittleEndian.Uint32(buf[4*i:])))
	}
	closeRemote := func() {
		for _, fd := range fds {
			if fd > 2 {
				_, _ = p.rawSyscall(unix.SYS_CLOSE, uintptr(fd))
			}
		}
	}
	for _, fd := range fds {
		if fd <= 2 {
			// A pipe landed on a standard descriptor: the process had
			// closed it, and the dup2 sequence below would clobber it.
			closeRemote()
			return nil, nil, fmt.Errorf("pipes of %d: descriptor %d was free (closed stdio)", p.pid, fd)
		}
	}
	pidfd, err := unix.PidfdOpen(p.pid, 0)
	if err != nil {
		closeRemote()
		return nil, nil, fmt.Errorf("pidfd of %d: %w", p.pid, err)
	}
	defer unix.Close(pidfd)
	take := func(fd int, name string) (*os.File, error) {
		lfd, err := unix.PidfdGetfd(pidfd, fd, 0)
		if err != nil {
			return nil, fmt.Errorf("take fd %d of %d: %w", fd, p.pid, err)
		}
		if err := unix.SetNonblock(lfd, true); err != nil {
			unix.Close(lfd)
			return nil, fmt.Errorf("take fd %d of %d: %w", fd, p.pid, err)
		}
		return os.NewFile(uintptr(lfd), name), nil
	}
	if w, err = take(fds[1], fmt.Sprintf("stdin of %d", p.pid)); err != nil {
		closeRemote()
		return nil, nil, err
	}
	if r, err = take(fds[2], fmt.Sprintf("output of %d", p.pid)); err != nil {
		closeRemote()
		return w, nil, err
	}
	for _, d := range [][2]int{{fds[0], 0}, {fds[3], 1}, {fds[3], 2}} {
		if _, err := p.rawSyscall(unix.SYS_DUP2, uintptr(d[0]), uintptr(d[1])); err != nil {
			closeRemote()
			return w, r, fmt.Errorf("stdio %d of %d: dup2: %w", d[1], p.pid, err)
		}
	}
	// The pipes' first descriptors stay open in the process (four fewer
	// injected calls): they are close-on-exec, and a copy asked something
	// is killed, never left to wait for an EOF.
	return w, r, nil
}

// KillTracee SIGKILLs pid, a process the tracer traces without a Proc for
// it (a child auto-attached when a continued tracee forked), and collects
// its exit in the background.
func (t *Tracer) KillTracee(pid int) error {
	return t.Do(func() error {
		if err := unix.Kill(pid, unix.SIGKILL); err != nil && err != unix.ESRCH {
			return fmt.Errorf("kill %d: %w", pid, err)
		}
		if !reaped(pid) {
			t.dying[pid] = true
		}
		return nil
	})
}

// confine installs the classic BPF program prog as a seccomp filter of the
// stopped process (after PR_SET_NO_NEW_PRIVS, so it needs no privilege).
// The filter also applies to calls injected afterwards: install it last.
func (p *Proc) confine(prog []unix.SockFilter) error {
	if len(prog) == 0 || len(prog)*8+16 > 4096 {
		return fmt.Errorf("seccomp filter of %d: %d instructions", p.pid, len(prog))
	}
	buf := make([]byte, 16+8*len(prog))
	addr := p.ScratchAddr()
	binary.LittleEndian.PutUint16(buf[0:], uint16(len(prog)))
	binary.LittleEndian.PutUint64(buf[8:], addr+16)
	for i, in := range prog {
		o := 16 + 8*i
		binary.LittleEndian.PutUint16(buf[o:], in.Code)
		buf[o+2], buf[o+3] = in.Jt, in.Jf
		binary.LittleEndian.PutUint32(buf[o+4:], in.K)
	}
	if err := p.WriteMem(addr, buf); err != nil {
		return err
	}
	if _, err := p.rawSyscall(unix.SYS_PRCTL, unix.PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0); err != nil {
		return fmt.Errorf("no_new_privs in %d: %w", p.pid, err)
	}
	if _, err := p.rawSyscall(unix.SYS_SECCOMP, unix.SECCOMP_SET_MODE_FILTER, 0, uintptr(addr)); err != nil {
		return fmt.Errorf("seccomp filter in %d: %w", p.pid, err)
	}
	return nil
}

// RunConfined readies a stopped copy that is to be asked something and
// lets it run, all in one request of the tracer thread: it makes the copy
// lead its own session (as Setsid), gives it fresh pipes as stdin and as
// stdout+stderr (see stdioPipes), installs the seccomp filter prog (see
// confine) and resumes it from its saved registers while it stays traced:
// a fork it makes stops the new child (PTRACE_O_TRACEFORK) and is never
// resumed, a signal it receives stops it until Kill, and it dies with the
// tracer (PTRACE_O_EXITKILL). It returns the far ends of the pipes: w
// writes the copy's stdin, r reads its output. End the copy with Kill.
func (p *Proc) RunConfined(prog []unix.SockFilter) (w, r *os.File, err error) {
	err = p.t.Do(func() error {
		if p.gone {
			return fmt.Errorf("process %d is gone", p.pid)
		}
		if _, e := p.rawSyscall(unix.SYS_SETSID); e != nil && !errors.Is(e, unix.EPERM) {
			_ = p.restoreRegs()
			return fmt.Errorf("setsid in %d: %w", p.pid, e)
		}
		var e error
		if w, r, e = p.stdioPipes(); e == nil {
			e = p.confine(prog)
		}
		if e2 := p.restoreRegs(); e == nil {
			e = e2
		}
		if e == nil {
			if e = ptrace(unix.PTRACE_CONT, p.pid, 0, 0); e != nil {
				e = fmt.Errorf("cont %d: %w", p.pid, e)
			} else {
				p.stopped = false
			}
		}
		if e != nil {
			closeFiles(w, r)
			w, r = nil, nil
		}
		return e
	})
	return w, r, err
}

// NewStdio gives the stopped process fresh pipes as its standard
// descriptors, made inside it: one pipe as stdin, one as both stdout and
// stderr, with no other descriptor of them left in the process (unlike
// stdioPipes, for a copy that lives on: it sees an EOF once stdin's write
// end is closed). It returns the far ends in the caller, taken over with
// pidfd_getfd: stdin writes the process's stdin, output reads what it
// prints; both are non-blocking. Whatever the process had as descriptors
// 0-2 is closed. Nothing outside the process and the caller ever holds the
// pipes, so nothing else in the sandbox can reach them.
func (p *Proc) NewStdio() (stdin, output *os.File, err error) {
	err = p.t.Do(func() error {
		if p.gone {
			return fmt.Errorf("process %d is gone", p.pid)
		}
		var e error
		stdin, output, e = p.newStdio()
		if e2 := p.restoreRegs(); e == nil {
			e = e2
		}
		if e != nil {
			closeFiles(stdin, output)
			stdin, output = nil, nil
		}
		return e
	})
	return stdin, output, err
}

func (p *Proc) newStdio() (stdin, output *os.File, err error) {
	pidfd, err := unix.PidfdOpen(p.pid, 0)
	if err != nil {
		return nil, nil, fmt.Errorf("pidfd of %d: %w", p.pid, err)
	}
	defer unix.Close(pidfd)
	addr := p.ScratchAddr()
	// pipe makes a pipe in the process and checks that it landed on
	// descriptors r and w (the lowest free ones).
	pipe := func(r, w int) error {
		if _, err := p.rawSyscall(unix.SYS_PIPE2, uintptr(addr), 0); err != nil {
			return fmt.Errorf("stdio of %d: pipe2: %w", p.pid, err)
		}
		var buf [8]byte
		if err := p.ReadMem(addr, buf[:]); err != nil {
			return err
		}
		gr, gw := int32(binary.LittleEndian.Uint32(buf[0:])), int32(binary.LittleEndian.Uint32(buf[4:]))
		if int(gr) != r || int(gw) != w {
			return fmt.Errorf("stdio of %d: pipe landed on descriptors %d and %d, not %d and %d", p.pid, gr, gw, r, w)
		}
		return nil
	}
	take := func(fd int, name string) (*os.File, error) {
		lfd, err := unix.PidfdGetfd(pidfd, fd, 0)
		if err != nil {
			return nil, fmt.Errorf("take fd %d of %d: %w", fd, p.pid, err)
		}
		if err := unix.SetNonblock(lfd, true); err != nil {
			unix.Close(lfd)
			return nil, fmt.Errorf("take fd %d of %d: %w", fd, p.pid, err)
		}
		return os.NewFile(uintptr(lfd), name), nil
	}
	// Five injected calls. With 0-2 closed they are the lowest free
	// descriptors: the stdin pipe lands on 0 (read end, kept) and 1
	// (write end, taken, then closed); the output pipe on 1 (read end,
	// taken) and 2 (write end, kept, and duplicated onto 1).
	if _, err := p.rawSyscall(unix.SYS_CLOSE_RANGE, 0, 2, 0); err != nil {
		return nil, nil, fmt.Errorf("stdio of %d: close_range: %w", p.pid, err)
	}
	if err := pipe(0, 1); err != nil {
		return nil, nil, err
	}
	if stdin, err = take(1, fmt.Sprintf("stdin of %d", p.pid)); err != nil {
		return nil, nil, err
	}
	if _, err := p.rawSyscall(unix.SYS_CLOSE, 1); err != nil {
		return stdin, nil, fmt.Errorf("stdio of %d: close 1: %w", p.pid, err)
	}
	if err := pipe(1, 2); err != nil {
		return stdin, nil, err
	}
	if output, err = take(1, fmt.Sprintf("output of %d", p.pid)); err != nil {
		return stdin, nil, err
	}
	if _, err := p.rawSyscall(unix.SYS_DUP2, 2, 1); err != nil {
		return stdin, output, fmt.Errorf("stdio 1 of %d: dup2: %w", p.pid, err)
	}
	return stdin, output, nil
}

// closeFiles closes the files that are not nil.
func closeFiles(fs ...*os.File) {
	for _, f := range fs {
		if f != nil {
			f.Close()
		}
	}
}
