package fs

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPassthroughLinkAcrossCheckpoint: a file linked while held open with
// passthrough stays linked in the checkpoint and in the live view (the
// checkpoint moves the open file's inode into the new upper).
func TestPassthroughLinkAcrossCheckpoint(t *testing.T) {
	fx := mountT(t, nil, Options{Passthrough: true})
	if err := os.Mkdir(fx.p("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	fh, err := os.Create(fx.p("f"))
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	if _, err := fh.WriteString("one"); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(fx.p("f"), fx.p("d/g")); err != nil {
		t.Fatal(err)
	}
	c1 := fx.checkpoint(t)
	if _, err := fh.WriteString("+two"); err != nil {
		t.Fatal(err)
	}
	// Live: both names are one file.
	if got := mustRead(t, fx.p("d/g")); got != "one+two" {
		t.Errorf("live d/g after a write through f: %q, want %q", got, "one+two")
	}
	if err := fh.Close(); err != nil {
		t.Fatal(err)
	}
	nlinks := func(what string) {
		t.Helper()
		for _, n := range []string{"f", "d/g"} {
			var st unix.Stat_t
			if err := unix.Lstat(fx.p(n), &st); err != nil {
				t.Fatal(err)
			}
			if st.Nlink != 2 {
				t.Errorf("%s: %s has %d links, want 2", what, n, st.Nlink)
			}
		}
		var a, b unix.Stat_t
		if err := unix.Lstat(fx.p("f"), &a); err != nil {
			t.Fatal(err)
		}
		if err := unix.Lstat(fx.p("d/g"), &b); err != nil {
			t.Fatal(err)
		}
		if a.Ino != b.Ino {
			t.Errorf("%s: f and d/g are inodes %d and %d, want one", what, a.Ino, b.Ino)
		}
	}
	nlinks("live")
	fx.restore(t, c1)
	for _, n := range []string{"f", "d/g"} {
		if got := mustRead(t, fx.p(n)); got != "one" {
			t.Errorf("after restoring the checkpoint: %s is %q, want %q", n, got, "one")
		}
	}
	nlinks("after restoring the checkpoint")
	// The frozen layer itself holds one inode under both names.
	var a, b unix.Stat_t
	l := fx.fs.st.frozen[len(fx.fs.st.frozen)-1]
	if err := unix.Lstat(l.path+"/f", &a); err != nil {
		t.Fatal(err)
	}
	if err := unix.Lstat(l.path+"/d/g", &b); err != nil {
		t.Fatal(err)
	}
	if a.Ino != b.Ino || a.Nlink != 2 {
		t.Errorf("frozen layer: f ino %d (%d links), d/g ino %d", a.Ino, a.Nlink, b.Ino)
	}
}

// TestPassthroughLinkAcrossRestore: restoring a checkpoint in which a file
// held open with passthrough had another name gives back the link.
func TestPassthroughLinkAcrossRestore(t *testing.T) {
	fx := mountT(t, nil, Options{Passthrough: true})
	mustWrite(t, fx.p("f"), "one")
	if err := os.Mkdir(fx.p("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Link(fx.p("f"), fx.p("d/g")); err != nil {
		t.Fatal(err)
	}
	c1 := fx.checkpoint(t)
	if err := os.Remove(fx.p("d/g")); err != nil {
		t.Fatal(err)
	}
	fh, err := os.OpenFile(fx.p("f"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer fh.Close()
	if _, err := fh.WriteString("+two"); err != nil {
		t.Fatal(err)
	}
	fx.restore(t, c1) // f is held open (passthrough): its inode follows
	for _, n := range []string{"f", "d/g"} {
		if got := mustRead(t, fx.p(n)); got != "one" {
			t.Errorf("after the restore: %s is %q, want %q", n, got, "one")
		}
	}
	var a, b unix.Stat_t
	if err := unix.Lstat(fx.p("f"), &a); err != nil {
		t.Fatal(err)
	}
	if err := unix.Lstat(fx.p("d/g"), &b); err != nil {
		t.Fatal(err)
	}
	if a.Ino != b.Ino || a.Nlink != 2 || b.Nlink != 2 {
		t.Errorf("after the restore: f ino %d (%d links), d/g ino %d (%d links), want one inode with 2", a.Ino, a.Nlink, b.Ino, b.Nlink)
	}
	if _, err := fh.WriteString("+three"); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, fx.p("d/g")); got != "one+three" {
		t.Errorf("d/g after a write through the open f: %q, want %q", got, "one+three")
	}
}
