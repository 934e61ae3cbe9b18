package criu

import (
	"bufio"
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// A mount namespace whose program interpreter is junk (as a hostile sandbox
// could make its own): criu started there by the runner (command,
// startInNamespaces) must still start, with the host's loader and libraries
// (a dynamic criu) or with none (a static one, as scripts/deps.sh builds).
func TestCommandUsesHostLoader(t *testing.T) {
	testenv.RequireRoot(t)
	r, err := NewRunner("", "")
	testenv.RequireNoErr(t, err, "criu")
	t.Cleanup(func() { r.Close() })
	ld := "/lib64/ld-linux-x86-64.so.2" // what the namespace's programs use
	if r.libs != nil {
		ld = r.libs.ld.Name()
	}
	interp, err := filepath.EvalSymlinks(ld)
	if err != nil {
		t.Fatal(err)
	}
	junk := filepath.Join(t.TempDir(), "ld.so")
	if err := os.WriteFile(junk, []byte("not a loader\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	// The namespace's init is a shell that binds the junk over the loader
	// and then only reads (a builtin: it never execs again).
	target := exec.Command("unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc",
		"sh", "-c", `mount --bind "$0" "$1" && echo ready && read x`, junk, interp)
	stdin, err := target.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	stdout, err := target.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := target.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { stdin.Close(); _ = target.Process.Kill(); _ = target.Wait() })
	line, err := bufio.NewReader(stdout).ReadString('\n')
	if err != nil || strings.TrimSpace(line) != "ready" {
		t.Fatalf("target: %q %v", line, err)
	}
	b, err := os.ReadFile("/proc/" + strconv.Itoa(target.Process.Pid) + "/task/" + strconv.Itoa(target.Process.Pid) + "/children")
	if err != nil {
		t.Fatal(err)
	}
	nsInit, err := strconv.Atoi(strings.TrimSpace(string(b)))
	if err != nil {
		t.Fatalf("namespace init of unshare %d: %q", target.Process.Pid, b)
	}
	// The junk is really what the namespace runs.
	if out, err := exec.Command("nsenter", "-t", strconv.Itoa(nsInit), "-m", "--", "/bin/true").CombinedOutput(); err == nil {
		t.Fatalf("a dynamic program ran with the junk loader in place: %s", out)
	}
	bin, err := os.Open(r.Path)
	if err != nil {
		t.Fatal(err)
	}
	defer bin.Close()
	dir, err := os.Open(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	defer dir.Close()
	run, runDone, err := r.runDir(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	defer runDone()
	defer run.Close()
	cmd := r.command("--version")
	cmd.ExtraFiles = append(append([]*os.File{bin, dir}, r.libs.files()...), run)
	var out bytes.Buffer
	cmd.Stdout, cmd.Stderr = &out, &out
	done := make(chan error, 1)
	if err := startInNamespaces(nsInit, cmd); err != nil {
		t.Fatal(err)
	}
	go func() { done <- cmd.Wait() }()
	select {
	case err = <-done:
	case <-time.After(time.Minute):
		_ = cmd.Process.Kill()
		t.Fatal("criu --version in the namespace hangs")
	}
	if err != nil || !strings.Contains(out.String(), "Version:") {
		t.Fatalf("criu in the namespace: %v: %s", err, out.String())
	}
}

// A runner given a run root empties it first (a killed daemon's runs left
// their private directories there) and removes it on Close; without one it
// makes a temp dir of its own and removes that.
func TestRunnerRunRoot(t *testing.T) {
	root := filepath.Join(t.TempDir(), "criu-run")
	stale := filepath.Join(root, "run-123", "criu.kdat")
	if err := os.MkdirAll(filepath.Dir(stale), 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(stale, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	r, err := NewRunner("", root)
	testenv.RequireNoErr(t, err, "criu")
	if r.RunRoot != root {
		t.Errorf("RunRoot %q, want %q", r.RunRoot, root)
	}
	if ents, err := os.ReadDir(root); err != nil || len(ents) != 0 {
		t.Errorf("run root after NewRunner: %v entries, err %v; want it empty", len(ents), err)
	}
	r.Close()
	if _, err := os.Stat(root); !os.IsNotExist(err) {
		t.Errorf("run root after Close: %v, want it removed", err)
	}

	r, err = NewRunner("", "")
	if err != nil {
		t.Fatal(err)
	}
	own := r.RunRoot
	if fi, err := os.Stat(own); err != nil || !fi.IsDir() {
		t.Fatalf("own run root %q: %v", own, err)
	}
	r.Close()
	if _, err := os.Stat(own); !os.IsNotExist(err) {
		t.Errorf("own run root after Close: %v, want it removed", err)
	}
}
