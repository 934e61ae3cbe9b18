package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func runRewind(t *testing.T, args ...string) (string, error) {
	t.Helper()
	cmd := newRootCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(args)
	err := cmd.Execute()
	return out.String(), err
}

func TestFSCommands(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.RequireNoErr(t, err, "/dev/fuse")
	dir := t.TempDir()
	state, lower, mp := filepath.Join(dir, "state"), filepath.Join(dir, "lower"), filepath.Join(dir, "mnt")
	for _, d := range []string{lower, mp} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(lower, "base"), []byte("b"), 0o644); err != nil {
		t.Fatal(err)
	}
	served := make(chan error, 1)
	go func() {
		_, err := runRewind(t, "fs", "mount", "--foreground", "--state", state, "--lower", lower, "--id", "clitest", mp)
		served <- err
	}()
	deadline := time.Now().Add(30 * time.Second)
	for {
		if resp, err := fsCall(mp, fsRequest{Op: "status"}); err == nil && resp.Mount == "clitest" {
			break
		}
		select {
		case err := <-served:
			t.Fatalf("server exited: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			t.Fatal("mount not ready after 30s")
		}
		time.Sleep(10 * time.Millisecond)
	}
	t.Cleanup(func() {
		_, _ = runRewind(t, "fs", "umount", mp)
	})
	// A second mount on it is refused: it would sit on the first and take
	// its control link.
	if out, err := runRewind(t, "fs", "mount", "--foreground", "--state", state, "--lower", lower, "--id", "other", mp); err == nil || !strings.Contains(err.Error()+out, "already") {
		t.Fatalf("second mount on %s: %q %v, want it refused", mp, out, err)
	}
	if resp, err := fsCall(mp, fsRequest{Op: "status"}); err != nil || resp.Mount != "clitest" {
		t.Fatalf("the first mount after a refused second one: %+v %v", resp, err)
	}
	if b, err := os.ReadFile(filepath.Join(mp, "base")); err != nil || string(b) != "b" {
		t.Fatalf("read through the mount: %q %v", b, err)
	}
	if err := os.WriteFile(filepath.Join(mp, "f"), []byte("1"), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := runRewind(t, "fs", "checkpoint", "--json", mp)
	if err != nil {
		t.Fatal(err)
	}
	var ck struct {
		ID        string `json:"id"`
		ElapsedUS int64  `json:"elapsed_us"`
	}
	if err := json.Unmarshal([]byte(out), &ck); err != nil || ck.ID == "" {
		t.Fatalf("checkpoint --json: %q %v", out, err)
	}
	if err := os.WriteFile(filepath.Join(mp, "f"), []byte("2"), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := runRewind(t, "fs", "restore", mp, ck.ID); err != nil {
		t.Fatal(err)
	}
	if b, _ := os.ReadFile(filepath.Join(mp, "f")); string(b) != "1" {
		t.Fatalf("after restore: %q", b)
	}
	if _, err := runRewind(t, "fs", "restore", mp, "0000000000000000"); err == nil || !strings.Contains(err.Error(), "not found") {
		t.Fatalf("restore of an unknown id: %v", err)
	}
	out, err = runRewind(t, "fs", "ls", mp)
	if err != nil || !strings.Contains(out, "*"+ck.ID) {
		t.Fatalf("ls: %q %v", out, err)
	}
	if _, err := runRewind(t, "fs", "compact", mp); err != nil {
		t.Fatal(err)
	}
	// The control socket lives in the state dir, root-only, never in the mount.
	if fi, err := os.Stat(filepath.Join(state, "ctl")); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("ctl dir: %v %v", fi, err)
	}
	if _, err := runRewind(t, "fs", "umount", mp); err != nil {
		t.Fatal(err)
	}
	select {
	case err := <-served:
		if err != nil {
			t.Fatalf("server: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("server did not exit after umount")
	}
	if _, err := runRewind(t, "fs", "checkpoint", mp); err == nil {
		t.Fatal("checkpoint after umount succeeded")
	}
}
