package inject

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rewind-sandbox/rewind/internal/pause"
	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// Clone flags used by Fork.
const (
	cloneParent = unix.CLONE_PARENT
	sigchld     = uintptr(unix.SIGCHLD)
)

// ErrMultiThreaded is returned by Attach for a process with more than one
// thread: fork copies only the calling thread, so such a process cannot be
// template-forked safely.
var ErrMultiThreaded = errors.New("process is multi-threaded")

// Tracer owns one locked OS thread; all ptrace requests of the processes it
// traces are made from that thread.
type Tracer struct {
	reqs     chan func()
	done     chan struct{}
	exited   chan struct{}
	closeOne sync.Once
	// dying are killed tracees whose exit the tracer thread has not
	// collected yet (see Kill); only the tracer thread touches it.
	dying map[int]bool
	// tid is the tracer thread's id.
	tid int
}

// NewTracer starts a tracer thread. Close it when done: closing the thread
// detaches (and so resumes) every process it still traces.
func NewTracer() *Tracer {
	t := &Tracer{reqs: make(chan func()), done: make(chan struct{}), exited: make(chan struct{}), dying: map[int]bool{}}
	ready := make(chan struct{})
	go func() {
		// The thread is never unlocked: when the goroutine returns the
		// runtime terminates it, so no other goroutine inherits tracees.
		runtime.LockOSThread()
		t.tid = unix.Gettid()
		close(ready)
		for {
			var poll <-chan time.Time
			if len(t.dying) > 0 {
				poll = time.After(reapPoll)
			}
			select {
			case f := <-t.reqs:
				f()
			case <-poll:
			case <-t.done:
				// Collect the exits still pending: an uncollected
				// tracee stays a zombie (its pid taken, its PID
				// namespace unable to end) for as long as this thread
				// lives, and a locked thread is not always ended with
				// its goroutine.
				deadline := time.Now().Add(closeReapWait)
				for t.reapDying(); len(t.dying) > 0 && time.Now().Before(deadline); t.reapDying() {
					time.Sleep(reapPoll)
				}
				close(t.exited)
				return
			}
			t.reapDying()
		}
	}()
	<-ready
	return t
}

// Close stops the tracer thread, once the exits of the processes it killed
// are collected (see Kill; it waits at most closeReapWait for them).
// Processes still attached are detached by the kernel when the thread exits.
func (t *Tracer) Close() {
	t.closeOne.Do(func() { close(t.done) })
	<-t.exited
}

// closeReapWait bounds how long Close waits for killed tracees to exit.
const closeReapWait = 10 * time.Second

// Do runs f on the tracer thread and returns its error. Calls made from f
// (Do, or any method of a Proc of this tracer) run inline: a sequence of
// operations wrapped in one Do costs one hand-over to the tracer thread
// (tens of microseconds on a loaded machine) instead of one each.
func (t *Tracer) Do(f func() error) error {
	if unix.Gettid() == t.tid {
		return f()
	}
	var err error
	ran := make(chan struct{})
	select {
	case t.reqs <- func() { err = f(); close(ran) }:
	case <-t.done:
		return errors.New("tracer closed")
	}
	<-ran
	return err
}

// Proc is a process attached by a Tracer and held in a ptrace stop. Its
// methods may be called from any goroutine; they run on the tracer thread.
type Proc struct {
	t   *Tracer
	pid int
	// saved are the registers the process resumes with.
	saved unix.PtraceRegs
	// sysAddr is the address of a `syscall` instruction in the process.
	sysAddr uint64
	// pendingSigs are signals that arrived during injection, re-sent on
	// Detach.
	pendingSigs []syscall.Signal
	gone        bool
	stopped     bool // registers saved at a stop
}

// Pid returns the process id (in the tracer's PID namespace).
func (p *Proc) Pid() int { return p.pid }

// Regs returns the registers the process will resume with.
func (p *Proc) Regs() unix.PtraceRegs { return p.saved }

// SyscallAddr returns the address of the `syscall` instruction used for
// injection.
func (p *Proc) SyscallAddr() uint64 { return p.sysAddr }

func ptrace(req int, pid int, addr, data uintptr) error {
	_, _, e := unix.RawSyscall6(unix.SYS_PTRACE, uintptr(req), uintptr(pid), addr, data, 0, 0)
	if e != 0 {
		return e
	}
	return nil
}

func getRegs(pid int, r *unix.PtraceRegs) error {
	return ptraceRegs(unix.PTRACE_GETREGS, pid, r)
}

func setRegs(pid int, r *unix.PtraceRegs) error {
	return ptraceRegs(unix.PTRACE_SETREGS, pid, r)
}

func wait(pid int) (unix.WaitStatus, error) {
	var ws unix.WaitStatus
	for {
		_, err := unix.Wait4(pid, &ws, unix.WALL, nil)
		if err == unix.EINTR {
			continue
		}
		return ws, err
	}
}

const traceOpts = unix.PTRACE_O_TRACEFORK | unix.PTRACE_O_TRACECLONE | unix.PTRACE_O_TRACEVFORK | unix.PTRACE_O_EXITKILL

// event returns the PTRACE_EVENT_* of a stop (0 for a signal-delivery
// stop). Unlike WaitStatus.TrapCause it also decodes group stops of seized
// tracees, reported as PTRACE_EVENT_STOP with the stop signal.
func event(ws unix.WaitStatus) int {
	return int(uint32(ws)>>16) & 0xff
}

// Attach seizes pid, interrupts it and waits until it is stopped. It refuses
// multi-threaded processes (ErrMultiThreaded).
func (t *Tracer) Attach(pid int) (*Proc, error) {
	if n, err := Threads(pid); err != nil {
		return nil, fmt.Errorf("attach %d: %w", pid, err)
	} else if n != 1 {
		return nil, fmt.Errorf("attach %d: %w (%d threads)", pid, ErrMultiThreaded, n)
	}
	p, err := t.Seize(pid)
	if err != nil {
		return nil, err
	}
	if err := t.Do(func() error { return p.stop() }); err != nil {
		_ = t.Do(func() error { return ptrace(unix.PTRACE_DETACH, pid, 0, 0) })
		return nil, err
	}
	return p, nil
}

// Seize attaches to pid without stopping it (PTRACE_SEIZE). Call Interrupt
// and then Stopped to bring it to a stop; this split lets a caller seize all
// processes of a frozen cgroup first and stop them after the thaw.
func (t *Tracer) Seize(pid int) (*Proc, error) {
	p := &Proc{t: t, pid: pid}
	err := t.Do(func() error {
		if err := ptrace(unix.PTRACE_SEIZE, pid, 0, traceOpts); err != nil {
			return fmt.Errorf("seize %d%s: %w", pid, describe(pid), err)
		}
		return nil
	})
	if err != nil {
		return nil, err
	}
	return p, nil
}

// Interrupt asks a seized process to stop (PTRACE_INTERRUPT) without waiting.
func (p *Proc) Interrupt() error {
	return p.t.Do(func() error {
		if err := ptrace(unix.PTRACE_INTERRUPT, p.pid, 0, 0); err != nil {
			return fmt.Errorf("interrupt %d: %w", p.pid, err)
		}
		return nil
	})
}

// Stopped waits for the stop requested by Interrupt and saves the registers.
func (p *Proc) Stopped() error {
	return p.t.Do(func() error { return p.waitStop() })
}

func (p *Proc) stop() error {
	if err := ptrace(unix.PTRACE_INTERRUPT, p.pid, 0, 0); err != nil {
		return fmt.Errorf("interrupt %d: %w", p.pid, err)
	}
	return p.waitStop()
}

// waitStop waits for a PTRACE_EVENT_STOP (interrupt or group stop) and saves
// registers. Signals arriving meanwhile are kept for Detach.
func (p *Proc) waitStop() error {
	var seen []string
	for {
		ws, err := wait(p.pid)
		if err != nil {
			return fmt.Errorf("wait %d: %w", p.pid, err)
		}
		if ws.Exited() || ws.Signaled() {
			p.gone = true
			return fmt.Errorf("process %d exited while stopping (%v, after %v)", p.pid, ws, seen)
		}
		seen = append(seen, fmt.Sprintf("%#x", uint32(ws)))
		if !ws.Stopped() {
			continue
		}
		if event(ws) == unix.PTRACE_EVENT_STOP {
			break
		}
		if event(ws) <= 0 {
			// Signal-delivery stop: suppress now, re-deliver on detach.
			p.pendingSigs = append(p.pendingSigs, ws.StopSignal())
		}
		if err := ptrace(unix.PTRACE_CONT, p.pid, 0, 0); err != nil {
			return fmt.Errorf("cont %d: %w", p.pid, err)
		}
	}
	if err := getRegs(p.pid, &p.saved); err != nil {
		return fmt.Errorf("getregs %d: %w", p.pid, err)
	}
	p.stopped = true
	if p.sysAddr == 0 {
		a, err := findSyscall(p.pid)
		if err != nil {
			return err
		}
		p.sysAddr = a
	}
	return nil
}

// Syscall makes the stopped process execute system call nr with args and
// returns the raw result (negative errno values are converted to an error).
// The process's saved registers are untouched.
func (p *Proc) Syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	var r uintptr
	err := p.t.Do(func() error {
		var e error
		r, e = p.syscall(nr, args...)
		return e
	})
	return r, err
}

func (p *Proc) injRegs(nr uintptr, args []uintptr) unix.PtraceRegs {
	r := p.saved
	var a [6]uint64
	for i, v := range args {
		a[i] = uint64(v)
	}
	r.Rax = uint64(nr)
	r.Orig_rax = ^uint64(0) // -1: no syscall restart on resume
	r.Rdi, r.Rsi, r.Rdx, r.R10, r.R8, r.R9 = a[0], a[1], a[2], a[3], a[4], a[5]
	r.Rip = p.sysAddr
	return r
}

// step single-steps the process until it stops after the syscall
// instruction; ptrace events met on the way are returned through onEvent.
func (p *Proc) step(onEvent func(cause int) error) (unix.PtraceRegs, error) {
	var out unix.PtraceRegs
	if err := ptrace(unix.PTRACE_SINGLESTEP, p.pid, 0, 0); err != nil {
		return out, fmt.Errorf("singlestep %d: %w", p.pid, err)
	}
	for {
		ws, err := wait(p.pid)
		if err != nil {
			return out, fmt.Errorf("wait %d: %w", p.pid, err)
		}
		if ws.Exited() || ws.Signaled() {
			p.gone = true
			return out, fmt.Errorf("process %d died during injection (%v)", p.pid, ws)
		}
		if !ws.Stopped() {
			continue
		}
		if c := event(ws); c > 0 {
			if c != unix.PTRACE_EVENT_STOP && onEvent != nil {
				if err := onEvent(c); err != nil {
					return out, err
				}
			}
			if err := ptrace(unix.PTRACE_SINGLESTEP, p.pid, 0, 0); err != nil {
				return out, fmt.Errorf("singlestep %d: %w", p.pid, err)
			}
			continue
		}
		if sig := ws.StopSignal(); sig != unix.SIGTRAP {
			p.pendingSigs = append(p.pendingSigs, sig)
			if err := ptrace(unix.PTRACE_SINGLESTEP, p.pid, 0, 0); err != nil {
				return out, fmt.Errorf("singlestep %d: %w", p.pid, err)
			}
			continue
		}
		if err := getRegs(p.pid, &out); err != nil {
			return out, fmt.Errorf("getregs %d: %w", p.pid, err)
		}
		return out, nil
	}
}

func (p *Proc) syscall(nr uintptr, args ...uintptr) (uintptr, error) {
	r, err := p.rawSyscall(nr, args...)
	if err2 := p.restoreRegs(); err2 != nil {
		return 0, err2
	}
	return r, err
}

func (p *Proc) restoreRegs() error {
	if err := setRegs(p.pid, &p.saved); err != nil {
		return fmt.Errorf("setregs %d: %w", p.pid, err)
	}
	return nil
}

// rawSyscall injects one call and leaves the registers as the call left
// them; the caller restores them (restoreRegs) after its last call.
func (p *Proc) rawSyscall(nr uintptr, args ...uintptr) (uintptr, error) {
	if p.gone {
		return 0, fmt.Errorf("process %d is gone", p.pid)
	}
	r := p.injRegs(nr, args)
	if err := setRegs(p.pid, &r); err != nil {
		return 0, fmt.Errorf("setregs %d: %w", p.pid, err)
	}
	out, err := p.step(nil)
	if err != nil {
		return 0, err
	}
	if v := int64(out.Rax); v < 0 && v > -4096 {
		return 0, fmt.Errorf("injected syscall %d in %d: %w", nr, p.pid, unix.Errno(-v))
	}
	return uintptr(out.Rax), nil
}

// Fork makes the stopped process fork itself. With sibling set the copy is
// created with clone(CLONE_PARENT|SIGCHLD), so it becomes a child of the
// process's parent (the sandbox init reaps it) instead of an unexpected
// child of the process. The copy is returned attached and stopped, with the
// same saved registers (it resumes exactly where the original would).
func (p *Proc) Fork(sibling bool) (*Proc, error) {
	var child *Proc
	err := p.t.Do(func() error {
		var e error
		child, e = p.fork(sibling)
		return e
	})
	return child, err
}

func (p *Proc) fork(sibling bool) (*Proc, error) {
	if p.gone {
		return nil, fmt.Errorf("process %d is gone", p.pid)
	}
	flags := sigchld
	if sibling {
		flags |= cloneParent
	}
	r := p.injRegs(unix.SYS_CLONE, []uintptr{flags, 0, 0, 0, 0})
	if err := setRegs(p.pid, &r); err != nil {
		return nil, fmt.Errorf("setregs %d: %w", p.pid, err)
	}
	childPid := 0
	out, err := p.step(func(cause int) error {
		if cause == unix.PTRACE_EVENT_FORK || cause == unix.PTRACE_EVENT_CLONE || cause == unix.PTRACE_EVENT_VFORK {
			msg, err := unix.PtraceGetEventMsg(p.pid)
			if err != nil {
				return fmt.Errorf("geteventmsg %d: %w", p.pid, err)
			}
			childPid = int(msg)
		}
		return nil
	})
	if err != nil {
		if childPid > 0 {
			_ = unix.Kill(childPid, unix.SIGKILL)
		}
		return nil, err
	}
	if err := setRegs(p.pid, &p.saved); err != nil {
		return nil, fmt.Errorf("setregs %d: %w", p.pid, err)
	}
	if v := int64(out.Rax); v < 0 && v > -4096 {
		return nil, fmt.Errorf("injected fork in %d: %w", p.pid, unix.Errno(-v))
	}
	if childPid == 0 {
		return nil, fmt.Errorf("injected fork in %d: no fork event", p.pid)
	}
	c := &Proc{t: p.t, pid: childPid, saved: p.saved, sysAddr: p.sysAddr, stopped: true}
	// The auto-attached child reports a PTRACE_EVENT_STOP first.
	for {
		ws, err := wait(childPid)
		if err != nil {
			return nil, fmt.Errorf("wait child %d: %w", childPid, err)
		}
		if ws.Exited() || ws.Signaled() {
			return nil, fmt.Errorf("forked child %d died (%v)", childPid, ws)
		}
		if ws.Stopped() && event(ws) == unix.PTRACE_EVENT_STOP {
			break
		}
		if err := ptrace(unix.PTRACE_CONT, childPid, 0, 0); err != nil {
			return nil, fmt.Errorf("cont child %d: %w", childPid, err)
		}
	}
	if err := setRegs(childPid, &c.saved); err != nil {
		_ = unix.Kill(childPid, unix.SIGKILL)
		return nil, fmt.Errorf("setregs child %d: %w", childPid, err)
	}
	return c, nil
}

// Detach restores the saved registers and lets the process run on, then
// re-sends signals that arrived during injection.
func (p *Proc) Detach() error {
	return p.t.Do(func() error {
		if p.gone {
			return nil
		}
		if !p.stopped {
			if err := p.waitStop(); err != nil {
				return err
			}
		}
		if err := setRegs(p.pid, &p.saved); err != nil {
			return fmt.Errorf("setregs %d: %w", p.pid, err)
		}
		if err := ptrace(unix.PTRACE_DETACH, p.pid, 0, 0); err != nil {
			return fmt.Errorf("detach %d: %w", p.pid, err)
		}
		p.gone = true
		for _, s := range p.pendingSigs {
			_ = unix.Kill(p.pid, s)
		}
		return nil
	})
}

// ResentSignals returns the signals that arrived while p was held (a
// tracee's signal is stopped at delivery and suppressed during injection)
// and were sent to it again by Detach. Call it after Detach: a process
// that dies right after its release may have died of one of them.
func (p *Proc) ResentSignals() []syscall.Signal {
	var out []syscall.Signal
	_ = p.t.Do(func() error {
		if p.gone {
			out = append(out, p.pendingSigs...)
		}
		return nil
	})
	return out
}

// DetachStopped detaches leaving the process in a SIGSTOP group stop (for
// another tracer such as CRIU to seize it). The process runs no user code in
// between: SIGSTOP is queued while it is held, and the detach happens at the
// signal's delivery stop.
func (p *Proc) DetachStopped() error {
	return p.t.Do(func() error {
		if p.gone {
			return nil
		}
		if !p.stopped {
			if err := p.waitStop(); err != nil {
				return err
			}
		}
		if err := setRegs(p.pid, &p.saved); err != nil {
			return fmt.Errorf("setregs %d: %w", p.pid, err)
		}
		if err := unix.Tgkill(p.pid, p.pid, unix.SIGSTOP); err != nil {
			return fmt.Errorf("sigstop %d: %w", p.pid, err)
		}
		if err := ptrace(unix.PTRACE_CONT, p.pid, 0, 0); err != nil {
			return fmt.Errorf("cont %d: %w", p.pid, err)
		}
		for {
			ws, err := wait(p.pid)
			if err != nil {
				return fmt.Errorf("wait %d: %w", p.pid, err)
			}
			if ws.Exited() || ws.Signaled() {
				p.gone = true
				return fmt.Errorf("process %d died while stopping", p.pid)
			}
			if !ws.Stopped() {
				continue
			}
			if event(ws) <= 0 && ws.StopSignal() == unix.SIGSTOP {
				break
			}
			if event(ws) <= 0 {
				p.pendingSigs = append(p.pendingSigs, ws.StopSignal())
			}
			if err := ptrace(unix.PTRACE_CONT, p.pid, 0, 0); err != nil {
				return fmt.Errorf("cont %d: %w", p.pid, err)
			}
		}
		if err := ptrace(unix.PTRACE_DETACH, p.pid, 0, uintptr(unix.SIGSTOP)); err != nil {
			return fmt.Errorf("detach %d: %w", p.pid, err)
		}
		p.gone = true
		return nil
	})
}

// reapPoll is how often the tracer thread looks for the exit of killed
// tracees it could not collect at once.
const reapPoll = 500 * time.Microsecond

// killWait bounds how long Kill waits on the tracer thread for the exit of
// the killed process before leaving it to the background reaping.
const killWait = 2 * time.Millisecond

// reaped collects pid's exit report if there is one (WNOHANG). It reports
// true once the process is gone for this tracer.
func reaped(pid int) bool {
	for {
		var ws unix.WaitStatus
		wpid, err := unix.Wait4(pid, &ws, unix.WALL|unix.WNOHANG, nil)
		switch {
		case err == unix.EINTR:
			continue
		case err != nil:
			return true // ECHILD: not ours any more
		case wpid == 0:
			return false
		case ws.Exited() || ws.Signaled():
			return true
		}
		// A stop reported before the exit: look again.
	}
}

// reapDying collects the exits of killed tracees (tracer thread only).
func (t *Tracer) reapDying() {
	for pid := range t.dying {
		if reaped(pid) {
			delete(t.dying, pid)
		}
	}
}

// Kill SIGKILLs the process and collects its exit on the tracer thread (and
// so the process itself when the tracer thread is also its parent). Kill
// never blocks the tracer thread on a process that cannot die yet — one in
// a frozen cgroup (v1 freezer) dies only once thawed, and whoever froze it
// may be waiting for the tracer: the exit is then collected in the
// background, and the pid stays taken (a zombie) until it is.
func (p *Proc) Kill() error {
	return p.t.Do(func() error {
		if p.gone {
			return nil
		}
		p.gone = true
		if err := unix.Kill(p.pid, unix.SIGKILL); err != nil && err != unix.ESRCH {
			return fmt.Errorf("kill %d: %w", p.pid, err)
		}
		deadline := time.Now().Add(killWait)
		for !reaped(p.pid) {
			if time.Now().After(deadline) {
				p.t.dying[p.pid] = true
				return nil
			}
			pause.For(20 * time.Microsecond) // time.Sleep would take a millisecond
		}
		return nil
	})
}

// WriteMem writes b into the stopped process at addr.
func (p *Proc) WriteMem(addr uint64, b []byte) error {
	local := []unix.Iovec{{Base: &b[0], Len: uint64(len(b))}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(b)}}
	n, err := unix.ProcessVMWritev(p.pid, local, remote, 0)
	if err != nil {
		return fmt.Errorf("write memory of %d: %w", p.pid, err)
	}
	if n != len(b) {
		return fmt.Errorf("write memory of %d: short write %d/%d", p.pid, n, len(b))
	}
	return nil
}

// ScratchAddr returns an address below the stack red zone of the stopped
// process where up to 4 KiB may be written for injected calls.
func (p *Proc) ScratchAddr() uint64 {
	return (p.saved.Rsp - 128 - 4096) &^ 15
}

// Threads returns the number of threads of pid.
func Threads(pid int) (int, error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "status"))
	if err != nil {
		return 0, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Threads:"); ok {
			return strconv.Atoi(strings.TrimSpace(v))
		}
	}
	return 0, fmt.Errorf("no Threads line in /proc/%d/status", pid)
}

// vdsoOffset is the offset of a `syscall` instruction inside the vDSO. The
// vDSO image is the same in every 64-bit process of this kernel, so it is
// found once in our own vDSO.
var vdsoOffset = sync.OnceValues(func() (uint64, error) {
	start, end, err := vdsoRange(os.Getpid())
	if err != nil {
		return 0, err
	}
	f, err := os.Open("/proc/self/mem")
	if err != nil {
		return 0, err
	}
	defer f.Close()
	buf := make([]byte, end-start)
	if _, err := f.ReadAt(buf, int64(start)); err != nil {
		return 0, fmt.Errorf("read own vdso: %w", err)
	}
	i := bytes.Index(buf, []byte{0x0f, 0x05})
	if i < 0 {
		return 0, errors.New("no syscall instruction in the vdso")
	}
	return uint64(i), nil
})

func vdsoRange(pid int) (uint64, uint64, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return 0, 0, err
	}
	defer f.Close()
	s := bufio.NewScanner(f)
	for s.Scan() {
		l := s.Text()
		if !strings.HasSuffix(l, "[vdso]") {
			continue
		}
		rng, _, _ := strings.Cut(l, " ")
		a, b, _ := strings.Cut(rng, "-")
		start, err1 := strconv.ParseUint(a, 16, 64)
		end, err2 := strconv.ParseUint(b, 16, 64)
		if err1 != nil || err2 != nil {
			return 0, 0, fmt.Errorf("bad maps line %q", l)
		}
		return start, end, nil
	}
	return 0, 0, fmt.Errorf("process %d has no vdso", pid)
}

func findSyscall(pid int) (uint64, error) {
	off, err := vdsoOffset()
	if err != nil {
		return 0, err
	}
	start, _, err := vdsoRange(pid)
	if err != nil {
		return 0, err
	}
	addr := start + off
	var w [8]byte
	if _, err := unix.PtracePeekText(pid, uintptr(addr), w[:]); err != nil {
		return 0, fmt.Errorf("peek vdso of %d: %w", pid, err)
	}
	if w[0] != 0x0f || w[1] != 0x05 {
		return 0, fmt.Errorf("vdso of %d differs from ours", pid)
	}
	return addr, nil
}

// Setsid makes the stopped process the leader of a new session and process
// group (setsid(2)), so it no longer refers to the session and group of the
// process it was forked from: a session or group id keeps its pid allocated
// while any process uses it, and a restore that needs that exact pid back
// (CRIU) would fail. A process that already leads a process group is left
// as it is (setsid returns EPERM for it).
func (p *Proc) Setsid() error {
	_, err := p.Syscall(unix.SYS_SETSID)
	if errors.Is(err, unix.EPERM) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("setsid in %d: %w", p.pid, err)
	}
	return nil
}

// ReplaceFd opens path inside the stopped process (with the process's own
// view of the file system) and installs the result as descriptor fd,
// closing whatever fd was. It is how a forked copy gets fresh stdio.
func (p *Proc) ReplaceFd(fd int, path string, flags int) error {
	return p.t.Do(func() error {
		b := append([]byte(path), 0)
		if len(b) > 4096 {
			return fmt.Errorf("replace fd %d of %d: path too long", fd, p.pid)
		}
		addr := p.ScratchAddr()
		if err := p.WriteMem(addr, b); err != nil {
			return err
		}
		fdcwd := unix.AT_FDCWD
		nfd, err := p.syscall(unix.SYS_OPENAT, uintptr(fdcwd), uintptr(addr), uintptr(flags|unix.O_CLOEXEC), 0)
		if err != nil {
			return fmt.Errorf("replace fd %d of %d: open %s: %w", fd, p.pid, path, err)
		}
		if int(nfd) == fd {
			// Landed on the wanted number: clear close-on-exec.
			_, err = p.syscall(unix.SYS_FCNTL, nfd, unix.F_SETFD, 0)
			return err
		}
		if _, err := p.syscall(unix.SYS_DUP2, nfd, uintptr(fd)); err != nil {
			_, _ = p.syscall(unix.SYS_CLOSE, nfd)
			return fmt.Errorf("replace fd %d of %d: dup2: %w", fd, p.pid, err)
		}
		_, _ = p.syscall(unix.SYS_CLOSE, nfd)
		return nil
	})
}

// SetStdio installs the files at paths (opened inside the process) as
// descriptors 0, 1 and 2 in one batch; an empty path leaves that descriptor
// alone, and a path equal to an earlier one shares its open file (stdout
// and stderr on one pipe). flags[i] are the open flags for descriptor i.
func (p *Proc) SetStdio(paths [3]string, flags [3]int) error {
	return p.t.Do(func() error {
		err := p.setStdio(paths, flags)
		if err2 := p.restoreRegs(); err == nil {
			err = err2
		}
		return err
	})
}

func (p *Proc) setStdio(paths [3]string, flags [3]int) error {
	// All paths go into the scratch area at once.
	var buf []byte
	var offs [3]int
	for i, path := range paths {
		offs[i] = len(buf)
		buf = append(buf, path...)
		buf = append(buf, 0)
	}
	if len(buf) > 4096 {
		return fmt.Errorf("stdio of %d: paths too long", p.pid)
	}
	base := p.ScratchAddr()
	if err := p.WriteMem(base, buf); err != nil {
		return err
	}
	fdcwd := unix.AT_FDCWD
	for fd, path := range paths {
		if path == "" {
			continue
		}
		shared := -1
		for j := 0; j < fd; j++ {
			if paths[j] == path {
				shared = j
			}
		}
		if shared >= 0 {
			if _, err := p.rawSyscall(unix.SYS_DUP2, uintptr(shared), uintptr(fd)); err != nil {
				return fmt.Errorf("stdio %d of %d: dup2: %w", fd, p.pid, err)
			}
			continue
		}
		// close(fd) then open: the lowest free descriptor is fd again
		// (all lower ones are in use), so no dup2/close pair is needed.
		_, _ = p.rawSyscall(unix.SYS_CLOSE, uintptr(fd))
		nfd, err := p.rawSyscall(unix.SYS_OPENAT, uintptr(fdcwd), uintptr(base+uint64(offs[fd])), uintptr(flags[fd]&^unix.O_CLOEXEC), 0)
		if err != nil {
			return fmt.Errorf("stdio %d of %d: open %s: %w", fd, p.pid, path, err)
		}
		if int(nfd) != fd {
			if _, err := p.rawSyscall(unix.SYS_DUP2, nfd, uintptr(fd)); err != nil {
				return fmt.Errorf("stdio %d of %d: dup2: %w", fd, p.pid, err)
			}
			_, _ = p.rawSyscall(unix.SYS_CLOSE, nfd)
		}
	}
	return nil
}

// describe names pid and its tracer for error messages.
func describe(pid int) string {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "status"))
	if err != nil {
		return ""
	}
	var name, tracer string
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "Name:"); ok {
			name = strings.TrimSpace(v)
		}
		if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
			tracer = strings.TrimSpace(v)
		}
	}
	return fmt.Sprintf(" (%s, traced by %s)", name, tracer)
}

// Chdir makes the stopped process change its working directory to path
// (resolved with the process's own root).
func (p *Proc) Chdir(path string) error {
	return p.t.Do(func() error {
		b := append([]byte(path), 0)
		if len(b) > 4096 {
			return fmt.Errorf("chdir of %d: path too long", p.pid)
		}
		if err := p.WriteMem(p.ScratchAddr(), b); err != nil {
			return err
		}
		if _, err := p.syscall(unix.SYS_CHDIR, uintptr(p.ScratchAddr())); err != nil {
			return fmt.Errorf("chdir of %d to %s: %w", p.pid, path, err)
		}
		return nil
	})
}

// Reopen opens path inside the stopped process with flags (O_CREAT,
// O_EXCL and O_TRUNC ignored), moves the new file to offset pos and
// installs it as descriptor fd in place of what fd was; fd is
// close-on-exec when flags has O_CLOEXEC. It moves a descriptor to another
// view of the same file (after the process's root changed).
func (p *Proc) Reopen(fd int, path string, flags int, pos int64) error {
	return p.t.Do(func() error {
		b := append([]byte(path), 0)
		if len(b) > 4096 {
			return fmt.Errorf("reopen fd %d of %d: path too long", fd, p.pid)
		}
		addr := p.ScratchAddr()
		if err := p.WriteMem(addr, b); err != nil {
			return err
		}
		of := (flags &^ (unix.O_CREAT | unix.O_EXCL | unix.O_TRUNC)) | unix.O_CLOEXEC
		fdcwd := unix.AT_FDCWD
		nfd, err := p.rawSyscall(unix.SYS_OPENAT, uintptr(fdcwd), uintptr(addr), uintptr(of), 0)
		if err == nil && pos > 0 {
			if _, err = p.rawSyscall(unix.SYS_LSEEK, nfd, uintptr(pos), uintptr(unix.SEEK_SET)); err != nil {
				_, _ = p.rawSyscall(unix.SYS_CLOSE, nfd)
			}
		}
		if err == nil && int(nfd) != fd {
			dflags := 0
			if flags&unix.O_CLOEXEC != 0 {
				dflags = unix.O_CLOEXEC
			}
			_, err = p.rawSyscall(unix.SYS_DUP3, nfd, uintptr(fd), uintptr(dflags))
			_, _ = p.rawSyscall(unix.SYS_CLOSE, nfd)
		} else if err == nil && flags&unix.O_CLOEXEC == 0 {
			_, err = p.rawSyscall(unix.SYS_FCNTL, nfd, unix.F_SETFD, 0)
		}
		if rerr := p.restoreRegs(); err == nil {
			err = rerr
		}
		if err != nil {
			return fmt.Errorf("reopen fd %d of %d (%s): %w", fd, p.pid, path, err)
		}
		return nil
	})
}
