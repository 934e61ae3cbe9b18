package sandbox

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// execOut runs argv in sb and returns its stdout, failing on a non-zero exit.
func execOut(t *testing.T, sb *Sandbox, argv ...string) string {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := sb.Exec(testCtx(t), ExecRequest{Argv: argv, Stdout: &out, Stderr: &errb})
	if err != nil || code != 0 {
		t.Fatalf("exec %q: code %d err %v stderr %q", argv, code, err, errb.String())
	}
	return strings.TrimSpace(out.String())
}

// cloneOf returns a detached bind mount of dir (closed at cleanup).
func cloneOf(t *testing.T, dir string, readOnly bool) int {
	t.Helper()
	fd, err := unix.OpenTree(unix.AT_FDCWD, dir, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Close(fd) })
	if readOnly {
		if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH, &unix.MountAttr{Attr_set: unix.MOUNT_ATTR_RDONLY}); err != nil {
			t.Fatal(err)
		}
	}
	return fd
}

// ReplaceRoot makes another tree the sandbox's root, with the old root's
// mounts (/proc, /dev, /run/rewind, binds) on it; a process already
// running keeps its working directory on the old tree. A replacement that
// fails leaves the namespace as it was.
func TestReplaceRoot(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	old := sb.Root()
	if err := os.WriteFile(filepath.Join(old, "tmp", "which"), []byte("old\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "sh", Argv: []string{"sh"}, Dir: "/tmp"})
	if err != nil {
		t.Fatal(err)
	}
	if err := sb.WriteRunFile("before", []byte("kept\n")); err != nil {
		t.Fatal(err)
	}

	// A read-only tree with only the first of the old root's mount points
	// (/proc): the rest cannot be mounted on it, and the sandbox keeps its
	// root, with /proc moved back.
	bare := t.TempDir()
	if err := os.Mkdir(filepath.Join(bare, "proc"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := sb.ReplaceRoot(cloneOf(t, bare, true)); err == nil {
		t.Fatal("replacing the root by a read-only tree without mount points succeeded")
	}
	if got := execOut(t, sb, "sh", "-c", "cat /tmp/which /run/rewind/before; test -r /proc/self/status && echo proc"); got != "old\nkept\nproc" {
		t.Fatalf("after a failed replacement: %q", got)
	}
	for _, p := range []string{"/", "/proc"} {
		if n := mountsAt(t, sb, p); n != 1 {
			t.Fatalf("after a failed replacement, %d mounts at %s, want 1", n, p)
		}
	}

	root := t.TempDir()
	if out, err := exec.Command("cp", "-a", old+"/.", root).CombinedOutput(); err != nil {
		t.Fatalf("cp: %v: %s", err, out)
	}
	if err := os.WriteFile(filepath.Join(root, "tmp", "which"), []byte("new\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := sb.ReplaceRoot(cloneOf(t, root, false)); err != nil {
		t.Fatal(err)
	}
	// New processes: the new tree, with the sandbox's own mounts.
	if got := execOut(t, sb, "sh", "-c", "cat /tmp/which /run/rewind/before; test -r /proc/self/status && test -c /dev/null && echo mounts"); got != "new\nkept\nmounts" {
		t.Fatalf("after the replacement: %q", got)
	}
	// The running shell's cwd (/tmp, below the root) is still the old one.
	out, err := ss.Send(ctx, "cat which; echo done", SendOptions{})
	if err != nil || !strings.HasPrefix(out, "old") {
		t.Fatalf("running shell: %q %v", out, err)
	}
	// The old tree and its mounts are no longer in the namespace.
	for _, p := range []string{"/", "/proc"} {
		if n := mountsAt(t, sb, p); n != 1 {
			t.Fatalf("%d mounts at %s, want 1", n, p)
		}
	}
}

// mountsAt counts the mounts at mount point p in the sandbox's namespace.
func mountsAt(t *testing.T, sb *Sandbox, p string) int {
	t.Helper()
	mi, err := os.ReadFile("/proc/" + strconv.Itoa(sb.InitPID()) + "/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	n := 0
	for _, line := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(line); len(f) > 4 && f[4] == p {
			n++
		}
	}
	return n
}
