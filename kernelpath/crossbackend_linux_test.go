package kernelpath

import (
	"log/slog"
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/layer"
)

func fuseAvailable() bool {
	_, err := os.Stat("/dev/fuse")
	return err == nil
}

// mountAny mounts a view with the named backend ("kernel" or "fuse").
func mountAny(t *testing.T, st *layer.Store, backend, id, from string, lowers []string) layer.FS {
	t.Helper()
	mp := filepath.Join(filepath.Dir(st.Dir()), "mnt-"+layer.NewID())
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	var v layer.FS
	var err error
	if backend == "kernel" {
		v, err = Mount(st, mp, Options{MountID: id, From: from, Lowers: lowers, Logger: slog.New(slog.DiscardHandler)})
	} else {
		v, err = fs.Mount(st, mp, fs.Options{MountID: id, From: from, Lowers: lowers})
	}
	if err != nil {
		t.Fatalf("mount %s: %v", backend, err)
	}
	t.Cleanup(func() {
		if err := v.Unmount(); err != nil {
			t.Errorf("unmount %s: %v", backend, err)
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
	})
	return v
}

// TestCrossBackend: a random operation sequence (with checkpoints and
// switches, checked against a model, over a base directory) runs on one
// backend; its final checkpoint is then opened with the other backend,
// which must show the very same tree. Both directions, on loop XFS.
func TestCrossBackend(t *testing.T) {
	testenv.Require(t, fuseAvailable(), "/dev/fuse")
	for _, dir := range [][2]string{{"kernel", "fuse"}, {"fuse", "kernel"}} {
		t.Run(dir[0]+"-to-"+dir[1], func(t *testing.T) {
			st := newStore(t, "xfs")
			model := filepath.Join(filepath.Dir(st.Dir()), "model")
			if err := os.Mkdir(model, 0o755); err != nil {
				t.Fatal(err)
			}
			base := filepath.Join(filepath.Dir(st.Dir()), "base")
			makeBase(t, base, *diffSeed)
			copyTreeCP(t, base, model)
			a := mountAny(t, st, dir[0], "writer", "", []string{base})
			var rs unix.Stat_t
			if err := unix.Stat(a.Mountpoint(), &rs); err != nil {
				t.Fatal(err)
			}
			_ = os.Chmod(model, os.FileMode(rs.Mode&0o777))
			runDifferentialMode(t, a, model, *diffSeed+7, 600, true)
			id, err := a.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			b := mountAny(t, st, dir[1], "reader", id, nil)
			want := treeDump(t, model)
			if got := treeDump(t, b.Mountpoint()); got != want {
				t.Fatalf("%s reads %s's checkpoint differently:\n--- %s\n%s\n--- model\n%s", dir[1], dir[0], dir[1], got, want)
			}
			// And the reader can go on: write, checkpoint, switch back.
			writeFile(t, b.Mountpoint()+"/after", "x")
			c, err := b.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			if err := os.Remove(b.Mountpoint() + "/after"); err != nil {
				t.Fatal(err)
			}
			if err := b.Switch(c); err != nil {
				t.Fatal(err)
			}
			if got := readFile(t, b.Mountpoint()+"/after"); got != "x" {
				t.Fatalf("after = %q", got)
			}
		})
	}
}
