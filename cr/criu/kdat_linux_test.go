package criu

import (
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// killRun ends a wrapper and its child (criu) however blocked they are.
func TestKillRunEndsWrapperAndChild(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := exec.Command("mkfifo", fifo).Run(); err != nil {
		t.Fatal(err)
	}
	// Like the wrapper: write the pid, then wait for a child blocked in
	// open(2) of a FIFO nobody writes.
	cmd := exec.Command("sh", "-c", `echo $$ >"$0/`+wrapperPidName+`"; cat "$0/fifo" & wait`, dir)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	var kid int
	deadline := time.Now().Add(10 * time.Second)
	for kid == 0 && time.Now().Before(deadline) {
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(cmd.Process.Pid) + "/task/" + strconv.Itoa(cmd.Process.Pid) + "/children")
		if f := strings.Fields(string(b)); len(f) == 1 {
			kid, _ = strconv.Atoi(f[0])
		}
		time.Sleep(5 * time.Millisecond)
	}
	if kid == 0 {
		t.Fatal("no child")
	}
	for !killRun(dir) {
		if time.Now().After(deadline) {
			t.Fatal("no wrapper pid")
		}
		time.Sleep(5 * time.Millisecond)
	}
	select {
	case <-done:
	case <-time.After(10 * time.Second):
		t.Fatal("wrapper still running")
	}
	for time.Now().Before(deadline) {
		if b, err := os.ReadFile("/proc/" + strconv.Itoa(kid) + "/stat"); err != nil || strings.Contains(string(b), ") Z ") {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
	t.Fatal("child still running")
}
