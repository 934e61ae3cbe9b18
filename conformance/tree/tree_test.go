package tree

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// populate builds a tree with every entry type the snapshot records.
func populate(t *testing.T, root string) {
	t.Helper()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.MkdirAll(filepath.Join(root, "d/sub"), 0o750))
	must(os.WriteFile(filepath.Join(root, "d/a.txt"), []byte("hello\n"), 0o640))
	must(os.WriteFile(filepath.Join(root, "big"), make([]byte, 1<<20), 0o600))
	must(os.Link(filepath.Join(root, "d/a.txt"), filepath.Join(root, "d/sub/a-link")))
	must(os.Symlink("/etc/passwd", filepath.Join(root, "escape")))
	must(os.Symlink("../a.txt", filepath.Join(root, "d/sub/rel")))
	must(unix.Mkfifo(filepath.Join(root, "fifo"), 0o644))
	if err := unix.Setxattr(filepath.Join(root, "d/a.txt"), "user.k", []byte("v1"), 0); err != nil && err != unix.ENOTSUP {
		t.Fatal(err)
	}
}

func TestTakeAndCompare(t *testing.T) {
	a := t.TempDir()
	populate(t, a)
	snapA, err := Take(a, Options{IgnoreRoot: true})
	if err != nil {
		t.Fatal(err)
	}
	byPath := map[string]Entry{}
	for _, e := range snapA {
		byPath[e.Path] = e
	}
	tests := []struct {
		path  string
		check func(Entry) bool
	}{
		{"d", func(e Entry) bool { return e.Type == "dir" && e.Mode == 0o750 }},
		{"d/a.txt", func(e Entry) bool {
			return e.Type == "file" && e.Size == 6 && e.Mode == 0o640 && e.Nlink == 2 && e.LinkGroup == "d/a.txt" &&
				e.Hash == "5891b5b522d5df086d0ff0b110fbd9d21bb4fc7163af34d08286a2e846f6be03"
		}},
		{"d/sub/a-link", func(e Entry) bool { return e.LinkGroup == "d/a.txt" && e.Nlink == 2 }},
		{"escape", func(e Entry) bool { return e.Type == "symlink" && e.Target == "/etc/passwd" }},
		{"d/sub/rel", func(e Entry) bool { return e.Type == "symlink" && e.Target == "../a.txt" }},
		{"fifo", func(e Entry) bool { return e.Type == "fifo" }},
		{"big", func(e Entry) bool { return e.Size == 1<<20 && e.Nlink == 1 && e.LinkGroup == "" }},
	}
	for _, tt := range tests {
		e, ok := byPath[tt.path]
		if !ok || !tt.check(e) {
			t.Errorf("entry %q = %+v (found %v)", tt.path, e, ok)
		}
	}
	if _, ok := byPath[""]; ok {
		t.Error("IgnoreRoot kept the root")
	}
	if x := byPath["d/a.txt"].Xattrs["user.k"]; x != "v1" {
		t.Logf("user xattr not recorded (file system without user xattrs?): %q", x)
	}

	// A faithful copy compares equal.
	b := filepath.Join(t.TempDir(), "copy")
	if out, err := exec.Command("cp", "-a", a, b).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
	snapB, err := Take(b, Options{IgnoreRoot: true})
	if err != nil {
		t.Fatal(err)
	}
	if d := Diff(snapA, snapB, 0); len(d) != 0 {
		t.Fatalf("copy differs:\n%s", strings.Join(d, "\n"))
	}
	if snapA.Digest() != snapB.Digest() {
		t.Fatal("equal snapshots have different digests")
	}

	// Each kind of change is detected and names its path.
	changes := []struct {
		name   string
		change func() error
		want   string
	}{
		{"content", func() error { return os.WriteFile(filepath.Join(b, "d/a.txt"), []byte("hellO\n"), 0o640) }, "d/a.txt"},
		{"mode", func() error { return os.Chmod(filepath.Join(b, "big"), 0o644) }, "big"},
		{"unlink breaks link group", func() error { return os.Remove(filepath.Join(b, "d/sub/a-link")) }, "d/sub/a-link"},
		{"symlink target", func() error {
			os.Remove(filepath.Join(b, "escape"))
			return os.Symlink("/etc/shadow", filepath.Join(b, "escape"))
		}, "escape"},
		{"new file", func() error { return os.WriteFile(filepath.Join(b, "new"), nil, 0o644) }, "new"},
	}
	for _, c := range changes {
		if err := c.change(); err != nil {
			t.Fatalf("%s: %v", c.name, err)
		}
		snapC, err := Take(b, Options{IgnoreRoot: true})
		if err != nil {
			t.Fatal(err)
		}
		d := Diff(snapA, snapC, 0)
		if len(d) == 0 || !strings.Contains(strings.Join(d, "\n"), `"`+c.want+`"`) {
			t.Errorf("%s: diff %q does not name %q", c.name, d, c.want)
		}
		snapA = snapC
	}
}

func TestExcludeAndNoFollow(t *testing.T) {
	root := t.TempDir()
	outside := t.TempDir()
	if err := os.WriteFile(filepath.Join(outside, "secret"), []byte("x"), 0o600); err != nil {
		t.Fatal(err)
	}
	// A symlinked directory must not be descended into.
	if err := os.Symlink(outside, filepath.Join(root, "link")); err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(root, "skip/me"), 0o755); err != nil {
		t.Fatal(err)
	}
	snap, err := Take(root, Options{Exclude: []string{"skip"}})
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range snap {
		if strings.Contains(e.Path, "secret") || strings.HasPrefix(e.Path, "skip") {
			t.Errorf("snapshot contains %q", e.Path)
		}
	}
	if len(snap) != 2 { // the root and the symlink
		t.Errorf("snapshot = %v, want root + link", snap)
	}
}
