package sandbox

import (
	"context"
	"fmt"
	"io"
	"os"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// ExecRequest is a one-shot command.
type ExecRequest struct {
	// Argv is the command (looked up in PATH inside the sandbox).
	Argv []string
	// Env is added to the sandbox's base environment.
	Env []string
	// Dir is the working directory inside the sandbox (default /).
	Dir string
	// Stdin feeds the process (nil: /dev/null).
	Stdin io.Reader
	// Stdout and Stderr receive its output (nil: discarded).
	Stdout, Stderr io.Writer
}

// outputGrace is how long Exec keeps reading output after the process
// exited, when a background child still holds its stdout/stderr.
const outputGrace = 100 * time.Millisecond

// Exec runs a command in the sandbox and returns its exit code (128+signal
// when killed by a signal). Cancelling ctx kills the command's process group.
func (s *Sandbox) Exec(ctx context.Context, req ExecRequest) (int, error) {
	if len(req.Argv) == 0 {
		return -1, fmt.Errorf("exec in %s: empty command", s.cfg.ID)
	}
	var parentEnds, childEnds []*os.File
	defer func() {
		for _, f := range childEnds {
			f.Close()
		}
	}()
	stdio := []int{-1, -1, -1}
	var fds []int
	var stdinW *os.File
	var readers [2]*os.File
	add := func(slot int, child *os.File) {
		stdio[slot] = len(fds)
		fds = append(fds, int(child.Fd()))
		childEnds = append(childEnds, child)
	}
	if req.Stdin != nil {
		r, w, err := os.Pipe()
		if err != nil {
			return -1, fmt.Errorf("exec in %s: %w", s.cfg.ID, err)
		}
		stdinW = w
		parentEnds = append(parentEnds, w)
		add(0, r)
	}
	for i, w := range []io.Writer{req.Stdout, req.Stderr} {
		if w == nil {
			continue
		}
		r, wr, err := os.Pipe()
		if err != nil {
			for _, f := range parentEnds {
				f.Close()
			}
			return -1, fmt.Errorf("exec in %s: %w", s.cfg.ID, err)
		}
		readers[i] = r
		parentEnds = append(parentEnds, r)
		add(i+1, wr)
	}
	r, waiter, err := s.cli.call(ctx, &msg{
		Op: opSpawn, Argv: req.Argv, Env: mergeEnv(s.cfg.Env, req.Env), Dir: req.Dir, Stdio: stdio,
	}, fds...)
	for _, f := range childEnds {
		f.Close()
	}
	childEnds = nil
	if err != nil {
		for _, f := range parentEnds {
			f.Close()
		}
		return -1, fmt.Errorf("exec %s in %s: %w", req.Argv[0], s.cfg.ID, err)
	}
	var wg sync.WaitGroup
	if stdinW != nil {
		go func() {
			_, _ = io.Copy(stdinW, req.Stdin)
			stdinW.Close()
		}()
	}
	for i, rd := range readers {
		if rd == nil {
			continue
		}
		w := req.Stdout
		if i == 1 {
			w = req.Stderr
		}
		wg.Add(1)
		go func(rd *os.File, w io.Writer) {
			defer wg.Done()
			_, _ = io.Copy(w, rd)
		}(rd, w)
	}
	var st exitStatus
	var ctxErr error
	select {
	case st = <-waiter:
	case <-ctx.Done():
		ctxErr = ctx.Err()
		kctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
		_, _, _ = s.cli.call(kctx, &msg{Op: opKill, PID: r.PID, Sig: int(unix.SIGKILL), Group: true})
		cancel()
		select {
		case st = <-waiter:
		case <-s.cli.dead:
		case <-time.After(10 * time.Second):
		}
	case <-s.cli.dead:
		ctxErr = ErrClosed
	}
	for _, rd := range readers {
		if rd != nil {
			_ = rd.SetReadDeadline(time.Now().Add(outputGrace))
		}
	}
	wg.Wait()
	for _, rd := range readers {
		if rd != nil {
			rd.Close()
		}
	}
	if stdinW != nil {
		stdinW.Close()
	}
	if ctxErr != nil {
		return -1, fmt.Errorf("exec %s in %s: %w", req.Argv[0], s.cfg.ID, ctxErr)
	}
	return st.code(), nil
}
