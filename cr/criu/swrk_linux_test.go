package criu

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v8/rpc"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

// startStandIn starts script, written to dir as a stand-in for criu,
// through startSwrk, as a dump would start criu.
func startStandIn(t *testing.T, dir, script string) *swrk {
	t.Helper()
	fake := filepath.Join(dir, "criu")
	if err := os.WriteFile(fake, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	bin, err := os.Open(fake)
	if err != nil {
		t.Fatal(err)
	}
	defer bin.Close()
	img, err := os.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer img.Close()
	r := &Runner{Path: fake}
	s, err := r.startSwrk(os.Getpid(), false, map[string]*os.File{"00-criu-binary": bin, "01-images-dir": img})
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// TestSwrkStartsInNamespacesAndCancels runs a stand-in for criu through
// startSwrk: it gets the hardening arguments before "swrk" and only the
// environment the runner gives it (not the caller's CRIU_CONFIG_FILE), is
// started from a thread that entered the target's namespaces (here the
// test's own, which setns accepts), and a call whose context ends kills it
// however it is blocked: here in open(2) of a FIFO nobody writes.
func TestSwrkStartsInNamespacesAndCancels(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CRIU_CONFIG_FILE", "/etc/evil.conf")
	s := startStandIn(t, dir, "#!/bin/sh\necho \"$@\" >"+dir+"/args\n/usr/bin/env >"+dir+"/env\nexec /bin/cat "+fifo+"\n")
	read := func(name string) string {
		deadline := time.Now().Add(10 * time.Second)
		for {
			b, err := os.ReadFile(filepath.Join(dir, name))
			if err == nil && len(b) > 0 {
				return string(b)
			}
			if time.Now().After(deadline) {
				t.Fatalf("the stand-in wrote no %s: %v", name, err)
			}
			time.Sleep(5 * time.Millisecond)
		}
	}
	if got, want := strings.TrimSpace(read("args")), "--no-default-config --unprivileged --libdir /proc/self/fd/5 swrk 5"; got != want {
		t.Errorf("arguments %q, want %q", got, want)
	}
	env := read("env")
	if !strings.Contains(env, "CRIU_FAULT="+noBreakpoints+"\n") || strings.Contains(env, "CRIU_CONFIG_FILE") {
		t.Errorf("environment:\n%s", env)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	err := s.call(ctx, rpc.CriuReqType_DUMP, baseOpts(DumpLog), nil)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("call: %v, want the context's deadline", err)
	}
	if err := s.close(); err == nil {
		t.Error("close: nil error for a killed criu")
	}
	if d := time.Since(start); d > killedWait {
		t.Errorf("cancel and close took %s", d)
	}
	if err := unix.Kill(s.cmd.Process.Pid, 0); err == nil {
		t.Errorf("the stand-in %d still exists", s.cmd.Process.Pid)
	}
}

// TestSwrkCancelWithHelperHoldingTheSocket: a criu killed while a helper
// it forked is alive (kerndat's ptrace test child, which sleeps until criu
// kills it) leaves that helper holding criu's end of the socket. A call
// whose context ends must return all the same, and the helper must die
// with criu. Before, the call waited for criu's answer for ever (a CI run
// hung there).
func TestSwrkCancelWithHelperHoldingTheSocket(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := unix.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	// The helper inherits every descriptor, the socket among them.
	s := startStandIn(t, dir, "#!/bin/sh\n/bin/sleep 1000 &\necho $! >"+dir+"/helper\nexec /bin/cat "+fifo+"\n")
	var helper int
	for deadline := time.Now().Add(10 * time.Second); helper == 0; time.Sleep(5 * time.Millisecond) {
		b, _ := os.ReadFile(filepath.Join(dir, "helper"))
		helper, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		if time.Now().After(deadline) {
			t.Fatal("the stand-in started no helper")
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 200*time.Millisecond)
	defer cancel()
	done := make(chan error, 1)
	go func() { done <- s.call(ctx, rpc.CriuReqType_DUMP, baseOpts(DumpLog), nil) }()
	select {
	case err := <-done:
		if !errors.Is(err, context.DeadlineExceeded) {
			t.Fatalf("call: %v, want the context's deadline", err)
		}
	case <-time.After(10 * time.Second):
		unix.Kill(helper, unix.SIGKILL)
		t.Fatal("the call still waits for criu 10 s after its context ended")
	}
	s.close()
	// The helper is not our child: it is gone once it is a zombie or
	// reaped (by init).
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
		st, err := os.ReadFile("/proc/" + strconv.Itoa(helper) + "/stat")
		if err != nil || strings.Contains(string(st), ") Z ") {
			break
		}
		if time.Now().After(deadline) {
			unix.Kill(helper, unix.SIGKILL)
			t.Fatalf("the helper %d outlived criu", helper)
		}
	}
}
