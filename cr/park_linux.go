package cr

import (
	"context"
	"errors"
	"fmt"
	"time"

	"golang.org/x/sys/unix"
)

// parkable reports whether procs can be parked (CheckpointOptions.Park):
// a ptrace stop holds one thread, so every process must have one.
func parkable(procs []Proc) bool {
	for _, p := range procs {
		if p.Threads != 1 {
			return false
		}
	}
	return len(procs) > 0
}

// parkCheckpoint takes a ModeParked checkpoint of t: its live processes
// are stopped (barrier runs while they are) and stay stopped, excluded from
// t's live processes, as the checkpoint itself. The sandbox lock is held.
func (e *Engine) parkCheckpoint(ctx context.Context, t Target, rec Checkpoint, barrier func() error) (*Checkpoint, error) {
	start := time.Now()
	procs := rec.Procs
	var err error
	for attempt := 0; ; attempt++ {
		ran := false
		b := func() error {
			ran = true
			if barrier != nil {
				return barrier()
			}
			return nil
		}
		var parked []*template
		parked, err = e.parkProcs(ctx, t, procs, b)
		if err == nil {
			c := &ckpt{rec: rec, parked: parked}
			c.rec.Procs, c.rec.Mode, c.rec.Frozen = procs, ModeParked, time.Since(start)
			e.add(c)
			return &c.rec, nil
		}
		// A process that exits while being stopped fails the attempt; as
		// long as the barrier has not run, list again and retry.
		if ran || attempt == 2 || ctx.Err() != nil {
			break
		}
		e.log.Debug("park retry", "checkpoint", rec.ID, "err", err)
		if procs, err = e.processes(t); err != nil {
			break
		}
		if !parkable(procs) {
			err = errors.New("processes changed during the checkpoint")
			break
		}
	}
	return nil, fmt.Errorf("checkpoint %s: park: %w", rec.ID, err)
}

// parkProcs stops procs (stopProcs) and makes them helpers of the engine
// (e.aux) before the sandbox lock is released, so that no listing of t's
// live processes counts them.
func (e *Engine) parkProcs(ctx context.Context, t Target, procs []Proc, barrier func() error) ([]*template, error) {
	live, err := e.stopProcs(ctx, t, procs, barrier)
	if err != nil {
		return nil, err
	}
	out := make([]*template, len(live))
	e.mu.Lock()
	for i, ip := range live {
		e.aux[ip.Pid()] = t.ID()
		out[i] = &template{sandbox: t.ID(), orig: procs[i], proc: ip}
	}
	e.mu.Unlock()
	return out, nil
}

// resumeParked restores ModeParked checkpoint c: t's live processes are
// killed, the fs switched, the parked processes get fresh stdio where
// opts.Stdio gives some, and run on from where they were stopped. The
// checkpoint holds no processes afterwards (a second restore of it fails).
// The sandbox lock is held.
func (e *Engine) resumeParked(ctx context.Context, t Target, c *ckpt, opts RestoreOptions) ([]Restored, error) {
	e.mu.Lock()
	tms := c.parked
	e.mu.Unlock()
	if len(tms) == 0 {
		return nil, errors.New("the parked processes are gone (resumed or dropped)")
	}
	// SIGKILL reaches a stopped tracee: one killed from inside the
	// sandbox meanwhile is lost, and so is the checkpoint. Fail before
	// anything is killed.
	for _, tm := range tms {
		if exiting(tm.proc.Pid()) {
			return nil, fmt.Errorf("parked process %d (%s) was killed", tm.proc.Pid(), tm.orig.Comm)
		}
	}
	if _, err := e.killLive(ctx, t, nil); err != nil {
		return nil, err
	}
	if opts.SwitchFS != nil {
		if err := opts.SwitchFS(); err != nil {
			return nil, fmt.Errorf("switch fs: %w", err)
		}
	}
	sts := make([]*Stdio, len(tms))
	out := make([]Restored, 0, len(tms))
	err := e.tracer.Do(func() error {
		for i, tm := range tms {
			if opts.Stdio == nil {
				continue
			}
			st, err := opts.Stdio(tm.orig)
			if err != nil {
				return fmt.Errorf("stdio for %d: %w", tm.orig.PID, err)
			}
			sts[i] = st
			if st == nil {
				continue
			}
			if err := tm.proc.SetStdio([3]string{st.Stdin, st.Stdout, st.Stderr}, [3]int{unix.O_RDONLY, unix.O_WRONLY, unix.O_WRONLY}); err != nil {
				return err
			}
		}
		e.mu.Lock()
		c.parked = nil
		for _, tm := range tms {
			delete(e.aux, tm.proc.Pid())
		}
		e.mu.Unlock()
		var errs []error
		for _, tm := range tms {
			if err := tm.proc.Detach(); err != nil {
				errs = append(errs, err)
				continue
			}
			out = append(out, Restored{Orig: tm.orig, PID: tm.proc.Pid()})
		}
		return errors.Join(errs...)
	})
	if err != nil {
		return out, err
	}
	for i, st := range sts {
		if st != nil && st.Started != nil {
			if err := st.Started(tms[i].proc.Pid()); err != nil {
				return out, fmt.Errorf("started hook for %d: %w", tms[i].proc.Pid(), err)
			}
		}
	}
	return out, nil
}
