package main

import (
	"bytes"
	"context"
	"errors"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

// syncBuffer is a bytes.Buffer safe for the signal goroutine's write.
type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

// TestOnInterrupt: a SIGTERM cancels the benchmark's context, says so, and
// makes the command exit 128+15 once cleaned up; without a signal, stop
// cancels it and the command's own error stands.
func TestOnInterrupt(t *testing.T) {
	var w syncBuffer
	ctx, code, stop := onInterrupt(context.Background(), &w)
	if err := syscall.Kill(syscall.Getpid(), syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ctx.Done():
	case <-time.After(time.Minute): // a failsafe, not a timing assertion
		t.Fatal("SIGTERM did not cancel the context")
	}
	stop()
	if code() != 143 || !strings.Contains(w.String(), "interrupted; cleaning up") {
		t.Fatalf("exit code %d, stderr %q", code(), w.String())
	}
	var ee exitError
	if err := interrupted(ctx.Err(), code, &w); !errors.As(err, &ee) || ee.code != 143 || !strings.Contains(w.String(), "cleaned up") {
		t.Fatalf("interrupted: %v, stderr %q", err, w.String())
	}

	ctx, code, stop = onInterrupt(context.Background(), &w)
	stop()
	stop() // twice is fine
	if ctx.Err() == nil || code() != 0 {
		t.Fatalf("after stop: ctx %v, code %d", ctx.Err(), code())
	}
	boom := errors.New("boom")
	if err := interrupted(boom, code, &w); err != boom {
		t.Fatalf("interrupted without a signal: %v", err)
	}
}
