package kernelpath

import (
	"errors"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

var fsKinds = []string{"xfs", "btrfs"}

func TestCheckpointSwitch(t *testing.T) {
	for _, kind := range fsKinds {
		t.Run(kind, func(t *testing.T) {
			st := newStore(t, kind)
			f := mountKP(t, st, Options{MountID: "sbx-" + kind})
			if f.FreezeMode() != FreezeReflink {
				t.Fatalf("freeze mode on %s = %q, want reflink", kind, f.FreezeMode())
			}
			mp := f.Mountpoint()
			writeFile(t, mp+"/a", "one")
			if err := os.MkdirAll(mp+"/d/e", 0o755); err != nil {
				t.Fatal(err)
			}
			writeFile(t, mp+"/d/e/f", "deep")
			c1, err := f.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			want1 := treeDump(t, mp)

			// An fd opened before the checkpoint writes after it: the write
			// lands in the live view, never in the frozen layer.
			fh, err := os.OpenFile(mp+"/a", os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := fh.WriteString("+two"); err != nil {
				t.Fatal(err)
			}
			fh.Close()
			if err := os.RemoveAll(mp + "/d"); err != nil {
				t.Fatal(err)
			}
			writeFile(t, mp+"/b", "new")
			c2, err := f.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			want2 := treeDump(t, mp)
			if got := readFile(t, mp+"/a"); got != "one+two" {
				t.Fatalf("a = %q", got)
			}

			if err := f.Switch(c1); err != nil {
				t.Fatal(err)
			}
			if got := treeDump(t, mp); got != want1 {
				t.Fatalf("after switch to c1:\n%s\nwant:\n%s", got, want1)
			}
			writeFile(t, mp+"/c", "branch")
			if err := f.Switch(c2); err != nil {
				t.Fatal(err)
			}
			if got := treeDump(t, mp); got != want2 {
				t.Fatalf("after switch to c2:\n%s\nwant:\n%s", got, want2)
			}
			if _, err := os.Stat(mp + "/c"); !errors.Is(err, os.ErrNotExist) {
				t.Fatalf("c survived the switch: %v", err)
			}

			// The frozen layer of c1 still holds "one": nothing wrote into it.
			rec, err := st.Checkpoint(c1)
			if err != nil {
				t.Fatal(err)
			}
			top := st.LayerPath(rec.Layers[len(rec.Layers)-1])
			if got := readFile(t, top+"/a"); got != "one" {
				t.Fatalf("frozen layer changed: a = %q", got)
			}

			// Bad input: unknown id, checkpoint of another mount.
			if err := f.Switch("nope"); err == nil {
				t.Fatal("switch to unknown id succeeded")
			}
			g := mountKP(t, st, Options{MountID: "other-" + kind, From: c1})
			if got := treeDump(t, g.Mountpoint()); got != want1 {
				t.Fatalf("fork from c1:\n%s\nwant:\n%s", got, want1)
			}
			c3, err := g.Checkpoint()
			if err != nil {
				t.Fatal(err)
			}
			if err := f.Switch(c3); err == nil || !strings.Contains(err.Error(), "another mount") && !strings.Contains(err.Error(), "belongs to mount") {
				t.Fatalf("switch to a foreign checkpoint: %v", err)
			}
			if got := treeDump(t, mp); got != want2 {
				t.Fatalf("failed switch changed the view")
			}
		})
	}
}

// TestOverlayFormat checks that what the kernel writes into an upper, and
// what a checkpoint freezes, is the shared layer format: whiteouts are
// char 0:0, a re-created directory is opaque, a renamed merged directory
// carries a redirect; overlayfs's private xattrs are not frozen.
func TestOverlayFormat(t *testing.T) {
	st := newStore(t, "xfs")
	f := mountKP(t, st, Options{MountID: "fmt"})
	mp := f.Mountpoint()
	if err := os.MkdirAll(mp+"/dir/sub", 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, mp+"/dir/sub/x", "x")
	writeFile(t, mp+"/gone", "g")
	if err := os.MkdirAll(mp+"/opq", 0o755); err != nil {
		t.Fatal(err)
	}
	writeFile(t, mp+"/opq/old", "o")
	c1, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Switch(c1); err != nil { // everything is now in a lower
		t.Fatal(err)
	}
	if err := os.Remove(mp + "/gone"); err != nil {
		t.Fatal(err)
	}
	if err := os.RemoveAll(mp + "/opq"); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(mp+"/opq", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(mp+"/moved", 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Rename(mp+"/dir", mp+"/moved/dir2"); err != nil {
		t.Fatal(err)
	}
	c2, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	rec, _ := st.Checkpoint(c2)
	top := st.LayerPath(rec.Layers[len(rec.Layers)-1])
	var s unix.Stat_t
	if err := unix.Lstat(top+"/gone", &s); err != nil || s.Mode&unix.S_IFMT != unix.S_IFCHR || s.Rdev != 0 {
		t.Fatalf("whiteout: %v mode %o rdev %d", err, s.Mode, s.Rdev)
	}
	buf := make([]byte, 256)
	if n, err := unix.Lgetxattr(top+"/opq", layer.XattrOpaque, buf); err != nil || string(buf[:n]) != "y" {
		t.Fatalf("opaque xattr: %v %q", err, buf[:max(n, 0)])
	}
	if n, err := unix.Lgetxattr(top+"/moved/dir2", layer.XattrRedirect, buf); err != nil || string(buf[:n]) != "/dir" {
		t.Fatalf("redirect xattr: %v %q", err, buf[:max(n, 0)])
	}
	n, _ := unix.Llistxattr(top+"/moved/dir2", buf)
	for _, name := range strings.Split(string(buf[:max(n, 0)]), "\x00") {
		if strings.HasPrefix(name, layer.XattrPrefixOverlay) && name != layer.XattrOpaque && name != layer.XattrRedirect {
			t.Fatalf("private overlay xattr %s frozen", name)
		}
	}
	// Read back through a fresh mount of c2.
	g := mountKP(t, st, Options{MountID: "fmt2", From: c2})
	if got := readFile(t, g.Mountpoint()+"/moved/dir2/sub/x"); got != "x" {
		t.Fatalf("redirected dir content: %q", got)
	}
	for _, p := range []string{"gone", "dir", "opq/old"} {
		if _, err := os.Lstat(filepath.Join(g.Mountpoint(), p)); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("%s visible: %v", p, err)
		}
	}
}

func errorsIs(err, target error) bool { return errors.Is(err, target) }

// TestFreezeMetadata: a checkpoint keeps owners, special mode bits,
// setgid-directory groups, xattrs, times, special files and hard links made
// in the upper.
func TestFreezeMetadata(t *testing.T) {
	for _, kind := range fsKinds {
		t.Run(kind, func(t *testing.T) {
			st := newStore(t, kind)
			f := mountKP(t, st, Options{MountID: "meta"})
			mp := f.Mountpoint()
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			must(os.Mkdir(mp+"/sg", 0o755))
			must(os.Chown(mp+"/sg", 0, 1234))
			must(os.Chmod(mp+"/sg", 0o2775))
			writeFile(t, mp+"/sg/inherit", "g") // group 1234 by inheritance
			writeFile(t, mp+"/suid", "s")
			must(os.Chmod(mp+"/suid", 0o4755))
			writeFile(t, mp+"/user", "u")
			must(os.Chown(mp+"/user", 1000, 1000))
			must(os.Chmod(mp+"/user", 0o600))
			writeFile(t, mp+"/big", strings.Repeat("x", 100000))
			must(unix.Setxattr(mp+"/big", "user.note", []byte("hello"), 0))
			must(os.Symlink("target/../x", mp+"/sym"))
			must(os.Lchown(mp+"/sym", 1000, 1001))
			must(unix.Mkfifo(mp+"/fifo", 0o640))
			must(unix.Mknod(mp+"/null", unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))))
			must(os.Link(mp+"/user", mp+"/user-link"))
			old := time.Date(2001, 2, 3, 4, 5, 6, 7, time.UTC)
			must(os.Chtimes(mp+"/big", old, old))
			want := treeDump(t, mp)
			id, err := f.Checkpoint()
			must(err)
			g := mountKP(t, st, Options{MountID: "meta2", From: id})
			if got := treeDump(t, g.Mountpoint()); got != want {
				t.Fatalf("frozen view differs:\n%s\nwant:\n%s", got, want)
			}
			fi, err := os.Stat(g.Mountpoint() + "/big")
			must(err)
			if !fi.ModTime().Equal(old) {
				t.Fatalf("mtime %v, want %v", fi.ModTime(), old)
			}
		})
	}
}

func TestTakeFSEffects(t *testing.T) {
	st := newStore(t, "xfs")
	f := mountKP(t, st, Options{MountID: "fx"})
	mp := f.Mountpoint()
	writeFile(t, mp+"/base", "b")
	writeFile(t, mp+"/keep", "k")
	c, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Switch(c); err != nil {
		t.Fatal(err)
	}
	if e := f.TakeFSEffects(); e.UpperNonEmpty || e.Created+e.Modified+e.Deleted+e.MetaChanged != 0 {
		t.Fatalf("fresh view: %+v", e)
	}
	writeFile(t, mp+"/new", "hello")
	if err := os.Remove(mp + "/base"); err != nil {
		t.Fatal(err)
	}
	e := f.TakeFSEffects()
	if e.Created != 1 || e.Deleted != 1 || !e.UpperNonEmpty || e.BytesWritten != 5 || len(e.Samples) != 2 {
		t.Fatalf("effects: %+v", e)
	}
	fh, err := os.OpenFile(mp+"/new", os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	fh.WriteString("!!")
	fh.Close()
	if err := os.Chmod(mp+"/keep", 0o600); err != nil {
		t.Fatal(err)
	}
	e = f.TakeFSEffects()
	if e.Modified != 1 || e.MetaChanged != 1 || e.Created != 0 || e.Deleted != 0 || !e.UpperNonEmpty {
		t.Fatalf("effects 2: %+v", e)
	}
	if e = f.TakeFSEffects(); e.Created+e.Modified+e.Deleted+e.MetaChanged != 0 || !e.UpperNonEmpty {
		t.Fatalf("read-only turn: %+v", e)
	}
	if _, err := f.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	if e = f.TakeFSEffects(); e.UpperNonEmpty || e.Created+e.Modified+e.Deleted+e.MetaChanged != 0 {
		t.Fatalf("after checkpoint: %+v", e)
	}
}

// TestStaleMount: an overlay left at the mount point by a crashed daemon is
// detached when the same mount id is mounted again from its checkpoint; a
// mount point busy with anything else is refused with a clear error.
func TestStaleMount(t *testing.T) {
	st := newStore(t, "xfs")
	f := mountKP(t, st, Options{MountID: "crash"})
	mp := f.Mountpoint()
	writeFile(t, mp+"/x", "1")
	id, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	// Simulate the crash: the record names a dead process.
	cmd := exec.Command("true")
	if err := cmd.Run(); err != nil {
		t.Fatal(err)
	}
	rec, err := st.Mount("crash")
	if err != nil {
		t.Fatal(err)
	}
	rec.PID = cmd.Process.Pid
	if err := st.SaveMount(rec, false); err != nil {
		t.Fatal(err)
	}
	g, err := Mount(st, mp, Options{MountID: "crash", From: id, Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		t.Fatalf("remount after crash: %v", err)
	}
	if got := readFile(t, mp+"/x"); got != "1" {
		t.Fatalf("x = %q", got)
	}
	if err := g.Unmount(); err != nil {
		t.Fatal(err)
	}
	// A foreign mount at the mount point is refused.
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, ""); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(mp, unix.MNT_DETACH)
	if _, err := Mount(st, mp, Options{MountID: "other", Logger: slog.New(slog.DiscardHandler)}); err == nil || !strings.Contains(err.Error(), "already a mount point") {
		t.Fatalf("mount over a foreign mount: %v", err)
	}
	// Unknown checkpoint: clear error.
	if _, err := Mount(st, t.TempDir(), Options{From: "nope", Logger: slog.New(slog.DiscardHandler)}); err == nil {
		t.Fatal("mount from an unknown checkpoint succeeded")
	}
}

// TestDepthAndCompact: every switch stacks the target's layers under a new
// chain, so restore cycles deepen the view; Compact merges them back to
// at most two layers without changing what any checkpoint holds.
func TestDepthAndCompact(t *testing.T) {
	st := newStore(t, "xfs")
	f := mountKP(t, st, Options{MountID: "depth"})
	mp := f.Mountpoint()
	var ids []string
	var dumps []string
	for i := range 6 {
		writeFile(t, mp+"/f"+strconv.Itoa(i), strconv.Itoa(i))
		c, err := f.Checkpoint()
		if err != nil {
			t.Fatal(err)
		}
		writeFile(t, mp+"/g"+strconv.Itoa(i), "x")
		c2, err := f.Checkpoint()
		if err != nil {
			t.Fatal(err)
		}
		ids, dumps = append(ids, c2), append(dumps, treeDump(t, mp))
		if err := f.Switch(c); err != nil {
			t.Fatal(err)
		}
	}
	if d := f.Depth(); d < 6 {
		t.Fatalf("depth after 6 restore cycles: %d", d)
	}
	if err := f.Compact(); err != nil {
		t.Fatal(err)
	}
	if d := f.Depth(); d > 2 {
		t.Fatalf("depth after Compact: %d, want <= 2", d)
	}
	// The last checkpoint, taken on this mount's current stack, keeps its
	// content through the merge.
	last := len(ids) - 1
	if err := f.Switch(ids[last]); err != nil {
		t.Fatal(err)
	}
	if got := treeDump(t, mp); got != dumps[last] {
		t.Fatalf("after compact, checkpoint %s:\n%s\nwant:\n%s", ids[last], got, dumps[last])
	}
}
