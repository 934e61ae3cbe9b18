package kernelpath

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestRootAttrs: a view's root attributes (mode, owner, user xattrs) are
// its upper's root directory's, on both backends; a chmod, chown or
// setxattr of the root survives later checkpoints, comes back with a
// switch and with a new mount from the checkpoint, and a switch to a
// checkpoint before it brings back the base directory's.
func TestRootAttrs(t *testing.T) {
	type attrs struct {
		mode     uint32
		uid, gid uint32
		x        string
	}
	get := func(t *testing.T, p string) attrs {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Stat(p, &st); err != nil {
			t.Fatal(err)
		}
		a := attrs{mode: st.Mode & 07777, uid: st.Uid, gid: st.Gid}
		buf := make([]byte, 64)
		if n, err := unix.Getxattr(p, "user.k", buf); err == nil {
			a.x = string(buf[:n])
		} else if err != unix.ENODATA {
			t.Fatal(err)
		}
		return a
	}
	for _, backend := range []string{"kernel", "fuse"} {
		t.Run(backend, func(t *testing.T) {
			st := newStore(t, "xfs")
			base := filepath.Join(filepath.Dir(st.Dir()), "base")
			if err := os.Mkdir(base, 0o750); err != nil {
				t.Fatal(err)
			}
			writeFile(t, base+"/f", "base")
			if err := os.Lchown(base, 1234, 5678); err != nil {
				t.Fatal(err)
			}
			if err := unix.Setxattr(base, "user.k", []byte("base"), 0); err != nil {
				t.Fatal(err)
			}
			baseAttrs := attrs{mode: 0o750, uid: 1234, gid: 5678, x: "base"}
			v := mountAny(t, st, backend, "root-"+backend, "", []string{base})
			mp := v.Mountpoint()
			if got := get(t, mp); got != baseAttrs {
				t.Fatalf("new mount's root %+v, want the base's %+v", got, baseAttrs)
			}
			z, err := v.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Chmod(mp, 0o711); err != nil {
				t.Fatal(err)
			}
			if err := os.Lchown(mp, 42, 43); err != nil {
				t.Fatal(err)
			}
			if err := unix.Setxattr(mp, "user.k", []byte("changed"), 0); err != nil {
				t.Fatal(err)
			}
			writeFile(t, mp+"/g", "g")
			changed := attrs{mode: 0o711, uid: 42, gid: 43, x: "changed"}
			a, err := v.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			writeFile(t, mp+"/h", "h")
			b, err := v.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			for i, step := range []struct {
				id   string
				want attrs
			}{{a, changed}, {z, baseAttrs}, {b, changed}, {z, baseAttrs}, {a, changed}} {
				if err := v.Switch(step.id); err != nil {
					t.Fatal(err)
				}
				if got := get(t, mp); got != step.want {
					t.Fatalf("step %d: root after the switch to %s: %+v, want %+v", i, step.id, got, step.want)
				}
			}
			w := mountAny(t, st, backend, "root2-"+backend, b, nil)
			if got := get(t, w.Mountpoint()); got != changed {
				t.Fatalf("mount from %s: root %+v, want %+v", b, got, changed)
			}
		})
	}
}
