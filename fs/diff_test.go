package fs

import (
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"flag"
	"fmt"
	"math/rand"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

var (
	diffOps  = flag.Int("fs.ops", 2500, "operations in the differential test")
	diffSeed = flag.Int64("fs.seed", 1, "seed of the differential test (0 = random)")
	diffLong = flag.Bool("fs.long", false, "run the long differential test (50k ops, 4 seeds)")
)

// treeEntry is what the differential test compares for one path.
type treeEntry struct {
	typ    uint32
	mode   uint32
	uid    uint32
	gid    uint32
	size   int64
	nlink  uint64
	hash   string
	target string
	rdev   uint64
	xattrs string
}

func (e treeEntry) String() string {
	return fmt.Sprintf("type=%o mode=%o uid=%d gid=%d size=%d nlink=%d hash=%.8s target=%q rdev=%d xattrs=%s",
		e.typ, e.mode, e.uid, e.gid, e.size, e.nlink, e.hash, e.target, e.rdev, e.xattrs)
}

// snapshotTree describes every entry under root.
func snapshotTree(t testing.TB, root string) map[string]treeEntry {
	t.Helper()
	out := map[string]treeEntry{}
	err := filepath.WalkDir(root, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if p == root {
			return nil
		}
		rel := strings.TrimPrefix(p, root+"/")
		var s unix.Stat_t
		if err := unix.Lstat(p, &s); err != nil {
			return err
		}
		e := treeEntry{typ: s.Mode & unix.S_IFMT, mode: s.Mode & 07777, uid: s.Uid, gid: s.Gid}
		switch e.typ {
		case unix.S_IFREG:
			b, err := os.ReadFile(p)
			if err != nil {
				return err
			}
			h := sha256.Sum256(b)
			e.hash = hex.EncodeToString(h[:])
			e.size = s.Size
			e.nlink = uint64(s.Nlink)
		case unix.S_IFLNK:
			e.target, _ = os.Readlink(p)
		case unix.S_IFCHR, unix.S_IFBLK:
			e.rdev = s.Rdev
			e.nlink = uint64(s.Nlink)
		case unix.S_IFDIR:
		default:
			e.nlink = uint64(s.Nlink)
		}
		if e.typ != unix.S_IFLNK {
			buf := make([]byte, 4096)
			n, _ := unix.Llistxattr(p, buf)
			var names []string
			for _, a := range strings.Split(string(buf[:max(n, 0)]), "\x00") {
				if strings.HasPrefix(a, "user.") {
					v := make([]byte, 256)
					k, _ := unix.Lgetxattr(p, a, v)
					names = append(names, a+"="+string(v[:max(k, 0)]))
				}
			}
			sort.Strings(names)
			e.xattrs = strings.Join(names, ",")
		}
		out[rel] = e
		return nil
	})
	if err != nil {
		t.Fatalf("walk %s: %v", root, err)
	}
	return out
}

func compareTrees(t testing.TB, what, model, view string) {
	t.Helper()
	m := snapshotTree(t, model)
	v := snapshotTree(t, view)
	var diffs []string
	for p, me := range m {
		ve, ok := v[p]
		if !ok {
			diffs = append(diffs, fmt.Sprintf("missing in view: %s (%v)", p, me))
			continue
		}
		if me != ve {
			diffs = append(diffs, fmt.Sprintf("differs: %s\n  model %v\n  view  %v", p, me, ve))
		}
	}
	for p, ve := range v {
		if _, ok := m[p]; !ok {
			diffs = append(diffs, fmt.Sprintf("extra in view: %s (%v)", p, ve))
		}
	}
	if len(diffs) > 0 {
		sort.Strings(diffs)
		if len(diffs) > 20 {
			diffs = diffs[:20]
		}
		if os.Getenv("FS_DEBUG_DROP") != "" {
			_ = os.WriteFile("/proc/sys/vm/drop_caches", []byte("2"), 0)
			v2 := snapshotTree(t, view)
			for p, me := range m {
				if v2[p] != me {
					t.Logf("still differs after drop_caches: %s: %v", p, v2[p])
				}
			}
		}
		t.Fatalf("%s: trees differ:\n%s", what, strings.Join(diffs, "\n"))
	}
}

// op is one file-system operation applied identically to the model and
// the view.
type op struct {
	desc string
	do   func(root string) error
}

type gen struct {
	r     *rand.Rand
	model string
}

var names = []string{"a", "b", "c", "d"}

func (g *gen) randPath() string {
	// Prefer existing paths so operations hit real entries.
	if g.r.Intn(3) > 0 {
		var existing []string
		_ = filepath.WalkDir(g.model, func(p string, d os.DirEntry, err error) error {
			if err == nil && p != g.model {
				existing = append(existing, strings.TrimPrefix(p, g.model+"/"))
			}
			return nil
		})
		if len(existing) > 0 {
			p := existing[g.r.Intn(len(existing))]
			if g.r.Intn(3) == 0 {
				p = filepath.Join(p, names[g.r.Intn(len(names))])
			}
			return p
		}
	}
	depth := 1 + g.r.Intn(3)
	parts := make([]string, depth)
	for i := range parts {
		parts[i] = names[g.r.Intn(len(names))]
	}
	return filepath.Join(parts...)
}

func (g *gen) content() []byte {
	n := g.r.Intn(3) * g.r.Intn(5000)
	b := make([]byte, n)
	g.r.Read(b)
	return b
}

func (g *gen) next() op {
	p := g.randPath()
	switch k := g.r.Intn(20); k {
	case 0, 1, 2:
		data := g.content()
		return op{fmt.Sprintf("write %s (%d bytes)", p, len(data)), func(root string) error {
			fh, err := os.OpenFile(filepath.Join(root, p), os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NONBLOCK, 0o644)
			if err != nil {
				return err
			}
			_, err = fh.Write(data)
			if cerr := fh.Close(); err == nil {
				err = cerr
			}
			return err
		}}
	case 3:
		data := g.content()
		return op{fmt.Sprintf("append %s", p), func(root string) error {
			fh, err := os.OpenFile(filepath.Join(root, p), os.O_WRONLY|os.O_APPEND|unix.O_NONBLOCK, 0)
			if err != nil {
				return err
			}
			_, err = fh.Write(data)
			if cerr := fh.Close(); err == nil {
				err = cerr
			}
			return err
		}}
	case 4:
		data := g.content()
		off := int64(g.r.Intn(3000))
		return op{fmt.Sprintf("pwrite %s @%d", p, off), func(root string) error {
			fh, err := os.OpenFile(filepath.Join(root, p), os.O_WRONLY|unix.O_NONBLOCK, 0)
			if err != nil {
				return err
			}
			_, err = fh.WriteAt(data, off)
			if cerr := fh.Close(); err == nil {
				err = cerr
			}
			return err
		}}
	case 5, 6:
		return op{"mkdir " + p, func(root string) error { return os.Mkdir(filepath.Join(root, p), 0o755) }}
	case 7:
		return op{"unlink " + p, func(root string) error { return unix.Unlink(filepath.Join(root, p)) }}
	case 8:
		return op{"rmdir " + p, func(root string) error { return unix.Rmdir(filepath.Join(root, p)) }}
	case 9, 10:
		q := g.randPath()
		flags := uint(0)
		if g.r.Intn(5) == 0 {
			flags = unix.RENAME_NOREPLACE
		}
		return op{fmt.Sprintf("rename %s %s flags=%d", p, q, flags), func(root string) error {
			return unix.Renameat2(unix.AT_FDCWD, filepath.Join(root, p), unix.AT_FDCWD, filepath.Join(root, q), flags)
		}}
	case 11:
		q := g.randPath()
		return op{fmt.Sprintf("link %s %s", p, q), func(root string) error {
			return os.Link(filepath.Join(root, p), filepath.Join(root, q))
		}}
	case 12:
		target := "../" + g.randPath()
		return op{fmt.Sprintf("symlink %s -> %s", p, target), func(root string) error {
			return os.Symlink(target, filepath.Join(root, p))
		}}
	case 13:
		mode := uint32(g.r.Intn(0o1000)) | 0o400
		return op{fmt.Sprintf("chmod %s %o", p, mode), func(root string) error {
			return unix.Fchmodat(unix.AT_FDCWD, filepath.Join(root, p), mode, 0)
		}}
	case 14:
		uid := []int{0, 1000, 1001}[g.r.Intn(3)]
		return op{fmt.Sprintf("lchown %s %d", p, uid), func(root string) error {
			return os.Lchown(filepath.Join(root, p), uid, uid)
		}}
	case 15:
		v := fmt.Sprintf("v%d", g.r.Intn(100))
		return op{fmt.Sprintf("setxattr %s %s", p, v), func(root string) error {
			return unix.Setxattr(filepath.Join(root, p), "user.t", []byte(v), 0)
		}}
	case 16:
		return op{"removexattr " + p, func(root string) error {
			return unix.Removexattr(filepath.Join(root, p), "user.t")
		}}
	case 17:
		size := int64(g.r.Intn(6000))
		return op{fmt.Sprintf("truncate %s %d", p, size), func(root string) error {
			return os.Truncate(filepath.Join(root, p), size)
		}}
	case 18:
		return op{"mkfifo " + p, func(root string) error { return unix.Mkfifo(filepath.Join(root, p), 0o640) }}
	default:
		return op{"mknod " + p, func(root string) error {
			return unix.Mknod(filepath.Join(root, p), unix.S_IFCHR|0o600, int(unix.Mkdev(1, 3)))
		}}
	}
}

func copyTree(t testing.TB, from, to string) {
	t.Helper()
	if err := os.RemoveAll(to); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("cp", "-a", from, to).CombinedOutput()
	if err != nil {
		t.Fatalf("cp -a %s %s: %v: %s", from, to, err, out)
	}
}

func errKind(err error) string {
	if err == nil {
		return "ok"
	}
	var e unix.Errno
	if errors.As(err, &e) {
		return e.Error()
	}
	return "error"
}

// runDifferential applies n random operations to a mount and to a plain
// model directory, with checkpoints and restores to random earlier
// checkpoints, and compares the trees after every restore and at the end.
func runDifferential(t *testing.T, seed int64, n int) {
	runDifferentialOpts(t, seed, n, Options{})
}

func runDifferentialOpts(t *testing.T, seed int64, n int, opts Options) {
	dir := t.TempDir()
	model := filepath.Join(dir, "model")
	prep := func(l string) {
		mustWrite(t, l+"/a/b", "lower b")
		mustWrite(t, l+"/a/c/d", "lower d")
		mustWrite(t, l+"/b", "lower top b")
		if err := os.Link(l+"/b", l+"/a/d"); err != nil {
			t.Fatal(err)
		}
		if err := os.Symlink("a/b", l+"/c"); err != nil {
			t.Fatal(err)
		}
		if err := unix.Setxattr(l+"/a/b", "user.t", []byte("x"), 0); err != nil {
			t.Fatal(err)
		}
	}
	fx := mountT(t, prep, opts)
	copyTree(t, fx.lower, model)
	g := &gen{r: rand.New(rand.NewSource(seed)), model: model}
	type cp struct{ id, snap string }
	var cps []cp
	var log []string
	for i := 0; i < n; i++ {
		switch x := g.r.Intn(100); {
		case x < 3:
			id := fx.checkpoint(t)
			snap := filepath.Join(dir, fmt.Sprintf("snap-%d", len(cps)))
			copyTree(t, model, snap)
			cps = append(cps, cp{id, snap})
			log = append(log, "checkpoint "+id)
			continue
		case x < 5 && len(cps) > 0:
			c := cps[g.r.Intn(len(cps))]
			fx.restore(t, c.id)
			copyTree(t, c.snap, model)
			log = append(log, "restore "+c.id)
			if os.Getenv("FS_DEBUG_DROP") != "" {
				for _, l := range fx.fs.st.top {
					out, _ := exec.Command("sh", "-c", "cd "+l.path+" && find . -printf '%p %M\\n' && getfattr -R -d -m - . 2>/dev/null").CombinedOutput()
					t.Logf("layer %s:\n%s", l.id, out)
				}
			}
			compareTrees(t, fmt.Sprintf("seed %d op %d after restore (last ops: %s)", seed, i, tail(log)), model, fx.mp)
			continue
		}
		o := g.next()
		em := o.do(model)
		ev := o.do(fx.mp)
		log = append(log, fmt.Sprintf("%s -> %s/%s", o.desc, errKind(em), errKind(ev)))
		if (em == nil) != (ev == nil) && os.Getenv("FS_DEBUG_DROP") != "" {
			_ = os.WriteFile("/proc/sys/vm/drop_caches", []byte("2"), 0)
			ev2 := o.do(fx.mp)
			t.Logf("after drop_caches the view op gives %v", ev2)
		}
		if (em == nil) != (ev == nil) {
			t.Fatalf("seed %d op %d %s: model %v, view %v (last ops: %s)", seed, i, o.desc, em, ev, tail(log))
		}
		if i%200 == 0 {
			compareTrees(t, fmt.Sprintf("seed %d op %d (last ops: %s)", seed, i, tail(log)), model, fx.mp)
		}
	}
	compareTrees(t, fmt.Sprintf("seed %d end (last ops: %s)", seed, tail(log)), model, fx.mp)
}

func tail(log []string) string {
	if p := os.Getenv("FS_DEBUG_LOG"); p != "" {
		_ = os.WriteFile(p, []byte(strings.Join(log, "\n")), 0o644)
	}
	if len(log) > 12 {
		log = log[len(log)-12:]
	}
	return "\n    " + strings.Join(log, "\n    ")
}

func TestDifferential(t *testing.T) {
	seeds := []int64{*diffSeed}
	n := *diffOps
	if *diffSeed == 0 {
		seeds = []int64{rand.Int63()}
	}
	if *diffLong {
		seeds = []int64{seeds[0], seeds[0] + 1, seeds[0] + 2, seeds[0] + 3}
		n = 50000
	}
	for _, s := range seeds {
		t.Run(fmt.Sprintf("seed=%d", s), func(t *testing.T) { runDifferential(t, s, n) })
	}
}
