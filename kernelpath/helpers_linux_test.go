package kernelpath

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/layer"
)

// loopFS makes a loop-mounted file system of kind "xfs" (reflink=1) or
// "btrfs" in a temp dir and returns its mount point; it is unmounted at
// cleanup.
func loopFS(t testing.TB, kind string) string {
	t.Helper()
	return loopFSSize(t, kind, 1<<30)
}

// loopFSSize is loopFS with a given (sparse) image size.
func loopFSSize(t testing.TB, kind string, size int64) string {
	t.Helper()
	testenv.RequireRoot(t)
	mkfs := mkfsCommand(kind)
	_, err := exec.LookPath(mkfs[0])
	testenv.Require(t, err == nil, mkfs[0]+" (xfsprogs / btrfs-progs)")
	dir := t.TempDir()
	img := filepath.Join(dir, kind+".img")
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(size); err != nil {
		t.Fatal(err)
	}
	f.Close()
	if out, err := exec.Command(mkfs[0], append(mkfs[1:], img)...).CombinedOutput(); err != nil {
		t.Fatalf("%s: %v: %s", mkfs[0], err, out)
	}
	mp := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("mount", "-o", "loop", img, mp).CombinedOutput()
	testenv.Require(t, err == nil, fmt.Sprintf("loop mount of %s: %v: %s", kind, err, out))
	t.Cleanup(func() {
		if err := unix.Unmount(mp, 0); err != nil {
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
	})
	return mp
}

// newStore opens a store on a fresh loop file system (kind "" = the
// temp dir's own file system).
func newStore(t testing.TB, kind string) *layer.Store {
	t.Helper()
	testenv.RequireRoot(t)
	base := t.TempDir()
	if kind != "" {
		base = loopFS(t, kind)
	}
	st, err := layer.OpenStore(filepath.Join(base, "state"))
	if err != nil {
		t.Fatal(err)
	}
	return st
}

// mountKP mounts a kernelpath view and unmounts it at cleanup.
func mountKP(t testing.TB, st *layer.Store, opts Options) *FS {
	t.Helper()
	mp := filepath.Join(filepath.Dir(st.Dir()), "mnt-"+layer.NewID())
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.DiscardHandler)
		if os.Getenv("KP_LOG") != "" {
			opts.Logger = slog.Default()
		}
	}
	f, err := Mount(st, mp, opts)
	if err != nil {
		t.Fatalf("Mount: %v", err)
	}
	t.Cleanup(func() {
		if err := f.Unmount(); err != nil {
			t.Errorf("Unmount: %v", err)
			_ = unix.Unmount(mp, unix.MNT_DETACH)
		}
	})
	return f
}

// treeDump describes a tree: one line per entry with type, mode, owner,
// size, content hash, symlink target and user xattrs (sorted by path).
func treeDump(t testing.TB, root string) string {
	t.Helper()
	var lines []string
	err := filepath.Walk(root, func(p string, fi os.FileInfo, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		if rel == "." {
			return nil
		}
		st := new(unix.Stat_t)
		if err := unix.Lstat(p, st); err != nil {
			return err
		}
		line := fmt.Sprintf("%s %o %d:%d", rel, st.Mode, st.Uid, st.Gid)
		switch st.Mode & unix.S_IFMT {
		case unix.S_IFREG:
			h := sha256.New()
			fh, err := os.Open(p)
			if err != nil {
				return err
			}
			_, err = io.Copy(h, fh)
			fh.Close()
			if err != nil {
				return err
			}
			line += fmt.Sprintf(" size=%d sha=%s nlink=%d", st.Size, hex.EncodeToString(h.Sum(nil))[:16], st.Nlink)
		case unix.S_IFLNK:
			target, err := os.Readlink(p)
			if err != nil {
				return err
			}
			line += " -> " + target
		case unix.S_IFCHR, unix.S_IFBLK:
			line += fmt.Sprintf(" rdev=%d", st.Rdev)
		}
		line += " " + userXattrs(p)
		lines = append(lines, line)
		return nil
	})
	if err != nil {
		t.Fatalf("dump %s: %v", root, err)
	}
	sort.Strings(lines)
	return strings.Join(lines, "\n")
}

func userXattrs(p string) string {
	buf := make([]byte, 4096)
	n, err := unix.Llistxattr(p, buf)
	if err != nil || n == 0 {
		return ""
	}
	var out []string
	for _, name := range strings.Split(strings.TrimRight(string(buf[:n]), "\x00"), "\x00") {
		if !strings.HasPrefix(name, "user.") {
			continue
		}
		v := make([]byte, 4096)
		vn, err := unix.Lgetxattr(p, name, v)
		if err != nil {
			continue
		}
		out = append(out, name+"="+string(v[:vn]))
	}
	sort.Strings(out)
	return strings.Join(out, ",")
}

// copyTreeCP copies a tree with cp -a (for the model's saved states).
func copyTreeCP(t testing.TB, src, dst string) {
	t.Helper()
	if out, err := exec.Command("cp", "-a", "--", src+"/.", dst).CombinedOutput(); err != nil {
		t.Fatalf("cp -a: %v: %s", err, out)
	}
}

func writeFile(t testing.TB, p, data string) {
	t.Helper()
	if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func readFile(t testing.TB, p string) string {
	t.Helper()
	b, err := os.ReadFile(p)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}
