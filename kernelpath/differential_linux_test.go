package kernelpath

import (
	"errors"
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

var (
	diffOps    = flag.Int("kp.ops", 1500, "operations per run of the differential test")
	diffSeed   = flag.Uint64("kp.seed", 1, "seed of the differential test")
	diffLog    = flag.Bool("kp.trace", false, "log every operation of the differential test")
	diffVerify = flag.Bool("kp.verify", false, "verify every checkpoint at once through a second mount (slow)")
)

// TestDifferential applies one seeded random sequence of file operations,
// checkpoints and switches to a kernelpath mount and to a model (a plain
// directory, fully copied at each checkpoint) and checks after every
// switch and at the end that both trees are identical: paths, types,
// modes, owners, sizes, contents, symlink targets, user xattrs, link
// counts. Errors of each operation must match too.
//
// Hard links are left out on purpose: native overlayfs (index=off) breaks
// a hard link of a lower file on copy-up, which a plain directory does not.
func TestDifferential(t *testing.T) {
	cases := []struct {
		name   string
		fs     string
		chains bool // rare switches: long chains of delta layers
		lower  bool // a read-only base directory under the layers
	}{
		{"xfs", "xfs", false, false},
		{"btrfs", "btrfs", false, false},
		{"xfs-chains", "xfs", true, false},
		{"xfs-lower", "xfs", false, true},
		{"xfs-lower-chains", "xfs", true, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := newStore(t, tc.fs)
			model := filepath.Join(filepath.Dir(st.Dir()), "model")
			if err := os.Mkdir(model, 0o755); err != nil {
				t.Fatal(err)
			}
			var lowers []string
			if tc.lower {
				base := filepath.Join(filepath.Dir(st.Dir()), "base")
				makeBase(t, base, *diffSeed)
				copyTreeCP(t, base, model)
				lowers = []string{base}
			}
			f := mountKP(t, st, Options{MountID: "diff", Lowers: lowers})
			// The view's root is the upper's root: give the model the same
			// mode.
			var rs unix.Stat_t
			if err := unix.Stat(f.Mountpoint(), &rs); err != nil {
				t.Fatal(err)
			}
			_ = os.Chmod(model, os.FileMode(rs.Mode&0o777))
			if got, want := treeDump(t, f.Mountpoint()), treeDump(t, model); got != want {
				t.Fatalf("fresh view differs from its base:\n%s\nwant:\n%s", got, want)
			}
			runDifferentialMode(t, f, model, *diffSeed, *diffOps, tc.chains)
		})
	}
}

// makeBase fills a base directory from the test's name space: directories
// nested two deep with files, symlinks and xattrs, so the operations hit
// lower entries (copy-up, whiteouts, opaque and redirected directories).
func makeBase(t *testing.T, base string, seed uint64) {
	t.Helper()
	rng := rand.New(rand.NewPCG(seed, 0xba5e))
	for _, d := range append([]string{""}, diffDirs[1:]...) {
		dir := filepath.Join(base, d)
		if err := os.MkdirAll(dir, 0o755); err != nil {
			t.Fatal(err)
		}
		for _, n := range []string{"f0", "f1", "f2", "l0"} {
			p := filepath.Join(dir, n)
			if _, err := os.Lstat(p); err == nil {
				continue
			}
			if n == "l0" {
				if err := os.Symlink("../f0", p); err != nil {
					t.Fatal(err)
				}
				continue
			}
			data := make([]byte, rng.IntN(3000))
			for i := range data {
				data[i] = byte('A' + rng.IntN(26))
			}
			if err := os.WriteFile(p, data, 0o644); err != nil {
				t.Fatal(err)
			}
			if rng.IntN(2) == 0 {
				_ = unix.Setxattr(p, "user.base", []byte(n), 0)
			}
		}
	}
}

type diffRun struct {
	t        *testing.T
	f        layer.FS
	model    string
	rng      *rand.Rand
	saved    map[string]string // checkpoint id -> model copy
	ids      []string
	nckpt    int
	nswtch   int
	ncompact int
	// rareSwitch makes switches 8x rarer, so consecutive checkpoints
	// build long chains of delta layers.
	rareSwitch bool
}

func runDifferentialMode(t *testing.T, f layer.FS, model string, seed uint64, ops int, rareSwitch bool) {
	r := &diffRun{t: t, f: f, model: model, rng: rand.New(rand.NewPCG(seed, 0x5eed)), saved: map[string]string{}, rareSwitch: rareSwitch}
	for i := range ops {
		desc := r.step()
		if *diffLog {
			t.Logf("op %d: %s", i, desc)
		}
		if t.Failed() {
			t.Fatalf("op %d (%s) failed; seed %d", i, desc, seed)
		}
	}
	r.compare("end")
	t.Logf("%d ops, %d checkpoints, %d switches, %d compactions", ops, r.nckpt, r.nswtch, r.ncompact)
}

var (
	diffDirs  = []string{"", "a", "b", "a/c", "b/d"}
	diffNames = []string{"f0", "f1", "f2", "a", "b", "c", "d", "l0"}
)

func (r *diffRun) path() string {
	d := diffDirs[r.rng.IntN(len(diffDirs))]
	n := diffNames[r.rng.IntN(len(diffNames))]
	if d == "" {
		return n
	}
	return d + "/" + n
}

func (r *diffRun) data() []byte {
	n := r.rng.IntN(6000)
	b := make([]byte, n)
	for i := range b {
		b[i] = byte('a' + r.rng.IntN(26))
	}
	return b
}

// both runs op on the mount and on the model and checks the errnos match.
func (r *diffRun) both(desc string, op func(root string) error) string {
	e1 := op(r.f.Mountpoint())
	e2 := op(r.model)
	if errno(e1) != errno(e2) {
		r.t.Errorf("%s: mount: %v, model: %v", desc, e1, e2)
	}
	return desc
}

func errno(err error) unix.Errno {
	if err == nil {
		return 0
	}
	var e unix.Errno
	if errors.As(err, &e) {
		if e == unix.EEXIST {
			// rename(2) onto a non-empty directory may say either.
			return unix.ENOTEMPTY
		}
		return e
	}
	return unix.EIO
}

func (r *diffRun) step() string {
	p, q := r.path(), r.path()
	switch k := r.rng.IntN(100); {
	case k < 20:
		d := r.data()
		return r.both("write "+p, func(root string) error {
			// O_NONBLOCK: a FIFO without reader fails (ENXIO) instead of blocking.
			fh, err := os.OpenFile(filepath.Join(root, p), os.O_WRONLY|os.O_CREATE|os.O_TRUNC|unix.O_NONBLOCK, 0o644)
			if err != nil {
				return err
			}
			_, err = fh.Write(d)
			fh.Close()
			return err
		})
	case k < 28:
		d := r.data()
		d = d[:min(len(d), r.rng.IntN(100))]
		return r.both("append "+p, func(root string) error {
			fh, err := os.OpenFile(filepath.Join(root, p), os.O_WRONLY|os.O_APPEND|unix.O_NONBLOCK, 0)
			if err != nil {
				return err
			}
			_, err = fh.Write(d)
			fh.Close()
			return err
		})
	case k < 32:
		n := int64(r.rng.IntN(8000))
		return r.both(fmt.Sprintf("truncate %s %d", p, n), func(root string) error {
			return unix.Truncate(filepath.Join(root, p), n)
		})
	case k < 42:
		return r.both("mkdir "+p, func(root string) error { return unix.Mkdir(filepath.Join(root, p), 0o755) })
	case k < 52:
		return r.both("unlink "+p, func(root string) error { return unix.Unlink(filepath.Join(root, p)) })
	case k < 57:
		return r.both("rmdir "+p, func(root string) error { return unix.Rmdir(filepath.Join(root, p)) })
	case k < 67:
		return r.both("rename "+p+" "+q, func(root string) error {
			return unix.Rename(filepath.Join(root, p), filepath.Join(root, q))
		})
	case k < 71:
		target := "../" + q
		return r.both("symlink "+p, func(root string) error { return unix.Symlink(target, filepath.Join(root, p)) })
	case k < 76:
		m := []uint32{0o644, 0o600, 0o755, 0o700, 0o640}[r.rng.IntN(5)]
		return r.both(fmt.Sprintf("chmod %s %o", p, m), func(root string) error {
			var s unix.Stat_t
			if err := unix.Lstat(filepath.Join(root, p), &s); err != nil {
				return err
			}
			if s.Mode&unix.S_IFMT == unix.S_IFLNK {
				return nil
			}
			return unix.Chmod(filepath.Join(root, p), m)
		})
	case k < 80:
		v := fmt.Sprint(r.rng.IntN(1000))
		return r.both("setxattr "+p, func(root string) error {
			return unix.Lsetxattr(filepath.Join(root, p), "user.k", []byte(v), 0)
		})
	case k < 82:
		return r.both("mkfifo "+p, func(root string) error { return unix.Mkfifo(filepath.Join(root, p), 0o644) })
	case k < 84:
		if err := r.f.Compact(); err != nil {
			r.t.Errorf("compact: %v", err)
		}
		r.ncompact++
		r.compare("compact")
		return "compact"
	case k < 92:
		id, err := r.f.Checkpoint()
		if err != nil {
			r.t.Errorf("checkpoint: %v", err)
			return "checkpoint"
		}
		dir := r.model + ".ckpt-" + id
		if err := os.Mkdir(dir, 0o755); err != nil {
			r.t.Fatal(err)
		}
		copyTreeCP(r.t, r.model, dir)
		r.saved[id] = dir
		r.ids = append(r.ids, id)
		if *diffVerify {
			r.verify(id, dir)
		}
		r.nckpt++
		return "checkpoint " + id
	default:
		if len(r.ids) == 0 || r.rareSwitch && r.rng.IntN(8) != 0 {
			return "noop"
		}
		id := r.ids[r.rng.IntN(len(r.ids))]
		if err := r.f.Switch(id); err != nil {
			r.t.Errorf("switch %s: %v", id, err)
			return "switch"
		}
		if err := os.RemoveAll(r.model); err != nil {
			r.t.Fatal(err)
		}
		if err := os.Mkdir(r.model, 0o755); err != nil {
			r.t.Fatal(err)
		}
		copyTreeCP(r.t, r.saved[id], r.model)
		r.nswtch++
		r.compare("switch " + id)
		return "switch " + id
	}
}

// verify mounts checkpoint id with the kernel path and compares it with
// the model's copy.
func (r *diffRun) verify(id, dir string) {
	kf, ok := r.f.(*FS)
	if !ok {
		return
	}
	mp := r.t.TempDir()
	g, err := Mount(kf.st, mp, Options{MountID: "verify-" + id, From: id, Logger: kf.log})
	if err != nil {
		r.t.Errorf("verify %s: %v", id, err)
		return
	}
	defer g.Unmount()
	if got, want := treeDump(r.t, mp), treeDump(r.t, dir); got != want {
		r.t.Errorf("checkpoint %s differs from the model\n--- view\n%s\n--- model\n%s", id, got, want)
		if rec, err := kf.st.Checkpoint(id); err == nil {
			for _, l := range rec.Layers {
				out, _ := exec.Command("sh", "-c", "cd "+kf.st.LayerPath(l)+" && find . -printf '%p %y %i\\n' && getfattr -R -d -m trusted . 2>/dev/null").CombinedOutput()
				r.t.Logf("layer %s:\n%s", l, out)
			}
		}
	}
}

func (r *diffRun) compare(when string) {
	got, want := treeDump(r.t, r.f.Mountpoint()), treeDump(r.t, r.model)
	if got != want {
		r.t.Errorf("%s: view differs from model\n--- view\n%s\n--- model\n%s", when, got, want)
	}
}
