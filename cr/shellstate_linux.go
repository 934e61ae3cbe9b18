package cr

import (
	"bufio"
	"context"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rewind-sandbox/rewind/cr/inject"
	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// ShellState is the state of a persistent bash as a copy of it reported it
// (see Engine.ShellDigest).
type ShellState struct {
	// Digest is the hex SHA-256 of Text: equal digests mean equal shell
	// state (variables, functions, aliases, options, traps, jobs,
	// directory stack, umask, cwd, open descriptors, limits).
	Digest string
	// Status is the shell's $?. It is not part of Digest (a read-only
	// command that fails, such as a grep without a match, changes only
	// it); a caller that wants a strict comparison compares it too.
	Status int
	// Stopped is how long the shell was held (for a live shell: attach,
	// template fork, detach).
	Stopped time.Duration
	// Text is what was hashed: the kernel-visible state, then the
	// shell's own dump without the variables that change by themselves.
	Text string
}

// ErrNotBash is returned by ShellDigest for a process that is not a bash:
// the dump is bash syntax and its normalisation knows bash's self-changing
// variables; other shells (dash, zsh) print their state differently and
// other programs cannot be asked at all.
var ErrNotBash = errors.New("not a bash process")

// ErrShellBusy is returned by ShellDigest when the shell is not blocked
// reading its next command from stdin: a copy taken in the middle of a
// command would wait for a child that is not its own or run the rest of
// the command a second time.
var ErrShellBusy = errors.New("shell is not waiting for a command")

// shellDigestTimeout bounds how long a copy may take to print its state
// when the context has no earlier deadline.
const shellDigestTimeout = 5 * time.Second

// volatileVars are bash variables that change by themselves (on every
// read, every command or with time) or differ in a copy (BASHPID).
var volatileVars = []string{
	"RANDOM", "SRANDOM", "SECONDS", "EPOCHSECONDS", "EPOCHREALTIME",
	"LINENO", "BASH_LINENO", "BASHPID", "BASH_COMMAND", "HISTCMD", "_",
	"PIPESTATUS", "BASH_ARGV", "BASH_ARGC", "BASH_SOURCE", "FUNCNAME",
}

// volatileLine matches a `declare -p` line of a volatile variable. declare
// -p prints one line per variable (newlines in values come out as $'\n'),
// and no other part of the dump has a line starting with "declare ".
var volatileLine = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^declare -\S* (` + strings.Join(volatileVars, "|") + `)(=|$)`)
})

// shellScript is what the copy runs; %[1]s is a per-call nonce marking the
// status line and the end. Every command is called through `builtin`, so
// aliases and functions of the same names are not used. The group is on
// the left of `||`, so `set -e` cannot make the copy exit on a failing
// builtin. The copy never exits by itself: it would run the shell's EXIT
// trap and (interactive shells) write its history file, both side effects
// on the sandbox. It is killed once the end marker is read.
const shellScript = `{ builtin printf '%[1]s status %%s\n' "$?"; builtin declare -p; builtin declare -f; builtin alias -p; builtin shopt -p; builtin set +o; builtin trap -p; builtin jobs -l; builtin dirs -l -p; builtin umask; builtin printf '%[1]s end\n'; } 2>&1 || :` + "\n"

// ShellDigest digests the state of the bash process pid of sandbox t
// without touching it: pid is stopped for a template fork (about a
// millisecond) and runs on; the copy — a sibling created with CLONE_PARENT,
// so the sandbox init reaps it — gets fresh pipes as stdin, stdout and
// stderr while still stopped, is told to print its state, runs traced
// (a fork it attempts never runs, it dies with the tracer) and is killed
// once it has printed it, or at the deadline. Under a seccomp filter the
// copy can only read its stdin, write its stdout and stderr and manage its
// own memory, descriptors and signals (see copyFilter), so code of the
// agent's that runs in it (a DEBUG trap, a function shadowing a builtin)
// cannot change a file or another process. The shell must be idle,
// blocked reading its next command (ErrShellBusy otherwise).
//
// It works on a live process rather than on a checkpoint's template so
// that the daemon can ask at turn end, before deciding whether to
// checkpoint at all; a template's digest is taken once, from the live
// shell right when the checkpoint is made, or with TemplateShellDigest.
func (e *Engine) ShellDigest(ctx context.Context, t Target, pid int) (*ShellState, error) {
	l := e.sandboxLock(t.ID())
	l.Lock()
	defer l.Unlock()
	procs, err := e.processes(t)
	if err != nil {
		return nil, fmt.Errorf("shell digest of %d: %w", pid, err)
	}
	found := false
	for _, p := range procs {
		found = found || p.PID == pid
	}
	if !found {
		return nil, fmt.Errorf("shell digest of %d: not a live process of sandbox %s", pid, t.ID())
	}
	if err := isBash(pid); err != nil {
		return nil, fmt.Errorf("shell digest of %d: %w", pid, err)
	}
	t0 := time.Now()
	ip, err := e.tracer.Attach(pid)
	if err != nil {
		return nil, fmt.Errorf("shell digest of %d: %w", pid, err)
	}
	var stopped time.Duration
	st, err := e.digestFrom(ctx, t.ID(), ip, nil, func() error {
		err := ip.Detach()
		stopped = time.Since(t0)
		return err
	}, nil)
	if err != nil {
		return nil, fmt.Errorf("shell digest of %d: %w", pid, err)
	}
	st.Stopped = stopped
	return st, nil
}

// TemplateShellDigest digests the shell state that checkpoint id's template
// of process origPID (its pid when checkpointed) holds, the same way as
// ShellDigest does for a live shell. The two are equal when the live shell
// is in the state the checkpoint saved. The sandbox's lock is held only
// until the template's copy exists and is set up: the copy prints its
// state while the sandbox's restores and checkpoints go on (it is a
// helper, which they leave alone).
func (e *Engine) TemplateShellDigest(ctx context.Context, id string, origPID int) (*ShellState, error) {
	e.mu.Lock()
	c, ok := e.ckpts[id]
	e.mu.Unlock()
	if !ok {
		return nil, fmt.Errorf("shell digest of checkpoint %s: %w", id, ErrUnknown)
	}
	l := e.sandboxLock(c.rec.Sandbox)
	l.Lock()
	locked := true
	unlock := func() error {
		if locked {
			locked = false
			l.Unlock()
		}
		return nil
	}
	defer unlock()
	var tm *template
	for _, x := range e.tmpls(c) {
		if x.orig.PID == origPID {
			tm = x
		}
	}
	if tm == nil {
		return nil, fmt.Errorf("shell digest of checkpoint %s: no template of process %d", id, origPID)
	}
	if err := isBash(tm.proc.Pid()); err != nil {
		return nil, fmt.Errorf("shell digest of checkpoint %s: %w", id, err)
	}
	st, err := e.digestFrom(ctx, c.rec.Sandbox, tm.proc, tm.files, nil, unlock)
	if err != nil {
		return nil, fmt.Errorf("shell digest of checkpoint %s process %d: %w", id, origPID, err)
	}
	return st, nil
}

// isBash reports ErrNotBash unless pid's executable is bash.
func isBash(pid int) error {
	exe, err := os.Readlink("/proc/" + strconv.Itoa(pid) + "/exe")
	if err != nil {
		return err
	}
	if filepath.Base(strings.TrimSuffix(exe, " (deleted)")) != "bash" {
		return fmt.Errorf("%w (%s)", ErrNotBash, exe)
	}
	return nil
}

// digestFrom takes the digest from src, a stopped process; files are a
// template's files (see kernelShellState), nil for a live shell; release
// (if set) lets src run on as soon as its copy exists. unlock (if set)
// releases the caller's hold of the sandbox's lock once the copy is set up
// and runs on its own: every injection into a process of the sandbox must
// be made under that lock, or a checkpoint's freeze of the sandbox's
// cgroup could stop the copy in the middle of one, and the tracer thread,
// waiting for the step, would never serve the checkpoint that waits for it
// to seize the sandbox's processes (found by a run of concurrent calls:
// a daemon hung for good).
func (e *Engine) digestFrom(ctx context.Context, sb string, src *inject.Proc, files []viewFD, release func() error, unlock func() error) (st *ShellState, err error) {
	released, unlocked := false, false
	defer func() {
		if release != nil && !released {
			if rerr := release(); err == nil && rerr != nil {
				st, err = nil, rerr
			}
		}
		if unlock != nil && !unlocked {
			_ = unlock()
		}
	}()
	regs := src.Regs()
	// Blocked in read(0, ...) (orig_rax is the call, rdi its descriptor),
	// or, for an interactive shell, in readline's pselect6 on fd 0 alone
	// (rdi, the descriptor count, is 1).
	idle := (regs.Orig_rax == unix.SYS_READ && regs.Rdi == 0) || (regs.Orig_rax == unix.SYS_PSELECT6 && regs.Rdi == 1)
	if !idle {
		return nil, fmt.Errorf("%w (in system call %d on fd %d)", ErrShellBusy, int64(regs.Orig_rax), int64(regs.Rdi))
	}
	kern, err := kernelShellState(src.Pid(), files)
	if err != nil {
		return nil, err
	}
	cp, err := src.Fork(true)
	if err != nil {
		return nil, fmt.Errorf("fork copy: %w", err)
	}
	e.mu.Lock()
	e.aux[cp.Pid()] = sb
	e.mu.Unlock()
	defer e.endCopy(cp)
	if release != nil {
		released = true
		if err := release(); err != nil {
			return nil, err
		}
	}
	// Its own session (the copy holds no controlling terminal and is not
	// in the shell's process group), fresh pipes, the filter, and run.
	filter, err := copyFilter()
	if err != nil {
		return nil, err
	}
	w, r, err := cp.RunConfined(filter)
	if unlock != nil {
		unlocked = true
		_ = unlock()
	}
	if err != nil {
		return nil, err
	}
	defer w.Close() // only after the kill: EOF would make bash exit
	defer r.Close()
	nonce, err := newNonce()
	if err != nil {
		return nil, err
	}
	if _, err := fmt.Fprintf(w, shellScript, nonce); err != nil {
		return nil, fmt.Errorf("write to copy %d: %w", cp.Pid(), err)
	}
	deadline := time.Now().Add(shellDigestTimeout)
	if d, ok := ctx.Deadline(); ok && d.Before(deadline) {
		deadline = d
	}
	if err := r.SetReadDeadline(deadline); err != nil {
		return nil, err
	}
	status, dump, err := readDump(r, nonce)
	if err != nil {
		return nil, fmt.Errorf("copy %d: %w", cp.Pid(), err)
	}
	text := kern + normaliseDump(dump, nonce)
	sum := sha256.Sum256([]byte(text))
	return &ShellState{Digest: hex.EncodeToString(sum[:]), Status: status, Text: text}, nil
}

// endCopy kills a digest copy and any child it made (such a child was
// auto-attached by the tracer and never ran). Neither the caller nor the
// tracer thread waits for the exits: the tracer collects them in the
// background, and the copy stays a helper (TemplatePIDs) until it is
// exiting, so it is never taken for a live process of the sandbox.
func (e *Engine) endCopy(cp *inject.Proc) {
	pid := cp.Pid()
	kids, _ := children(pid)
	if err := e.tracer.KillTracee(pid); err != nil {
		e.log.Debug("kill digest copy", "pid", pid, "err", err)
	}
	for _, k := range kids {
		_ = e.tracer.KillTracee(k)
	}
	forget := func() {
		waitUntil(context.Background(), 10*time.Second, func() bool { return exiting(pid) })
		e.mu.Lock()
		delete(e.aux, pid)
		e.mu.Unlock()
	}
	if exiting(pid) {
		forget()
		return
	}
	e.mu.Lock()
	closing := e.closing
	if !closing {
		e.bg.Add(1)
	}
	e.mu.Unlock()
	if closing {
		forget()
		return
	}
	go func() {
		defer e.bg.Done()
		forget()
	}()
}

func newNonce() (string, error) {
	var b [12]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", fmt.Errorf("nonce: %w", err)
	}
	return "rewind-" + hex.EncodeToString(b[:]), nil
}

// readDump reads the copy's output up to the end marker and returns the
// status and the lines in between.
func readDump(r *os.File, nonce string) (int, []string, error) {
	br := bufio.NewReader(r)
	status := -1
	var lines []string
	for {
		l, err := br.ReadString('\n')
		if err != nil {
			if errors.Is(err, os.ErrDeadlineExceeded) {
				err = fmt.Errorf("no complete state within the deadline: %w", context.DeadlineExceeded)
			}
			return 0, nil, fmt.Errorf("read state (%d lines so far): %w", len(lines), err)
		}
		l = strings.TrimSuffix(l, "\n")
		// An interactive shell prefixes a command's first output line
		// with terminal controls, and echoes the script (whose marker
		// lines are not followed by a number or the line's end).
		if _, v, ok := strings.Cut(l, nonce+" status "); ok && status < 0 {
			if n, err := strconv.Atoi(v); err == nil {
				status = n
				continue
			}
		}
		if strings.HasSuffix(l, nonce+" end") {
			if status < 0 {
				return 0, nil, errors.New("no status line")
			}
			return status, lines, nil
		}
		lines = append(lines, l)
	}
}

// normaliseDump drops the volatile variables and replaces the nonce (it
// shows up in the dump under `set -v`).
func normaliseDump(lines []string, nonce string) string {
	var b strings.Builder
	for _, l := range lines {
		if volatileLine().MatchString(l) {
			continue
		}
		b.WriteString(strings.ReplaceAll(l, nonce, "NONCE"))
		b.WriteByte('\n')
	}
	return b.String()
}

// kernelShellState is the shell state the kernel holds: cwd, umask,
// signal masks and dispositions, limits and the descriptor table beyond
// stdio (stdio is the session's, rewired on every restore). For a
// template, files are its files as captured at the checkpoint: their
// offsets are the ones its copies get (Engine.ownFiles), while the
// template's own descriptors share theirs with the original process,
// which may have read on since.
func kernelShellState(pid int, files []viewFD) (string, error) {
	dir := "/proc/" + strconv.Itoa(pid)
	var b strings.Builder
	cwd, err := os.Readlink(dir + "/cwd")
	if err != nil {
		return "", fmt.Errorf("cwd of %d: %w", pid, err)
	}
	fmt.Fprintf(&b, "cwd %s\n", cwd)
	status, err := procfs.ReadFile(dir + "/status")
	if err != nil {
		return "", fmt.Errorf("status of %d: %w", pid, err)
	}
	for _, l := range strings.Split(string(status), "\n") {
		for _, k := range []string{"Umask:", "SigBlk:", "SigIgn:", "SigCgt:"} {
			if strings.HasPrefix(l, k) {
				fmt.Fprintf(&b, "%s %s\n", k, strings.TrimSpace(l[len(k):]))
			}
		}
	}
	limits, err := procfs.ReadFile(dir + "/limits")
	if err != nil {
		return "", fmt.Errorf("limits of %d: %w", pid, err)
	}
	b.Write(limits)
	names, err := procfs.ReadDirNames(dir + "/fd")
	if err != nil {
		return "", fmt.Errorf("fds of %d: %w", pid, err)
	}
	var fds []int
	for _, name := range names {
		if n, err := strconv.Atoi(name); err == nil && n > 2 {
			fds = append(fds, n)
		}
	}
	sort.Ints(fds)
	for _, fd := range fds {
		target, err := os.Readlink(dir + "/fd/" + strconv.Itoa(fd))
		if err != nil {
			continue // closed meanwhile: the process is stopped, so not ours
		}
		info, _ := procfs.ReadFile(dir + "/fdinfo/" + strconv.Itoa(fd))
		var pos, flags string
		for _, l := range strings.Split(string(info), "\n") {
			if v, ok := strings.CutPrefix(l, "pos:"); ok {
				pos = strings.TrimSpace(v)
			}
			if v, ok := strings.CutPrefix(l, "flags:"); ok {
				flags = strings.TrimSpace(v)
			}
		}
		for _, f := range files {
			if f.fd == fd {
				pos = strconv.FormatInt(f.pos, 10)
			}
		}
		fmt.Fprintf(&b, "fd %d %s pos %s flags %s\n", fd, target, pos, flags)
	}
	return b.String(), nil
}
