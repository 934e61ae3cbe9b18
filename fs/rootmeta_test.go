package fs

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRootMetaAcrossUppers: the view's root attributes (mode, owner,
// xattrs, mtime) come from its upper's root directory, and every new upper
// (a new mount over lowers, a checkpoint's push, a switch) must carry the
// view's: a chmod, chown or setxattr of the root survives later
// checkpoints and comes back with a restore, and a restore to a checkpoint
// before it brings back the lower's.
func TestRootMetaAcrossUppers(t *testing.T) {
	type meta struct {
		mode     uint32
		uid, gid uint32
		x        string
		mtime    unix.Timespec
	}
	get := func(t *testing.T, p string) meta {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		m := meta{mode: st.Mode & 07777, uid: st.Uid, gid: st.Gid, mtime: st.Mtim}
		buf := make([]byte, 64)
		if n, err := unix.Getxattr(p, "user.k", buf); err == nil {
			m.x = string(buf[:n])
		} else if err != unix.ENODATA {
			t.Fatal(err)
		}
		return m
	}
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/f", "lower")
		if err := os.Chmod(l, 0o750); err != nil {
			t.Fatal(err)
		}
		if err := os.Lchown(l, 1234, 5678); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(l, "user.k", []byte("lower"), 0); err != nil {
			t.Fatalf("user xattrs on the test's lower: %v", err)
		}
	}, Options{})
	lower := meta{mode: 0o750, uid: 1234, gid: 5678, x: "lower"}
	if got := get(t, fx.mp); got.mode != lower.mode || got.uid != lower.uid || got.gid != lower.gid || got.x != lower.x {
		t.Fatalf("new mount's root: %+v, want the lower's %+v", got, lower)
	}
	z := fx.checkpoint(t)
	if err := os.Chmod(fx.mp, 0o711); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(fx.mp, 42, 43); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(fx.mp, "user.k", []byte("changed"), 0); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, fx.p("g"), "g") // changes the root's mtime too
	changed := get(t, fx.mp)
	if changed.mode != 0o711 || changed.uid != 42 || changed.x != "changed" {
		t.Fatalf("root after the changes: %+v", changed)
	}
	a := fx.checkpoint(t)
	mustWrite(t, fx.p("h"), "h") // a push of a new upper at the next checkpoint
	b := fx.checkpoint(t)
	for i, step := range []struct {
		id   string
		want meta
	}{{a, changed}, {z, lower}, {b, changed}, {z, lower}, {a, changed}} {
		fx.restore(t, step.id)
		got := get(t, fx.mp)
		if got.mode != step.want.mode || got.uid != step.want.uid || got.gid != step.want.gid || got.x != step.want.x {
			t.Fatalf("step %d: root after the restore to %s: %+v, want %+v", i, step.id, got, step.want)
		}
		if step.id == a && got.mtime != changed.mtime {
			t.Fatalf("step %d: root mtime after the restore to %s: %v, want %v", i, step.id, got.mtime, changed.mtime)
		}
	}
	// A restore to the checkpoint the view is at keeps an upper that
	// received nothing (its root already has a's attributes); one that
	// received a change of the root itself must not be taken as having
	// them.
	fx.restore(t, a)
	if got := get(t, fx.mp); got.mode != changed.mode || got.x != changed.x {
		t.Fatalf("second restore to a in a row: %+v, want %+v", got, changed)
	}
	if err := os.Chmod(fx.mp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(fx.mp, "user.k", []byte("dirty"), 0); err != nil {
		t.Fatal(err)
	}
	fx.restore(t, a)
	if got := get(t, fx.mp); got.mode != changed.mode || got.uid != changed.uid || got.x != changed.x {
		t.Fatalf("restore to a after a change of the root: %+v, want %+v", got, changed)
	}
}
