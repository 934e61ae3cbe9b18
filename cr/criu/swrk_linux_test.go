package criu

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/checkpoint-restore/go-criu/v8/rpc"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

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
	fake := filepath.Join(dir, "criu")
	script := "#!/bin/sh\necho \"$@\" >" + dir + "/args\n/usr/bin/env >" + dir + "/env\nexec /bin/cat " + fifo + "\n"
	if err := os.WriteFile(fake, []byte(script), 0o700); err != nil {
		t.Fatal(err)
	}
	t.Setenv("CRIU_CONFIG_FILE", "/etc/evil.conf")
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
	err = s.call(ctx, rpc.CriuReqType_DUMP, baseOpts(DumpLog), nil)
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

// TestRaiseLastPID: a new PID namespace's counter goes to the upper half of
// pid_max, and stays where it is on a second call.
func TestRaiseLastPID(t *testing.T) {
	testenv.RequireRoot(t)
	target := exec.Command("unshare", "--pid", "--fork", "sleep", "60")
	if err := target.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = target.Process.Kill(); _ = target.Wait() })
	var nsInit int
	deadline := time.Now().Add(10 * time.Second)
	for nsInit == 0 && time.Now().Before(deadline) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(target.Process.Pid) + "/task/" + strconv.Itoa(target.Process.Pid) + "/children")
		nsInit, _ = strconv.Atoi(strings.TrimSpace(string(b)))
		time.Sleep(5 * time.Millisecond)
	}
	if nsInit == 0 {
		t.Fatal("no namespace init")
	}
	lastPID := func() int {
		t.Helper()
		out, err := exec.Command("nsenter", "-t", strconv.Itoa(nsInit), "-p", "--", "cat", "/proc/sys/kernel/ns_last_pid").Output()
		if err != nil {
			t.Fatal(err)
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(out)))
		if err != nil {
			t.Fatal(err)
		}
		return n
	}
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	pidMax, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if l := lastPID(); l >= pidMax/2 {
		t.Fatalf("a new namespace's counter is %d already", l)
	}
	if err := RaiseLastPID(nsInit); err != nil {
		t.Fatal(err)
	}
	first := lastPID()
	if first < pidMax/2 || first >= pidMax*3/4+1 {
		t.Fatalf("counter %d, want within [%d, %d]", first, pidMax/2, pidMax*3/4)
	}
	if err := RaiseLastPID(nsInit); err != nil {
		t.Fatal(err)
	}
	// Each read takes a pid (a cat): the test's and the second call's.
	if got := lastPID(); got != first+2 {
		t.Fatalf("counter %d after a second call, want %d (moved only by the two reads)", got, first+2)
	}
}
