package sandbox

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// DefaultIdle is how long Send waits for more output before returning.
const DefaultIdle = 300 * time.Millisecond

// maxSessionBuffer bounds a session's unread output; older bytes are dropped.
const maxSessionBuffer = 16 << 20

// Errors of sessions.
var (
	// ErrSessionExited: the session's process is gone (its stdin is closed).
	ErrSessionExited = errors.New("session process exited")
	// ErrSessionReplaced: AdoptSession gave the session id to another process.
	ErrSessionReplaced = errors.New("session replaced by a restored process")
	// ErrSessionExists: StartSession with an id in use by a live session.
	ErrSessionExists = errors.New("session id in use")
)

// SessionConfig describes a long-lived process driven through its stdio.
type SessionConfig struct {
	// ID names the session within the sandbox.
	ID string
	// Argv is the command (looked up in PATH inside the sandbox).
	Argv []string
	// Env is added to the sandbox's base environment.
	Env []string
	// Dir is the working directory inside the sandbox (default /).
	Dir string
	// TTY runs the process on a new pseudo-terminal (its controlling
	// terminal, stdin, stdout and stderr) instead of pipes: programs then
	// behave interactively (prompts, line editing, echo of what Send
	// writes, job control). Rows and Cols set its size (default 50x200).
	// A restored copy of the process gets pipes (see AdoptSession).
	TTY        bool
	Rows, Cols int
}

// SendOptions tells Send when the answer is complete.
type SendOptions struct {
	// Idle returns once no output arrived for this long. Zero means
	// DefaultIdle without Until, and no idle limit with Until.
	Idle time.Duration
	// Until returns as soon as the output read so far matches.
	Until *regexp.Regexp
}

// Channels is a fresh pair of stdio pipes for a sandbox process: a stdin
// pipe and one output pipe that the process uses for both stdout and
// stderr. The daemon keeps the other ends. See AdoptSession.
type Channels struct {
	sb             *Sandbox
	stdinW, outR   *os.File // daemon ends
	stdinR, outW   *os.File // child ends
	mu             sync.Mutex
	held           []int // child ends held by the init (InitFDs)
	adopted, close bool
}

// NewChannels creates fresh stdio pipes for a process that the caller
// creates in the sandbox (template fork, CRIU restore).
func (s *Sandbox) NewChannels() (*Channels, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, fmt.Errorf("channels for %s: %w", s.cfg.ID, err)
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, fmt.Errorf("channels for %s: %w", s.cfg.ID, err)
	}
	return &Channels{sb: s, stdinW: inW, outR: outR, stdinR: inR, outW: outW}, nil
}

// ChildFiles returns the child ends in the daemon: stdin (read end) and
// output (write end, for fds 1 and 2). Pass them to CRIU as inherited fds.
// They stay owned by c.
func (c *Channels) ChildFiles() (stdin, output *os.File) { return c.stdinR, c.outW }

// InitFDs hands the child ends to the sandbox's init and returns their fd
// numbers there: a process inside the sandbox (with the sandbox's
// credentials) gets the pipes by opening /proc/1/fd/<stdin> (O_RDONLY) and
// /proc/1/fd/<output> (O_WRONLY). The init keeps them until AdoptSession
// or Close. The sandbox must not be frozen.
func (c *Channels) InitFDs(ctx context.Context) (stdin, output int, err error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.adopted || c.close {
		return 0, 0, errors.New("channels already used")
	}
	if c.held != nil {
		return c.held[0], c.held[1], nil
	}
	r, _, err := c.sb.cli.call(ctx, &msg{Op: opHold}, int(c.stdinR.Fd()), int(c.outW.Fd()))
	if err != nil {
		return 0, 0, fmt.Errorf("hand channels to init of %s: %w", c.sb.cfg.ID, err)
	}
	if len(r.FDs) != 2 {
		return 0, 0, fmt.Errorf("hand channels to init of %s: bad reply", c.sb.cfg.ID)
	}
	c.held = r.FDs
	return r.FDs[0], r.FDs[1], nil
}

// ttyChannels wraps a terminal's master as the daemon's ends.
func (s *Sandbox) ttyChannels(master int) (*Channels, error) {
	if err := unix.SetNonblock(master, true); err != nil {
		unix.Close(master)
		return nil, err
	}
	dup, err := unix.FcntlInt(uintptr(master), unix.F_DUPFD_CLOEXEC, 0)
	if err != nil {
		unix.Close(master)
		return nil, err
	}
	return &Channels{sb: s, stdinW: os.NewFile(uintptr(master), "tty"), outR: os.NewFile(uintptr(dup), "tty")}, nil
}

// releaseChild closes the child ends in the daemon and in the init.
func (c *Channels) releaseChild() {
	if c.stdinR == nil { // a terminal: no child ends here
		return
	}
	c.stdinR.Close()
	c.outW.Close()
	if c.held != nil {
		ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _, _ = c.sb.cli.call(ctx, &msg{Op: opRelease, FDs: c.held})
		cancel()
		c.held = nil
	}
}

// Close releases channels that were not adopted.
func (c *Channels) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.adopted || c.close {
		return nil
	}
	c.close = true
	c.releaseChild()
	c.stdinW.Close()
	c.outR.Close()
	return nil
}

// Session is a long-lived process whose stdio the daemon relays.
type Session struct {
	id    string
	sb    *Sandbox
	nspid int
	stdin *os.File
	out   *os.File

	sendMu sync.Mutex

	mu      sync.Mutex
	hostPID int
	buf     []byte
	dropped int64
	lastOut time.Time
	eof     bool
	notify  chan struct{} // closed and replaced when output arrives
	reason  error         // set when shut down
	exited  chan struct{}
	code    int
}

// StartSession starts a long-lived process in the sandbox. Its stdout and
// stderr are merged into one buffered stream read by Send and Read.
func (s *Sandbox) StartSession(ctx context.Context, cfg SessionConfig) (*Session, error) {
	if cfg.ID == "" || len(cfg.Argv) == 0 {
		return nil, fmt.Errorf("start session in %s: id and argv are required", s.cfg.ID)
	}
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil, ErrClosed
	}
	if old, ok := s.sessions[cfg.ID]; ok && !old.isDone() {
		s.mu.Unlock()
		return nil, fmt.Errorf("start session %s in %s: %w", cfg.ID, s.cfg.ID, ErrSessionExists)
	}
	s.mu.Unlock()
	req := &msg{Op: opSpawn, Argv: cfg.Argv, Env: mergeEnv(s.cfg.Env, cfg.Env), Dir: cfg.Dir}
	if cfg.TTY {
		req.TTY, req.Rows, req.Cols = true, cfg.Rows, cfg.Cols
		req.Env = mergeEnv(req.Env, []string{"TERM=xterm"})
		r, waiter, err := s.cli.call(ctx, req)
		if err != nil {
			return nil, fmt.Errorf("start session %s in %s: %w", cfg.ID, s.cfg.ID, err)
		}
		if len(r.fds) != 1 {
			closeFDs(r.fds)
			_, _, _ = s.cli.call(ctx, &msg{Op: opKill, PID: r.PID, Sig: int(unix.SIGKILL), Group: true})
			return nil, fmt.Errorf("start session %s in %s: no terminal from init", cfg.ID, s.cfg.ID)
		}
		ch, err := s.ttyChannels(r.fds[0])
		if err != nil {
			_, _, _ = s.cli.call(ctx, &msg{Op: opKill, PID: r.PID, Sig: int(unix.SIGKILL), Group: true})
			return nil, fmt.Errorf("start session %s in %s: %w", cfg.ID, s.cfg.ID, err)
		}
		return s.attach(cfg.ID, r.PID, 0, ch, waiter), nil
	}
	ch, err := s.NewChannels()
	if err != nil {
		return nil, err
	}
	req.Stdio = []int{0, 1, 1}
	r, waiter, err := s.cli.call(ctx, req, int(ch.stdinR.Fd()), int(ch.outW.Fd()))
	if err != nil {
		ch.Close()
		return nil, fmt.Errorf("start session %s in %s: %w", cfg.ID, s.cfg.ID, err)
	}
	return s.attach(cfg.ID, r.PID, 0, ch, waiter), nil
}

// AdoptSession makes hostPID, a process the caller created in the sandbox
// (template fork or CRIU restore) with ch's child ends as its stdio, the
// process of session id. An existing session of that id is shut down (its
// process is not killed) and its unread output dropped. ch is consumed.
// Exit codes are known when the process is a child of the sandbox's init;
// otherwise the session ends with code -1 when the process is gone.
func (s *Sandbox) AdoptSession(id string, hostPID int, ch *Channels) (*Session, error) {
	if id == "" {
		return nil, fmt.Errorf("adopt session in %s: empty id", s.cfg.ID)
	}
	ch.mu.Lock()
	if ch.adopted || ch.close {
		ch.mu.Unlock()
		return nil, fmt.Errorf("adopt session %s in %s: channels already used", id, s.cfg.ID)
	}
	ch.mu.Unlock()
	pidfd, err := unix.PidfdOpen(hostPID, 0)
	if err != nil {
		return nil, fmt.Errorf("adopt session %s in %s: process %d: %w", id, s.cfg.ID, hostPID, err)
	}
	// One read of status for both pids (a restore waits for this).
	nspid, ppid := statusPIDs(hostPID)
	if nspid == 0 {
		unix.Close(pidfd)
		return nil, fmt.Errorf("adopt session %s in %s: process %d not found", id, s.cfg.ID, hostPID)
	}
	if ppid != s.initPID {
		// Not our child: no exit code; watch the pidfd instead.
		waiter := make(chan exitStatus, 1)
		go func() {
			defer unix.Close(pidfd)
			fds := []unix.PollFd{{Fd: int32(pidfd), Events: unix.POLLIN}}
			for {
				if _, err := unix.Poll(fds, -1); err != unix.EINTR {
					break
				}
			}
			waiter <- exitStatus{unknown: true}
		}()
		return s.attach(id, nspid, hostPID, ch, waiter), nil
	}
	unix.Close(pidfd)
	waiter := s.cli.watch(nspid, true)
	return s.attach(id, nspid, hostPID, ch, waiter), nil
}

// AdoptPipes is AdoptSession for a process whose stdio are pipes made
// inside it (cr's RestoreOptions.Pipes): stdin writes its stdin, output
// reads its stdout and stderr. Both files are consumed, also on error.
func (s *Sandbox) AdoptPipes(id string, hostPID int, stdin, output *os.File) (*Session, error) {
	ch := &Channels{sb: s, stdinW: stdin, outR: output}
	ss, err := s.AdoptSession(id, hostPID, ch)
	if err != nil {
		stdin.Close()
		output.Close()
	}
	return ss, err
}

func (s *Sandbox) attach(id string, nspid, hostPID int, ch *Channels, waiter chan exitStatus) *Session {
	ch.mu.Lock()
	ch.adopted = true
	ch.releaseChild()
	ch.mu.Unlock()
	ss := &Session{
		id: id, sb: s, nspid: nspid, hostPID: hostPID,
		stdin: ch.stdinW, out: ch.outR,
		notify: make(chan struct{}), exited: make(chan struct{}), code: -1,
	}
	s.mu.Lock()
	old := s.sessions[id]
	s.sessions[id] = ss
	s.mu.Unlock()
	if old != nil && old.markDown(ErrSessionReplaced) {
		// Off the caller's path (a restore's): closing the output end of
		// a non-blocking pipe waits until its reader goroutine has woken
		// and left the read, a hand-off between threads that cost the
		// restore some 0.1 ms on a virtual machine. The old session
		// already fails every call with ErrSessionReplaced.
		go old.closeEnds()
	}
	go ss.readLoop()
	go func() {
		st := <-waiter
		ss.mu.Lock()
		ss.code = st.code()
		ss.mu.Unlock()
		close(ss.exited)
	}()
	return ss
}

func (ss *Session) readLoop() {
	b := make([]byte, 64<<10)
	for {
		n, err := ss.out.Read(b)
		ss.mu.Lock()
		if n > 0 {
			ss.buf = append(ss.buf, b[:n]...)
			if over := len(ss.buf) - maxSessionBuffer; over > 0 {
				ss.buf = append([]byte(nil), ss.buf[over:]...)
				ss.dropped += int64(over)
			}
			ss.lastOut = time.Now()
		}
		if err != nil {
			ss.eof = true
		}
		close(ss.notify)
		ss.notify = make(chan struct{})
		ss.mu.Unlock()
		if err != nil {
			return
		}
	}
}

// Session returns the session with id, or nil.
func (s *Sandbox) Session(id string) *Session {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.sessions[id]
}

// Sessions lists the sandbox's sessions sorted by id.
func (s *Sandbox) Sessions() []*Session {
	s.mu.Lock()
	out := make([]*Session, 0, len(s.sessions))
	for _, ss := range s.sessions {
		out = append(out, ss)
	}
	s.mu.Unlock()
	sort.Slice(out, func(i, j int) bool { return out[i].id < out[j].id })
	return out
}

// ID returns the session id.
func (ss *Session) ID() string { return ss.id }

// NSPID returns the pid of the session's process inside the sandbox.
func (ss *Session) NSPID() int { return ss.nspid }

// PID returns the host pid of the session's process (0 once it is gone).
func (ss *Session) PID() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.hostPID == 0 && !ss.isDoneLocked() {
		ss.hostPID = ss.sb.hostPID(ss.nspid)
	}
	return ss.hostPID
}

// Done is closed when the session's process has exited.
func (ss *Session) Done() <-chan struct{} { return ss.exited }

// OutputClosed reports whether the session's output has ended (every
// writer of its pipe closed it: the process exited, or closed its output).
func (ss *Session) OutputClosed() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.eof
}

// ExitCode returns the exit code (128+signal if killed; -1 while running or
// unknown).
func (ss *Session) ExitCode() int {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.code
}

func (ss *Session) isDone() bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	return ss.isDoneLocked()
}

func (ss *Session) isDoneLocked() bool {
	if ss.reason != nil {
		return true
	}
	select {
	case <-ss.exited:
		return true
	default:
		return false
	}
}

// Send writes text and a newline to the session's stdin and returns what the
// process printed since the previous Send or Read (so nothing is lost between
// calls), waiting until the output is idle or matches opts.Until, the process
// exits, or ctx ends (then the output so far and ctx's error).
func (ss *Session) Send(ctx context.Context, text string, opts SendOptions) (string, error) {
	a, err := ss.SendAnswer(ctx, text, opts)
	return a.Output, err
}

// Answer is a session's answer to SendAnswer.
type Answer struct {
	// Output is what the process printed since the previous Send or Read.
	Output string
	// Matched: the read ended because the output matched
	// SendOptions.Until (else it was quiet for the idle time, the output
	// ended, or the call's context ended with an error).
	Matched bool
}

// SendAnswer is Send that also says what ended the read. Until is matched
// against what the process prints once the text is written: output it
// printed before (a prompt printed at its start, the rest of an earlier
// command's answer) is returned, but cannot end the read.
func (ss *Session) SendAnswer(ctx context.Context, text string, opts SendOptions) (Answer, error) {
	ss.sendMu.Lock()
	defer ss.sendMu.Unlock()
	if err := ss.err(); err != nil {
		return Answer{}, err
	}
	ss.mu.Lock()
	from := len(ss.buf)
	ss.mu.Unlock()
	t0 := time.Now()
	if d, ok := ctx.Deadline(); ok {
		_ = ss.stdin.SetWriteDeadline(d)
	} else {
		_ = ss.stdin.SetWriteDeadline(time.Time{})
	}
	if _, err := ss.stdin.Write([]byte(text + "\n")); err != nil {
		out := ss.take()
		if errors.Is(err, unix.EPIPE) || errors.Is(err, os.ErrClosed) {
			return Answer{Output: out}, fmt.Errorf("send to session %s: %w", ss.id, ErrSessionExited)
		}
		return Answer{Output: out}, fmt.Errorf("send to session %s: %w", ss.id, err)
	}
	return ss.collect(ctx, opts, t0, from)
}

// Read returns the output since the previous Send or Read, waiting like Send
// but without writing anything.
func (ss *Session) Read(ctx context.Context, opts SendOptions) (string, error) {
	ss.sendMu.Lock()
	defer ss.sendMu.Unlock()
	if err := ss.err(); err != nil {
		return "", err
	}
	a, err := ss.collect(ctx, opts, time.Now(), 0)
	return a.Output, err
}

func (ss *Session) err() error {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.reason != nil {
		return fmt.Errorf("session %s: %w", ss.id, ss.reason)
	}
	return nil
}

func (ss *Session) take() string {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	out := string(ss.buf)
	ss.buf = nil
	return out
}

// collect waits for the answer; Until is matched against the output
// from byte from of the buffer on.
func (ss *Session) collect(ctx context.Context, opts SendOptions, t0 time.Time, from int) (Answer, error) {
	idle := opts.Idle
	if idle == 0 && opts.Until == nil {
		idle = DefaultIdle
	}
	var timer *time.Timer
	defer func() {
		if timer != nil {
			timer.Stop()
		}
	}()
	for {
		ss.mu.Lock()
		data, last, eof, notify := ss.buf, ss.lastOut, ss.eof, ss.notify
		ss.mu.Unlock()
		if last.Before(t0) {
			last = t0
		}
		if opts.Until != nil && len(data) >= from && opts.Until.Match(data[from:]) {
			return Answer{Output: ss.take(), Matched: true}, nil
		}
		if eof {
			return Answer{Output: ss.take()}, nil
		}
		var tc <-chan time.Time
		if idle > 0 {
			wait := idle - time.Since(last)
			if wait <= 0 {
				return Answer{Output: ss.take()}, nil
			}
			if timer == nil {
				timer = time.NewTimer(wait)
			} else {
				timer.Reset(wait)
			}
			tc = timer.C
		}
		select {
		case <-notify:
		case <-tc:
		case <-ctx.Done():
			return Answer{Output: ss.take()}, ctx.Err()
		}
	}
}

// Signal sends sig to the session's process, or with group to its whole
// process group (the session's process leads its own session and group
// when started by StartSession), e.g. SIGINT to interrupt a command.
func (ss *Session) Signal(ctx context.Context, sig unix.Signal, group bool) error {
	if ss.isDone() {
		return fmt.Errorf("signal session %s: %w", ss.id, ErrSessionExited)
	}
	if _, _, err := ss.sb.cli.call(ctx, &msg{Op: opKill, PID: ss.nspid, Sig: int(sig), Group: group}); err != nil {
		return fmt.Errorf("signal session %s: %w", ss.id, err)
	}
	return nil
}

// Kill sends SIGKILL to the session's process and its process group.
func (ss *Session) Kill(ctx context.Context) error {
	if ss.isDone() {
		return nil
	}
	if _, _, err := ss.sb.cli.call(ctx, &msg{Op: opKill, PID: ss.nspid, Sig: int(unix.SIGKILL), Group: true}); err != nil {
		return fmt.Errorf("kill session %s: %w", ss.id, err)
	}
	if _, _, err := ss.sb.cli.call(ctx, &msg{Op: opKill, PID: ss.nspid, Sig: int(unix.SIGKILL)}); err != nil {
		return fmt.Errorf("kill session %s: %w", ss.id, err)
	}
	return nil
}

// Close kills the session's process, closes its stdio and forgets it.
func (ss *Session) Close() error {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	err := ss.Kill(ctx)
	ss.sb.mu.Lock()
	if ss.sb.sessions[ss.id] == ss {
		delete(ss.sb.sessions, ss.id)
	}
	ss.sb.mu.Unlock()
	ss.shutdown(ErrClosed)
	return err
}

// shutdown closes the daemon's ends; later calls fail with reason.
func (ss *Session) shutdown(reason error) {
	if ss.markDown(reason) {
		ss.closeEnds()
	}
}

// markDown makes later calls fail with reason; it reports false when the
// session was shut down before (its ends are closed or being closed).
func (ss *Session) markDown(reason error) bool {
	ss.mu.Lock()
	defer ss.mu.Unlock()
	if ss.reason != nil {
		return false
	}
	ss.reason = reason
	return true
}

// closeEnds closes the daemon's ends of the session's stdio.
func (ss *Session) closeEnds() {
	ss.stdin.Close()
	ss.out.Close()
}

// mergeEnv appends extra to base, later entries overriding earlier ones.
func mergeEnv(base, extra []string) []string {
	idx := map[string]int{}
	out := make([]string, 0, len(base)+len(extra))
	for _, kv := range append(append([]string{}, base...), extra...) {
		k := kv
		for i := 0; i < len(kv); i++ {
			if kv[i] == '=' {
				k = kv[:i]
				break
			}
		}
		if i, ok := idx[k]; ok {
			out[i] = kv
			continue
		}
		idx[k] = len(out)
		out = append(out, kv)
	}
	return out
}
