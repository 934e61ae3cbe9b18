package fs

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestLowerHidesSubmounts mounts a view over a lower directory that has
// another directory bind-mounted below it (as the host's root has the
// daemon's state dir reachable through someone's bind of "/"): the view
// shows the mount point as the plain, empty directory under it, as an
// overlayfs lower layer does, never the mounted tree — the sandbox's masks
// go by path and would not cover it there. The lower's own files stay
// visible, and a copy-up of one still works.
func TestLowerHidesSubmounts(t *testing.T) {
	secret := filepath.Join(t.TempDir(), "secret")
	mustWrite(t, filepath.Join(secret, "state.db"), "other sandboxes' data\n")
	var sub string
	fx := mountT(t, func(lower string) {
		mustWrite(t, filepath.Join(lower, "etc", "hostname"), "host\n")
		sub = filepath.Join(lower, "mnt", "other")
		if err := os.MkdirAll(sub, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.Mount(secret, sub, "", unix.MS_BIND, ""); err != nil {
			t.Fatalf("bind: %v", err)
		}
		t.Cleanup(func() { unix.Unmount(sub, unix.MNT_DETACH) })
	}, Options{})
	if got := mustRead(t, filepath.Join(sub, "state.db")); got == "" {
		t.Fatal("the bind under the lower does not show on the host")
	}
	ents, err := os.ReadDir(fx.p("mnt/other"))
	if err != nil {
		t.Fatalf("mount point in the view: %v", err)
	}
	if len(ents) != 0 {
		t.Errorf("the view shows the tree mounted under its lower: %v", ents)
	}
	if _, err := os.Stat(fx.p("mnt/other/state.db")); !os.IsNotExist(err) {
		t.Errorf("stat of a file of the submount through the view: %v, want not exist", err)
	}
	if got := mustRead(t, fx.p("etc/hostname")); got != "host\n" {
		t.Errorf("lower file: %q", got)
	}
	mustWrite(t, fx.p("etc/hostname"), "view\n")
	if got := mustRead(t, filepath.Join(fx.lower, "etc", "hostname")); got != "host\n" {
		t.Errorf("a write through the view reached the lower: %q", got)
	}
}

// TestMergedDirLinkCount: a directory whose upper copy was made by a
// metadata change (chmod) while its subdirectories stay in a frozen layer
// reported the upper's link count (2) instead of 2 + its subdirectories;
// a merged directory now says 1, as overlayfs does, and one held by a
// single layer keeps its real count.
func TestMergedDirLinkCount(t *testing.T) {
	fx := mountT(t, nil, Options{})
	for _, d := range []string{"m/deep/er", "m/deep/er2"} {
		if err := os.MkdirAll(fx.p(d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	nlink := func(p string) uint64 {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(fx.p(p), &st); err != nil {
			t.Fatal(err)
		}
		return uint64(st.Nlink)
	}
	if n := nlink("m/deep"); n != 4 {
		t.Fatalf("before the checkpoint: nlink %d, want 4", n)
	}
	fx.checkpoint(t)
	if n := nlink("m/deep"); n != 4 {
		t.Fatalf("in a frozen layer: nlink %d, want 4", n)
	}
	if err := os.Chmod(fx.p("m/deep"), 0o1777); err != nil {
		t.Fatal(err)
	}
	if n := nlink("m/deep"); n != 1 && n != 4 {
		t.Errorf("merged after a chmod: nlink %d, want 1 (unknown) or the real 4", n)
	}
	ents, err := os.ReadDir(fx.p("m/deep"))
	if err != nil || len(ents) != 2 {
		t.Errorf("merged listing: %v %v", ents, err)
	}
}
