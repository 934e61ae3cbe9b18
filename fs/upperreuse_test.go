package fs

import (
	"os"
	"strconv"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRestoreDiscardsRootChange: the root directory lives in the upper
// itself (a change to it needs no copy-up); a restore must still discard
// an un-checkpointed change to it, also when the restores before it kept
// an untouched upper.
func TestRestoreDiscardsRootChange(t *testing.T) {
	for _, tc := range []struct {
		name   string
		change func(t *testing.T, root string)
		check  func(root string) (bool, error) // reports whether the change is visible
	}{
		{"chmod", func(t *testing.T, root string) {
			if err := os.Chmod(root, 0o700); err != nil {
				t.Fatal(err)
			}
		}, func(root string) (bool, error) {
			st, err := os.Stat(root)
			return err == nil && st.Mode().Perm() == 0o700, err
		}},
		{"setxattr", func(t *testing.T, root string) {
			if err := unix.Setxattr(root, "user.k", []byte("v"), 0); err != nil {
				t.Fatal(err)
			}
		}, func(root string) (bool, error) {
			sz, err := unix.Getxattr(root, "user.k", nil)
			if err == unix.ENODATA {
				return false, nil
			}
			return sz > 0, err
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			fx := mountT(t, func(l string) { mustWrite(t, l+"/f", "x") }, Options{})
			a := fx.checkpoint(t)
			fx.restore(t, a)
			fx.restore(t, a)
			tc.change(t, fx.mp)
			if got, err := tc.check(fx.mp); err != nil || !got {
				t.Fatalf("change not visible before the restore (err %v)", err)
			}
			fx.restore(t, a)
			got, err := tc.check(fx.mp)
			if err != nil {
				t.Fatal(err)
			}
			if got {
				t.Fatal("un-checkpointed change to the root survived a restore")
			}
		})
	}
}

// TestRestoreOverUntouchedUpper: restores with nothing written in between
// (the upper stays empty and is kept), then a write, then more restores:
// each view is the checkpoint's.
func TestRestoreOverUntouchedUpper(t *testing.T) {
	fx := mountT(t, func(l string) { mustWrite(t, l+"/f", "lower") }, Options{})
	a := fx.checkpoint(t)
	mustWrite(t, fx.p("f"), "b")
	b := fx.checkpoint(t)
	for i, step := range []struct {
		id, want string
	}{{a, "lower"}, {b, "b"}, {b, "b"}, {a, "lower"}, {a, "lower"}, {b, "b"}} {
		fx.restore(t, step.id)
		if got := mustRead(t, fx.p("f")); got != step.want {
			t.Fatalf("step %d: restore to %s: f = %q, want %q", i, step.id, got, step.want)
		}
	}
	// A change made after restores that kept the upper is discarded by
	// the next restore, and a checkpoint of it keeps it.
	mustWrite(t, fx.p("g"), "new")
	fx.restore(t, a)
	if _, err := os.Stat(fx.p("g")); !os.IsNotExist(err) {
		t.Fatalf("g after restore: %v, want it gone", err)
	}
	mustWrite(t, fx.p("g"), "kept")
	c := fx.checkpoint(t)
	fx.restore(t, b)
	fx.restore(t, c)
	if got := mustRead(t, fx.p("g")); got != "kept" {
		t.Fatalf("g = %q, want kept", got)
	}
	// A checkpoint of an unchanged view has the same layers under another
	// id: switching between the two changes nothing, and a change made
	// after such a switch is discarded by the next one.
	c2 := fx.checkpoint(t)
	for i, id := range []string{c2, c, c2} {
		fx.restore(t, id)
		if got := mustRead(t, fx.p("g")); got != "kept" {
			t.Fatalf("same-layer step %d: g = %q, want kept", i, got)
		}
		mustWrite(t, fx.p("g"), "changed")
		mustWrite(t, fx.p("h"+strconv.Itoa(i)), "new")
		fx.restore(t, id)
		if got := mustRead(t, fx.p("g")); got != "kept" {
			t.Fatalf("same-layer step %d after a write: g = %q, want kept", i, got)
		}
		if _, err := os.Stat(fx.p("h" + strconv.Itoa(i))); !os.IsNotExist(err) {
			t.Fatalf("same-layer step %d: h%d after restore: %v, want it gone", i, i, err)
		}
	}
}
