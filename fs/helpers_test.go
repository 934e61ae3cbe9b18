package fs

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/layer"
)

// requireFUSE skips (or fails under CI) when FUSE mounts are impossible.
func requireFUSE(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.RequireNoErr(t, err, "/dev/fuse")
}

type fixture struct {
	store *layer.Store
	mp    string
	fs    *FS
	lower string
}

// mountT mounts a fresh view (optionally over a lower directory prepared
// by prep) and unmounts it at cleanup.
func mountT(t testing.TB, prep func(lower string), opts Options) *fixture {
	t.Helper()
	requireFUSE(t)
	dir := t.TempDir()
	st, err := layer.OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	fx := &fixture{store: st, mp: filepath.Join(dir, "mnt")}
	if err := os.Mkdir(fx.mp, 0o755); err != nil {
		t.Fatal(err)
	}
	if prep != nil {
		fx.lower = filepath.Join(dir, "lower")
		if err := os.Mkdir(fx.lower, 0o755); err != nil {
			t.Fatal(err)
		}
		prep(fx.lower)
		opts.Lowers = append(opts.Lowers, fx.lower)
	}
	f, err := Mount(st, fx.mp, opts)
	if err != nil {
		t.Fatal(err)
	}
	fx.fs = f
	t.Cleanup(func() {
		if err := f.Unmount(); err != nil {
			t.Errorf("unmount: %v", err)
		}
	})
	return fx
}

func (fx *fixture) p(rel string) string { return filepath.Join(fx.mp, rel) }

func mustWrite(t testing.TB, path, data string) {
	t.Helper()
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, []byte(data), 0o644); err != nil {
		t.Fatal(err)
	}
}

func mustRead(t testing.TB, path string) string {
	t.Helper()
	b, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func (fx *fixture) checkpoint(t testing.TB) string {
	t.Helper()
	id, err := fx.fs.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	return id
}

func (fx *fixture) restore(t testing.TB, id string) {
	t.Helper()
	if err := fx.fs.Switch(id); err != nil {
		t.Fatal(err)
	}
}
