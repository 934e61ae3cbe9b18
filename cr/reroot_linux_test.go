package cr

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/sandbox"
)

// TestRealSandboxRerootTemplate: a restore whose fs switch replaces the
// sandbox's root mount (Reroot, as the stock-kernel native overlay does)
// and which has no image forks the templates, and each copy re-enters its
// working directory and reopens its open files by path in the new root.
func TestRealSandboxRerootTemplate(t *testing.T) {
	sb := startReal(t)
	ctx := ctxT(t)
	e := newEngine(t, Config{}) // templates only: no image to restore from
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/"}); err != nil {
		t.Fatal(err)
	}
	send := func(cmd string) string {
		t.Helper()
		out, err := sb.Session("main").Send(ctx, cmd, sandbox.SendOptions{})
		if err != nil {
			t.Fatalf("send %q: %v", cmd, err)
		}
		return out
	}
	send("mkdir -p /tmp/x && cd /tmp/x && echo a > log && exec 3>>/tmp/x/log && V=1")
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c1"}); err != nil {
		t.Fatal(err)
	}
	send("cd / && V=2")
	// The new root: a copy of the old one, plus a marker.
	old := sb.Root()
	root := t.TempDir()
	if out, err := exec.Command("cp", "-a", old+"/.", root).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	if err := os.WriteFile(filepath.Join(root, "tmp/x/marker"), []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	switched := false
	res, err := e.Restore(ctx, sb, "c1", RestoreOptions{
		Reroot: true,
		Stdio:  sessionStdio(ctx, sb, "main"),
		SwitchFS: func() error {
			mfd, err := unix.OpenTree(unix.AT_FDCWD, root, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
			if err != nil {
				return err
			}
			defer unix.Close(mfd)
			switched = true
			return sb.ReplaceRoot(mfd)
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "template" || !switched {
		t.Fatalf("path %q switched %v", res.Path, switched)
	}
	if got := send(`echo "$PWD $V $(cat marker) $(test -r /proc/self/status && test -d /run/rewind && echo mounts)"; echo b >&3`); got != "/tmp/x 1 new mounts\n" {
		t.Fatalf("restored copy: %q", got)
	}
	if b, _ := os.ReadFile(filepath.Join(root, "tmp/x/log")); string(b) != "a\nb\n" {
		t.Fatalf("new root's log: %q (the reopened fd 3 writes there)", b)
	}
	if b, _ := os.ReadFile(filepath.Join(old, "tmp/x/log")); string(b) != "a\n" {
		t.Fatalf("old root's log: %q", b)
	}
	// New processes start in the new root too.
	code, err := sb.Exec(ctx, sandbox.ExecRequest{Argv: []string{"test", "-e", "/tmp/x/marker"}})
	if err != nil || code != 0 {
		t.Fatalf("exec in the new root: %d %v", code, err)
	}
}

// Files of pseudo file systems are not reopened by path in a copy; files
// of real ones (here a tmpfs and the test's temporary directory) are.
// A path whose file system cannot be told counts as pseudo.
func TestPseudoFS(t *testing.T) {
	f, err := os.Create(filepath.Join(t.TempDir(), "f"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	shm, err := os.CreateTemp("/dev/shm", "rewind-pseudofs-")
	if err != nil {
		t.Fatal(err)
	}
	defer os.Remove(shm.Name())
	defer shm.Close()
	sysf, err := os.Open("/sys/devices/system/cpu/online")
	if err != nil {
		t.Fatal(err)
	}
	defer sysf.Close()
	for _, tc := range []struct {
		path   string
		pseudo bool
	}{
		{"/proc/self/status", true},
		{fmt.Sprintf("/proc/self/fd/%d", sysf.Fd()), true},
		{fmt.Sprintf("/proc/self/fd/%d", f.Fd()), false},
		{fmt.Sprintf("/proc/self/fd/%d", shm.Fd()), false},
		{"/nonexistent/rewind", true},
	} {
		if got := pseudoFS(tc.path); got != tc.pseudo {
			t.Errorf("pseudoFS(%s) = %v, want %v", tc.path, got, tc.pseudo)
		}
	}
}
