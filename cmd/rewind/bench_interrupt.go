package main

import (
	"context"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sync"
	"sync/atomic"
	"syscall"
)

// onInterrupt returns a context canceled at the first SIGINT or SIGTERM,
// so that a benchmark stops and removes what it made (sandboxes, mounts,
// shells, temp dirs) before the command exits. At that signal it writes
// "interrupted; cleaning up" to w and gives the signal back its default
// action, so a second one ends the process at once. exitCode is the exit
// status the command should end with: 128 + the signal's number, or 0
// when none came. stop releases the signals and cancels the context.
func onInterrupt(parent context.Context, w io.Writer) (ctx context.Context, exitCode func() int, stop func()) {
	ctx, cancel := context.WithCancel(parent)
	sig := make(chan os.Signal, 1)
	signal.Notify(sig, os.Interrupt, syscall.SIGTERM)
	done := make(chan struct{})
	var code atomic.Int32
	go func() {
		select {
		case s := <-sig:
			signal.Stop(sig)
			n := int(syscall.SIGINT)
			if ss, ok := s.(syscall.Signal); ok {
				n = int(ss)
			}
			code.Store(int32(128 + n))
			fmt.Fprintln(w, "interrupted; cleaning up (interrupt again to quit at once, leaving it)")
			cancel()
		case <-done:
		}
	}()
	var once sync.Once
	stop = func() {
		once.Do(func() {
			signal.Stop(sig)
			close(done)
			cancel()
		})
	}
	return ctx, func() int { return int(code.Load()) }, stop
}

// interrupted turns err, the error of a benchmark run under onInterrupt's
// context, into the command's exit status when a signal caused it (after
// saying the cleanup is done), and returns err otherwise.
func interrupted(err error, exitCode func() int, w io.Writer) error {
	if c := exitCode(); c != 0 {
		fmt.Fprintln(w, "interrupted: cleaned up")
		return exitError{c}
	}
	return err
}
