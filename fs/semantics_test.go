package fs

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// viewOf lists a tree as path -> "dir", "link:<target>" or the content.
func viewOf(t testing.TB, root string) map[string]string {
	t.Helper()
	out := map[string]string{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == root {
			return nil
		}
		rel := strings.TrimPrefix(p, root+"/")
		switch {
		case d.IsDir():
			out[rel] = "dir"
		case d.Type()&os.ModeSymlink != 0:
			tg, _ := os.Readlink(p)
			out[rel] = "link:" + tg
		default:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			out[rel] = string(b)
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return out
}

func sameView(t testing.TB, what string, got, want map[string]string) {
	t.Helper()
	var diffs []string
	for k, v := range want {
		if got[k] != v {
			diffs = append(diffs, fmt.Sprintf("%s: got %q want %q", k, got[k], v))
		}
	}
	for k, v := range got {
		if _, ok := want[k]; !ok {
			diffs = append(diffs, fmt.Sprintf("%s: unexpected %q", k, v))
		}
	}
	sort.Strings(diffs)
	if len(diffs) > 0 {
		t.Fatalf("%s:\n%s", what, strings.Join(diffs, "\n"))
	}
}

// layerSpec builds a layer directory: path -> "dir", "opaque", "wh"
// (whiteout), "redirect:<target>", "link:<target>" or file content.
type layerSpec map[string]string

func buildLayer(t testing.TB, dir string, spec layerSpec) {
	t.Helper()
	keys := make([]string, 0, len(spec))
	for k := range spec {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := spec[k]
		p := filepath.Join(dir, k)
		if err := os.MkdirAll(filepath.Dir(p), 0o755); err != nil {
			t.Fatal(err)
		}
		var err error
		switch {
		case v == "dir":
			err = os.Mkdir(p, 0o755)
		case v == "opaque":
			if err = os.Mkdir(p, 0o755); err == nil {
				err = layer.SetOpaque(p)
			}
		case strings.HasPrefix(v, "redirect:"):
			if err = os.Mkdir(p, 0o755); err == nil {
				err = layer.SetRedirect(p, strings.TrimPrefix(v, "redirect:"))
			}
		case v == "wh":
			err = unix.Mknod(p, unix.S_IFCHR, 0)
		case strings.HasPrefix(v, "link:"):
			err = os.Symlink(strings.TrimPrefix(v, "link:"), p)
		default:
			err = os.WriteFile(p, []byte(v), 0o644)
		}
		if err != nil && !os.IsExist(err) {
			t.Fatal(err)
		}
	}
}

// mountLayers builds frozen store layers (bottom first) and mounts a view
// of them.
func mountLayers(t *testing.T, specs ...layerSpec) *fixture {
	t.Helper()
	requireFUSE(t)
	dir := t.TempDir()
	st, err := layer.OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, s := range specs {
		id, err := st.NewLayer("")
		if err != nil {
			t.Fatal(err)
		}
		buildLayer(t, st.LayerPath(id), s)
		ids = append(ids, id)
	}
	cp := layer.Checkpoint{ID: layer.NewID(), Mount: "base", Created: time.Now(), Layers: ids}
	if err := st.SaveCheckpoint(cp); err != nil {
		t.Fatal(err)
	}
	fx := &fixture{store: st, mp: filepath.Join(dir, "mnt")}
	if err := os.Mkdir(fx.mp, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := Mount(st, fx.mp, Options{From: cp.ID, NoDurable: true})
	if err != nil {
		t.Fatal(err)
	}
	fx.fs = f
	t.Cleanup(func() { _ = f.Unmount() })
	return fx
}

func TestLookupSemantics(t *testing.T) {
	cases := []struct {
		name   string
		layers []layerSpec // bottom first
		want   map[string]string
	}{
		{"merge and shadow",
			[]layerSpec{{"a/x": "1", "a/y": "2", "b": "lower"}, {"a/y": "3", "a/z": "4", "b": "upper"}},
			map[string]string{"a": "dir", "a/x": "1", "a/y": "3", "a/z": "4", "b": "upper"}},
		{"whiteout hides",
			[]layerSpec{{"a/x": "1", "a/y": "2", "f": "f"}, {"a/x": "wh", "f": "wh"}},
			map[string]string{"a": "dir", "a/y": "2"}},
		{"opaque stops descent",
			[]layerSpec{{"a/x": "1", "a/y": "2"}, {"a": "opaque", "a/z": "3"}},
			map[string]string{"a": "dir", "a/z": "3"}},
		{"absolute redirect",
			[]layerSpec{{"old/x": "1", "old/sub/y": "2"}, {"new": "redirect:/old", "new/z": "3", "old": "wh"}},
			map[string]string{"new": "dir", "new/x": "1", "new/sub": "dir", "new/sub/y": "2", "new/z": "3"}},
		{"relative redirect",
			[]layerSpec{{"d/old/x": "1"}, {"d/new": "redirect:old", "d/old": "wh"}},
			map[string]string{"d": "dir", "d/new": "dir", "d/new/x": "1"}},
		{"redirect chain",
			[]layerSpec{{"a/x": "1"}, {"b": "redirect:/a", "a": "wh", "b/y": "2"}, {"c": "redirect:/b", "b": "wh"}},
			map[string]string{"c": "dir", "c/x": "1", "c/y": "2"}},
		{"redirect through a redirected ancestor",
			[]layerSpec{{"a/c/x": "1"}, {"b": "redirect:/a", "a": "wh"}, {"d": "redirect:/b/c", "b/c": "wh"}},
			map[string]string{"b": "dir", "d": "dir", "d/x": "1"}},
		{"dir over file and file over dir",
			[]layerSpec{{"p": "file", "q/x": "1"}, {"p/in": "2", "q": "now a file"}},
			map[string]string{"p": "dir", "p/in": "2", "q": "now a file"}},
		{"symlinks are entries",
			[]layerSpec{{"t/x": "1", "l": "link:t"}, {"m": "link:/etc"}},
			map[string]string{"t": "dir", "t/x": "1", "l": "link:t", "m": "link:/etc"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fx := mountLayers(t, tc.layers...)
			sameView(t, "view", viewOf(t, fx.mp), tc.want)
		})
	}
}

func lstatT(t testing.TB, p string) unix.Stat_t {
	t.Helper()
	var s unix.Stat_t
	if err := unix.Lstat(p, &s); err != nil {
		t.Fatal(err)
	}
	return s
}

func (fx *fixture) upperPath(rel string) string {
	return filepath.Join(fx.fs.st.upper.path, rel)
}

func TestWrittenFormat(t *testing.T) {
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/f", "f")
		mustWrite(t, l+"/d/x", "x")
		mustWrite(t, l+"/old/y", "y")
		mustWrite(t, l+"/e/z", "z")
	}, Options{})
	if err := os.Remove(fx.p("f")); err != nil {
		t.Fatal(err)
	}
	if s := lstatT(t, fx.upperPath("f")); !layer.IsWhiteout(&s) {
		t.Fatalf("unlink of a lower file left %o, want a whiteout", s.Mode)
	}
	if err := os.RemoveAll(fx.p("d")); err != nil {
		t.Fatal(err)
	}
	if err := os.Mkdir(fx.p("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	if !layer.IsOpaque(fx.upperPath("d")) {
		t.Fatal("mkdir over a removed lower dir is not opaque")
	}
	if err := os.Rename(fx.p("old"), fx.p("e/new")); err != nil {
		t.Fatal(err)
	}
	if r := layer.Redirect(fx.upperPath("e/new")); r != "/old" {
		t.Fatalf("redirect = %q, want /old", r)
	}
	if s := lstatT(t, fx.upperPath("old")); !layer.IsWhiteout(&s) {
		t.Fatal("no whiteout at a renamed dir's old name")
	}
	want := map[string]string{"d": "dir", "e": "dir", "e/z": "z", "e/new": "dir", "e/new/y": "y"}
	sameView(t, "view", viewOf(t, fx.mp), want)
	// The same layers read back by a fresh mount give the same view.
	id := fx.checkpoint(t)
	mp2 := filepath.Join(t.TempDir(), "m2")
	if err := os.Mkdir(mp2, 0o755); err != nil {
		t.Fatal(err)
	}
	f2, err := Mount(fx.store, mp2, Options{From: id, NoDurable: true})
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Unmount()
	sameView(t, "remounted view", viewOf(t, mp2), want)
	// Readdir of the merged root shows nothing hidden.
	ents, err := os.ReadDir(fx.mp)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	if strings.Join(names, ",") != "d,e" {
		t.Fatalf("readdir = %v", names)
	}
}

func TestCopyUpPreservesMetadata(t *testing.T) {
	mtime := time.Date(2020, 1, 2, 3, 4, 5, 0, time.UTC)
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/f", "content")
		if err := os.Chmod(l+"/f", 0o640); err != nil {
			t.Fatal(err)
		}
		if err := os.Chown(l+"/f", 1234, 5678); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(l+"/f", "user.k", []byte("v"), 0); err != nil {
			t.Fatal(err)
		}
		if err := os.Chtimes(l+"/f", mtime, mtime); err != nil {
			t.Fatal(err)
		}
	}, Options{})
	// A metadata change copies the file up.
	if err := unix.Setxattr(fx.p("f"), "user.other", []byte("w"), 0); err != nil {
		t.Fatal(err)
	}
	s := lstatT(t, fx.upperPath("f"))
	if s.Mode&07777 != 0o640 || s.Uid != 1234 || s.Gid != 5678 || time.Unix(s.Mtim.Unix()).UTC() != mtime {
		t.Fatalf("copy-up lost metadata: mode %o uid %d gid %d mtime %v", s.Mode&07777, s.Uid, s.Gid, time.Unix(s.Mtim.Unix()))
	}
	buf := make([]byte, 16)
	n, err := unix.Lgetxattr(fx.upperPath("f"), "user.k", buf)
	if err != nil || string(buf[:n]) != "v" {
		t.Fatalf("xattr user.k lost: %q %v", buf[:max(n, 0)], err)
	}
	if got := mustRead(t, fx.upperPath("f")); got != "content" {
		t.Fatalf("copy-up content %q", got)
	}
	if got := mustRead(t, fx.lower+"/f"); got != "content" {
		t.Fatal("lower changed")
	}
	// The view keeps the inode number across the copy-up and a checkpoint.
	before := lstatT(t, fx.p("f")).Ino
	fx.checkpoint(t)
	mustWrite(t, fx.p("f"), "new")
	if after := lstatT(t, fx.p("f")).Ino; after != before {
		t.Fatalf("inode changed across copy-up: %d -> %d", before, after)
	}
}

func TestPosixSurface(t *testing.T) {
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/d/x", "x")
		mustWrite(t, l+"/big", strings.Repeat("z", 100000))
	}, Options{})
	// rmdir on merged content.
	if err := unix.Rmdir(fx.p("d")); !errors.Is(err, unix.ENOTEMPTY) {
		t.Fatalf("rmdir non-empty merged dir: %v", err)
	}
	// O_EXCL, O_APPEND, O_TRUNC.
	if _, err := os.OpenFile(fx.p("d/x"), os.O_CREATE|os.O_EXCL|os.O_WRONLY, 0o644); !errors.Is(err, os.ErrExist) {
		t.Fatalf("O_EXCL on existing lower file: %v", err)
	}
	fh, err := os.OpenFile(fx.p("d/x"), os.O_APPEND|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fh.WriteString("y")
	fh.Close()
	if got := mustRead(t, fx.p("d/x")); got != "xy" {
		t.Fatalf("append: %q", got)
	}
	fh, err = os.OpenFile(fx.p("big"), os.O_TRUNC|os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	fh.Close()
	if st := lstatT(t, fx.p("big")); st.Size != 0 {
		t.Fatalf("O_TRUNC size %d", st.Size)
	}
	// fallocate, truncate.
	fh, err = os.OpenFile(fx.p("alloc"), os.O_CREATE|os.O_RDWR, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	if err := unix.Fallocate(int(fh.Fd()), 0, 0, 8192); err != nil {
		t.Fatalf("fallocate: %v", err)
	}
	fh.Close()
	if st := lstatT(t, fx.p("alloc")); st.Size != 8192 {
		t.Fatalf("fallocate size %d", st.Size)
	}
	// mmap MAP_SHARED writable.
	mustWrite(t, fx.p("m"), strings.Repeat("\x00", 4096))
	fh, err = os.OpenFile(fx.p("m"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	mem, err := unix.Mmap(int(fh.Fd()), 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		t.Fatal(err)
	}
	copy(mem, "mapped")
	if err := unix.Msync(mem, unix.MS_SYNC); err != nil {
		t.Fatal(err)
	}
	unix.Munmap(mem)
	fh.Close()
	if got := mustRead(t, fx.upperPath("m")); !strings.HasPrefix(got, "mapped") {
		t.Fatalf("mmap write not in upper: %q", got[:8])
	}
	// flock and fcntl locks.
	fh, _ = os.Open(fx.p("m"))
	if err := unix.Flock(int(fh.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
		t.Fatalf("flock: %v", err)
	}
	fh2, _ := os.Open(fx.p("m"))
	if err := unix.Flock(int(fh2.Fd()), unix.LOCK_EX|unix.LOCK_NB); !errors.Is(err, unix.EWOULDBLOCK) {
		t.Fatalf("second flock: %v", err)
	}
	fh2.Close()
	fh.Close()
	fh, _ = os.OpenFile(fx.p("m"), os.O_RDWR, 0)
	lk := unix.Flock_t{Type: unix.F_WRLCK, Whence: 0, Start: 0, Len: 10}
	if err := unix.FcntlFlock(fh.Fd(), unix.F_SETLK, &lk); err != nil {
		t.Fatalf("fcntl lock: %v", err)
	}
	fh.Close()
	// link, symlink, readlink, chmod, chown, utimens, xattrs, mknod, mkfifo.
	if err := os.Link(fx.p("d/x"), fx.p("hard")); err != nil {
		t.Fatal(err)
	}
	if s := lstatT(t, fx.p("hard")); s.Nlink != 2 {
		t.Fatalf("link count %d", s.Nlink)
	}
	if err := os.Symlink("d/x", fx.p("sym")); err != nil {
		t.Fatal(err)
	}
	if tg, _ := os.Readlink(fx.p("sym")); tg != "d/x" {
		t.Fatalf("readlink %q", tg)
	}
	if err := os.Chmod(fx.p("hard"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := os.Lchown(fx.p("sym"), 42, 43); err != nil {
		t.Fatal(err)
	}
	if s := lstatT(t, fx.p("sym")); s.Uid != 42 {
		t.Fatalf("lchown uid %d", s.Uid)
	}
	mt := time.Date(2001, 2, 3, 4, 5, 6, 0, time.UTC)
	if err := os.Chtimes(fx.p("hard"), mt, mt); err != nil {
		t.Fatal(err)
	}
	if s := lstatT(t, fx.p("d/x")); time.Unix(s.Mtim.Unix()).UTC() != mt {
		t.Fatal("utimens not visible through the other link")
	}
	if err := unix.Setxattr(fx.p("hard"), "user.a", []byte("1"), 0); err != nil {
		t.Fatal(err)
	}
	if err := unix.Setxattr(fx.p("hard"), "trusted.overlay.opaque", []byte("y"), 0); err == nil {
		t.Fatal("overlay xattrs must not be settable")
	}
	buf := make([]byte, 256)
	n, _ := unix.Listxattr(fx.p("hard"), buf)
	if string(buf[:n]) != "user.a\x00" {
		t.Fatalf("listxattr %q", buf[:n])
	}
	if err := unix.Removexattr(fx.p("hard"), "user.a"); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mkfifo(fx.p("fifo"), 0o600); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mknod(fx.p("null"), unix.S_IFCHR|0o666, int(unix.Mkdev(1, 3))); err != nil {
		t.Fatal(err)
	}
	// The device node works (the mount allows devices): writes vanish.
	if err := os.WriteFile(fx.p("null"), []byte("gone"), 0); err != nil {
		t.Fatalf("write to device node: %v", err)
	}
	if err := unix.Mknod(fx.p("wh"), unix.S_IFCHR, 0); err == nil {
		t.Fatal("mknod 0:0 (the whiteout marker) must be refused")
	}
	// rename flags.
	if err := unix.Renameat2(unix.AT_FDCWD, fx.p("hard"), unix.AT_FDCWD, fx.p("sym"), unix.RENAME_NOREPLACE); !errors.Is(err, unix.EEXIST) {
		t.Fatalf("RENAME_NOREPLACE: %v", err)
	}
	if err := unix.Renameat2(unix.AT_FDCWD, fx.p("hard"), unix.AT_FDCWD, fx.p("sym"), unix.RENAME_EXCHANGE); err != nil {
		t.Fatalf("RENAME_EXCHANGE: %v", err)
	}
	if tg, _ := os.Readlink(fx.p("hard")); tg != "d/x" {
		t.Fatalf("exchange: hard is now %q", tg)
	}
	var sf unix.Statfs_t
	if err := unix.Statfs(fx.mp, &sf); err != nil || sf.Blocks == 0 {
		t.Fatalf("statfs: %v %+v", err, sf)
	}
}

func TestOpenFdAcrossCheckpointAndRestore(t *testing.T) {
	fx := mountT(t, func(l string) { mustWrite(t, l+"/f", "base") }, Options{})
	w, err := os.OpenFile(fx.p("f"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.WriteAt([]byte("A"), 0); err != nil {
		t.Fatal(err)
	}
	c1 := fx.checkpoint(t)
	frozen := fx.fs.st.frozen[len(fx.fs.st.frozen)-1]
	// Written after the checkpoint through the old fd: lands in the new
	// upper, never in the frozen layer.
	if _, err := w.WriteAt([]byte("B"), 1); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, frozen.path+"/f"); got != "Aase" {
		t.Fatalf("frozen layer was written: %q", got)
	}
	if got := mustRead(t, fx.upperPath("f")); got != "ABse" {
		t.Fatalf("new upper: %q", got)
	}
	if got := mustRead(t, fx.p("f")); got != "ABse" {
		t.Fatalf("view: %q", got)
	}
	// A reader opened now keeps working across a restore and then reads
	// the restored content.
	r, err := os.Open(fx.p("f"))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fx.restore(t, c1)
	buf := make([]byte, 4)
	if _, err := r.ReadAt(buf, 0); err != nil {
		t.Fatal(err)
	}
	if string(buf) != "Aase" {
		t.Fatalf("read through an fd across a restore: %q", buf)
	}
	if got := mustRead(t, fx.p("f")); got != "Aase" {
		t.Fatalf("view after restore: %q", got)
	}
	// The writer also follows into the restored view.
	if _, err := w.WriteAt([]byte("C"), 3); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, fx.p("f")); got != "AasC" {
		t.Fatalf("write after restore: %q", got)
	}
	if got := mustRead(t, frozen.path+"/f"); got != "Aase" {
		t.Fatalf("frozen layer was written after restore: %q", got)
	}
}

// TestReaderFollowsCopyUpByAnotherFd: a descriptor opened on a lower or
// frozen copy of a file reads (and stats) the file's current content once
// another descriptor copied it up and wrote to it, as on overlayfs. go-fuse
// answers a GETATTR without a file handle through any open handle of the
// node, so a reader left on the old copy made the kernel take the old
// size: an append looked lost (TestCorpusFS/deep-restore-chain, rarely).
func TestReaderFollowsCopyUpByAnotherFd(t *testing.T) {
	for _, where := range []string{"lower", "frozen"} {
		t.Run(where, func(t *testing.T) {
			var fx *fixture
			if where == "lower" {
				fx = mountT(t, func(l string) { mustWrite(t, l+"/f", "base") }, Options{})
			} else {
				fx = mountT(t, nil, Options{})
				mustWrite(t, fx.p("f"), "base")
				fx.checkpoint(t)
			}
			// O_DIRECT: reads through r reach the daemon with r's handle
			// instead of being served from the page cache.
			r, err := unix.Open(fx.p("f"), unix.O_RDONLY|unix.O_DIRECT, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer unix.Close(r)
			buf := make([]byte, 4096)
			if n, err := unix.Pread(r, buf, 0); err != nil || string(buf[:n]) != "base" {
				t.Fatalf("read before copy-up: %q %v", buf[:max(n, 0)], err)
			}
			w, err := os.OpenFile(fx.p("f"), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := w.WriteString("++"); err != nil {
				t.Fatal(err)
			}
			if err := w.Close(); err != nil {
				t.Fatal(err)
			}
			if got := mustRead(t, fx.upperPath("f")); got != "base++" {
				t.Fatalf("upper copy: %q", got)
			}
			var st unix.Stat_t
			if err := unix.Fstat(r, &st); err != nil || st.Size != 6 {
				t.Fatalf("fstat through the old reader: size %d (%v), want 6", st.Size, err)
			}
			if err := unix.Stat(fx.p("f"), &st); err != nil || st.Size != 6 {
				t.Fatalf("stat: size %d (%v), want 6", st.Size, err)
			}
			if n, err := unix.Pread(r, buf, 0); err != nil || string(buf[:n]) != "base++" {
				t.Fatalf("read through the old reader after the copy-up: %q %v, want \"base++\"", buf[:max(n, 0)], err)
			}
			if got := mustRead(t, fx.p("f")); got != "base++" {
				t.Fatalf("view: %q", got)
			}
		})
	}
}

func hashDir(t testing.TB, dir string) string {
	t.Helper()
	var b strings.Builder
	v := viewOf(t, dir)
	keys := make([]string, 0, len(v))
	for k := range v {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		fmt.Fprintf(&b, "%s=%q;", k, v[k])
	}
	return b.String()
}

func TestConcurrentWritersDuringCheckpoint(t *testing.T) {
	for _, pt := range []bool{false, true} {
		t.Run(fmt.Sprintf("passthrough=%v", pt), func(t *testing.T) { concurrentWriters(t, Options{Passthrough: pt}) })
	}
}

func concurrentWriters(t *testing.T, opts Options) {
	fx := mountT(t, nil, opts)
	const writers = 4
	const perWriter = 400
	var wg sync.WaitGroup
	errs := make(chan error, writers)
	for w := 0; w < writers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			fh, err := os.OpenFile(fx.p(fmt.Sprintf("w%d", w)), os.O_CREATE|os.O_WRONLY|os.O_APPEND, 0o644)
			if err != nil {
				errs <- err
				return
			}
			defer fh.Close()
			for i := 0; i < perWriter; i++ {
				if _, err := fmt.Fprintf(fh, "%d,", i); err != nil {
					errs <- err
					return
				}
				if i%50 == 0 {
					mustWrite(t, fx.p(fmt.Sprintf("d%d/f%d", w, i)), "x")
				}
			}
		}(w)
	}
	type frozenLayer struct{ path, hash string }
	var frozen []frozenLayer
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for stop := false; !stop; {
		select {
		case <-done:
			stop = true
		default:
		}
		fx.checkpoint(t)
		fx.fs.mu.RLock()
		fl := fx.fs.st.frozen
		fx.fs.mu.RUnlock()
		if len(fl) == 0 {
			continue
		}
		l := fl[len(fl)-1]
		if len(frozen) == 0 || frozen[len(frozen)-1].path != l.path {
			frozen = append(frozen, frozenLayer{l.path, hashDir(t, l.path)})
		}
	}
	close(errs)
	for err := range errs {
		t.Fatal(err)
	}
	for _, fl := range frozen {
		if h := hashDir(t, fl.path); h != fl.hash {
			t.Fatalf("frozen layer %s changed after its checkpoint:\nthen %.300s\nnow  %.300s", fl.path, fl.hash, h)
		}
	}
	for w := 0; w < writers; w++ {
		var want strings.Builder
		for i := 0; i < perWriter; i++ {
			fmt.Fprintf(&want, "%d,", i)
		}
		if got := mustRead(t, fx.p(fmt.Sprintf("w%d", w))); got != want.String() {
			t.Fatalf("writer %d: content lost or reordered (%d bytes, want %d)", w, len(got), want.Len())
		}
	}
	t.Logf("%d checkpoints froze %d layers during the writes", len(frozen), len(frozen))
}

func TestSwitchErrorsLeaveViewUnchanged(t *testing.T) {
	fx := mountT(t, nil, Options{})
	mustWrite(t, fx.p("f"), "1")
	c1 := fx.checkpoint(t)
	mustWrite(t, fx.p("f"), "2")
	if err := fx.fs.Switch("0123456789abcdef"); err == nil {
		t.Fatal("switch to an unknown id succeeded")
	}
	if err := fx.fs.Switch("../../etc"); err == nil {
		t.Fatal("switch to a path-like id succeeded")
	}
	// A checkpoint of another mount.
	other := layer.Checkpoint{ID: layer.NewID(), Mount: "someone-else", Created: time.Now()}
	if err := fx.store.SaveCheckpoint(other); err != nil {
		t.Fatal(err)
	}
	if err := fx.fs.Switch(other.ID); err == nil || !strings.Contains(err.Error(), "belongs to mount") {
		t.Fatalf("switch to another mount's checkpoint: %v", err)
	}
	// A corrupted checkpoint (its layer is gone).
	mustWrite(t, fx.p("g"), "g")
	c2 := fx.checkpoint(t)
	cp, _ := fx.store.Checkpoint(c2)
	if err := os.Rename(fx.store.LayerPath(cp.Layers[len(cp.Layers)-1]), fx.store.LayerPath("moved")); err != nil {
		t.Fatal(err)
	}
	if err := fx.fs.Switch(c2); err == nil {
		t.Fatal("switch to a corrupted checkpoint succeeded")
	}
	if err := os.Rename(fx.store.LayerPath("moved"), fx.store.LayerPath(cp.Layers[len(cp.Layers)-1])); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, fx.p("f")); got != "2" {
		t.Fatalf("view changed by a failed switch: %q", got)
	}
	fx.restore(t, c1)
	if got := mustRead(t, fx.p("f")); got != "1" {
		t.Fatalf("restore: %q", got)
	}
}

func TestForkAndSharedStore(t *testing.T) {
	fx := mountT(t, func(l string) { mustWrite(t, l+"/base", "b") }, Options{MountID: "parent"})
	mustWrite(t, fx.p("f"), "parent")
	c := fx.checkpoint(t)
	var kids []*FS
	for i := 0; i < 3; i++ {
		mp := filepath.Join(t.TempDir(), "kid")
		os.Mkdir(mp, 0o755)
		k, err := Mount(fx.store, mp, Options{MountID: fmt.Sprintf("kid%d", i), From: c, NoDurable: true})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = k.Unmount() })
		kids = append(kids, k)
		mustWrite(t, mp+"/f", fmt.Sprintf("kid%d", i))
		if _, err := k.Checkpoint(); err != nil {
			t.Fatal(err)
		}
	}
	if got := mustRead(t, fx.p("f")); got != "parent" {
		t.Fatalf("a fork's write leaked into the parent: %q", got)
	}
	for i, k := range kids {
		if got := mustRead(t, k.Mountpoint()+"/f"); got != fmt.Sprintf("kid%d", i) {
			t.Fatalf("kid %d sees %q", i, got)
		}
		if got := mustRead(t, k.Mountpoint()+"/base"); got != "b" {
			t.Fatalf("kid %d base %q", i, got)
		}
		if err := k.Switch(c); err == nil {
			t.Fatal("a fork switched to its parent's checkpoint (must fork instead)")
		}
	}
	// GC frees nothing a checkpoint or a live mount uses.
	if _, err := fx.store.GC(0); err != nil {
		t.Fatal(err)
	}
	for i, k := range kids {
		if got := mustRead(t, k.Mountpoint()+"/f"); got != fmt.Sprintf("kid%d", i) {
			t.Fatalf("after GC kid %d sees %q", i, got)
		}
	}
	fx.restore(t, c)
	if got := mustRead(t, fx.p("f")); got != "parent" {
		t.Fatalf("parent after GC: %q", got)
	}
}

func TestCompactKeepsEveryCheckpoint(t *testing.T) {
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/keep", "k")
		mustWrite(t, l+"/dir/a", "a")
		mustWrite(t, l+"/gone", "g")
	}, Options{})
	type saved struct {
		id   string
		view map[string]string
	}
	var cps []saved
	step := func(f func()) {
		f()
		cps = append(cps, saved{fx.checkpoint(t), viewOf(t, fx.mp)})
	}
	step(func() { mustWrite(t, fx.p("new1"), "1") })
	step(func() { os.Remove(fx.p("gone")) })
	step(func() { os.Rename(fx.p("dir"), fx.p("moved")) })
	step(func() { mustWrite(t, fx.p("moved/b"), "b"); os.RemoveAll(fx.p("new1")) })
	step(func() { os.Mkdir(fx.p("new1"), 0o755); mustWrite(t, fx.p("new1/x"), "x") })
	step(func() { mustWrite(t, fx.p("keep"), "k2") })
	if d := fx.fs.Depth(); d != 6 {
		t.Fatalf("depth %d", d)
	}
	if err := fx.fs.Compact(); err != nil {
		t.Fatal(err)
	}
	if d := fx.fs.Depth(); d != 1 {
		t.Fatalf("depth after compaction %d", d)
	}
	sameView(t, "current view after compaction", viewOf(t, fx.mp), cps[len(cps)-1].view)
	for i := len(cps) - 1; i >= 0; i-- {
		fx.restore(t, cps[i].id)
		sameView(t, fmt.Sprintf("checkpoint %d after compaction", i), viewOf(t, fx.mp), cps[i].view)
	}
}

func TestDeepStack(t *testing.T) {
	fx := mountT(t, func(l string) { mustWrite(t, l+"/base", "b") }, Options{})
	const depth = 300
	var mid string
	for i := 0; i < depth; i++ {
		mustWrite(t, fx.p(fmt.Sprintf("d%d/f", i%10)), fmt.Sprint(i))
		id := fx.checkpoint(t)
		if i == depth/2 {
			mid = id
		}
	}
	if d := fx.fs.Depth(); d != depth {
		t.Fatalf("depth %d", d)
	}
	for i := 0; i < 10; i++ {
		if got := mustRead(t, fx.p(fmt.Sprintf("d%d/f", i))); got != fmt.Sprint(depth-10+i) {
			t.Fatalf("d%d/f = %q", i, got)
		}
	}
	if got := mustRead(t, fx.p("base")); got != "b" {
		t.Fatal("base lost")
	}
	fx.restore(t, mid)
	if got := mustRead(t, fx.p("d0/f")); got != fmt.Sprint(depth/2-depth/2%10) {
		t.Fatalf("after restore d0/f = %q", got)
	}
	if err := fx.fs.Compact(); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, fx.p("d0/f")); got != fmt.Sprint(depth/2-depth/2%10) {
		t.Fatalf("after compaction d0/f = %q", got)
	}
}

func TestResumeAfterCrash(t *testing.T) {
	requireFUSE(t)
	dir := t.TempDir()
	st, _ := layer.OpenStore(filepath.Join(dir, "state"))
	mp := filepath.Join(dir, "mnt")
	os.Mkdir(mp, 0o755)
	f, err := Mount(st, mp, Options{MountID: "crashy"})
	if err != nil {
		t.Fatal(err)
	}
	mustWrite(t, mp+"/kept", "checkpointed")
	if _, err := f.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, mp+"/upper", "not checkpointed")
	// Simulate a crash: the server goes away without cleaning its record.
	if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
		t.Fatal(err)
	}
	f.server.Wait()
	f.reg.closeAll()
	rec, err := st.Mount("crashy")
	if err != nil {
		t.Fatalf("mount record gone after a crash: %v", err)
	}
	rec.PID = 1 << 30 // a dead process
	if err := st.SaveMount(rec, false); err != nil {
		t.Fatal(err)
	}
	f2, err := Mount(st, mp, Options{MountID: "crashy"})
	if err != nil {
		t.Fatal(err)
	}
	defer f2.Unmount()
	if got := mustRead(t, mp+"/kept"); got != "checkpointed" {
		t.Fatalf("kept: %q", got)
	}
	if got := mustRead(t, mp+"/upper"); got != "not checkpointed" {
		t.Fatalf("upper: %q", got)
	}
}

func TestSandboxRootUsage(t *testing.T) {
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/etc/hostname", "box")
		os.MkdirAll(l+"/proc", 0o755)
		os.MkdirAll(l+"/tmp", 0o1777)
	}, Options{})
	// Another user reads through the mount (allow_other, default_permissions).
	for d := filepath.Dir(fx.mp); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	cmd := exec.Command("cat", fx.p("etc/hostname"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000}}
	out, err := cmd.CombinedOutput()
	if err != nil || string(out) != "box" {
		t.Fatalf("read as uid 1000: %v %q", err, out)
	}
	// ... but permissions hold.
	if err := os.Chmod(fx.p("etc/hostname"), 0o600); err != nil {
		t.Fatal(err)
	}
	cmd = exec.Command("cat", fx.p("etc/hostname"))
	cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000}}
	if err := cmd.Run(); err == nil {
		t.Fatal("uid 1000 read a 0600 root file")
	}
	// Mounts on top of a directory of the view work and a switch keeps
	// them (the mount point's dentry is not invalidated).
	if err := unix.Mount("proc", fx.p("proc"), "proc", 0, ""); err != nil {
		t.Fatalf("mount proc on top: %v", err)
	}
	defer unix.Unmount(fx.p("proc"), unix.MNT_DETACH)
	c := fx.checkpoint(t)
	mustWrite(t, fx.p("tmp/x"), "x")
	fx.restore(t, c)
	if _, err := os.Stat(fx.p("proc/self/status")); err != nil {
		t.Fatalf("proc mount lost after a switch: %v", err)
	}
}

func TestPassthrough(t *testing.T) {
	data := strings.Repeat("0123456789abcdef", 1<<16) // 1 MiB
	fx := mountT(t, nil, Options{Passthrough: true})
	r0, w0 := fx.fs.Requests()
	mustWrite(t, fx.p("big"), data)
	for i := 0; i < 4; i++ {
		// A node serves a plain handle while go-fuse still releases its
		// last one (see releases): the close's RELEASE is answered
		// asynchronously, and under load the next open can come first
		// (1 READ reached the daemon in a CI run). Wait for it.
		if err := fx.fs.WaitIdle(context.Background()); err != nil {
			t.Fatal(err)
		}
		if got := mustRead(t, fx.p("big")); got != data {
			t.Fatal("passthrough read returned wrong data")
		}
	}
	r1, w1 := fx.fs.Requests()
	if r1 != r0 || w1 != w0 {
		t.Fatalf("%d READ and %d WRITE requests reached the daemon: passthrough is off", r1-r0, w1-w0)
	}
	// A passthrough writer across a checkpoint never writes the frozen
	// layer; a reader across a restore follows the view.
	w, err := os.OpenFile(fx.p("big"), os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer w.Close()
	if _, err := w.WriteAt([]byte("A"), 0); err != nil {
		t.Fatal(err)
	}
	c1 := fx.checkpoint(t)
	frozen := fx.fs.st.frozen[len(fx.fs.st.frozen)-1]
	if _, err := w.WriteAt([]byte("B"), 1); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, frozen.path+"/big"); got[:4] != "A123" {
		t.Fatalf("frozen layer: %q", got[:4])
	}
	if got := mustRead(t, fx.p("big")); got[:4] != "AB23" {
		t.Fatalf("view: %q", got[:4])
	}
	r, err := os.Open(fx.p("big"))
	if err != nil {
		t.Fatal(err)
	}
	defer r.Close()
	fx.restore(t, c1)
	buf := make([]byte, 4)
	if _, err := r.ReadAt(buf, 0); err != nil || string(buf) != "A123" {
		t.Fatalf("reader across restore: %q %v", buf, err)
	}
	if _, err := w.WriteAt([]byte("C"), 2); err != nil {
		t.Fatal(err)
	}
	if got := mustRead(t, fx.p("big")); got[:4] != "A1C3" {
		t.Fatalf("writer across restore: %q", got[:4])
	}
	if got := mustRead(t, frozen.path+"/big"); got[:4] != "A123" {
		t.Fatalf("frozen layer after restore: %q", got[:4])
	}
}

func TestDifferentialPassthrough(t *testing.T) {
	runDifferentialOpts(t, 7, 1500, Options{Passthrough: true})
}

func TestTakeFSEffects(t *testing.T) {
	fx := mountT(t, func(l string) { mustWrite(t, l+"/old", "o") }, Options{})
	if e := fx.fs.TakeFSEffects(); e.UpperNonEmpty || e.Created+e.Modified+e.Deleted != 0 {
		t.Fatalf("fresh mount reports effects: %+v", e)
	}
	// Reads change nothing.
	mustRead(t, fx.p("old"))
	os.ReadDir(fx.mp)
	if e := fx.fs.TakeFSEffects(); e.UpperNonEmpty || e.Created+e.Modified+e.Deleted+e.MetaChanged+e.Renamed != 0 {
		t.Fatalf("reads reported as effects: %+v", e)
	}
	mustWrite(t, fx.p("new"), "12345")
	os.Remove(fx.p("old"))
	os.Rename(fx.p("new"), fx.p("renamed"))
	os.Chmod(fx.p("renamed"), 0o600)
	e := fx.fs.TakeFSEffects()
	if e.Created != 1 || e.Deleted != 1 || e.Renamed != 1 || e.MetaChanged != 1 || e.BytesWritten != 5 || !e.UpperNonEmpty {
		t.Fatalf("effects %+v", e)
	}
	if len(e.Samples) == 0 || e.Samples[0].Op != "create" || e.Samples[0].Path != "/new" {
		t.Fatalf("samples %+v", e.Samples)
	}
	// Counters reset; after a checkpoint the upper is empty again.
	fx.checkpoint(t)
	if e := fx.fs.TakeFSEffects(); e.UpperNonEmpty || e.Created != 0 {
		t.Fatalf("after checkpoint: %+v", e)
	}
}

func TestODirect(t *testing.T) {
	fx := mountT(t, nil, Options{})
	fd, err := unix.Open(fx.p("direct"), unix.O_CREAT|unix.O_RDWR|unix.O_DIRECT, 0o644)
	if err != nil {
		t.Fatalf("O_DIRECT open: %v", err)
	}
	defer unix.Close(fd)
	buf, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_ANON|unix.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(buf)
	copy(buf, "direct data")
	if _, err := unix.Pwrite(fd, buf, 0); err != nil {
		t.Fatalf("O_DIRECT write: %v", err)
	}
	if got := mustRead(t, fx.p("direct")); !strings.HasPrefix(got, "direct data") {
		t.Fatalf("read back %q", got[:11])
	}
}

// TestCheckpointBeforeCreatedNodeIsAttached takes a checkpoint in the window
// between a passthrough Create handler's return and go-fuse attaching the
// new node to its parent: the file must still move into the new upper, so
// that writes through the open descriptor never land in the frozen layer.
func TestCheckpointBeforeCreatedNodeIsAttached(t *testing.T) {
	fx := mountT(t, nil, Options{Passthrough: true})
	var once sync.Once
	hook := func() { once.Do(func() { fx.checkpoint(t) }) }
	fx.fs.afterCreate.Store(&hook)
	fh, err := os.OpenFile(fx.p("f"), os.O_CREATE|os.O_WRONLY, 0o644)
	if err != nil {
		t.Fatal(err)
	}
	fx.fs.afterCreate.Store(nil)
	defer fh.Close()
	fx.fs.mu.RLock()
	fl := fx.fs.st.frozen
	fx.fs.mu.RUnlock()
	if len(fl) == 0 {
		t.Fatal("the checkpoint in the hook froze no layer")
	}
	frozen := fl[len(fl)-1].path
	if _, err := fh.WriteString("after the checkpoint"); err != nil {
		t.Fatal(err)
	}
	if b, err := os.ReadFile(filepath.Join(frozen, "f")); err != nil || len(b) != 0 {
		t.Fatalf("frozen layer's f = %q, %v; want an empty file", b, err)
	}
	if got := mustRead(t, fx.p("f")); got != "after the checkpoint" {
		t.Fatalf("view: %q", got)
	}
}
