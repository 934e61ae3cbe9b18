package kernelpath

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestInitStore(t *testing.T) {
	testenv.RequireRoot(t)
	for _, kind := range fsKinds {
		t.Run(kind, func(t *testing.T) {
			mkfs := map[string]string{"xfs": "mkfs.xfs", "btrfs": "mkfs.btrfs"}[kind]
			_, err := exec.LookPath(mkfs)
			testenv.Require(t, err == nil, mkfs)
			dir := t.TempDir()
			opts := StoreImage{
				Image: filepath.Join(dir, "img"), FS: kind, Size: 1 << 30,
				StateDir: filepath.Join(dir, "state"), ConfigPath: filepath.Join(dir, "etc", "store.json"),
			}
			t.Cleanup(func() { _ = unix.Unmount(opts.StateDir, unix.MNT_DETACH) })
			cfg, err := InitStore(opts)
			if err != nil {
				t.Fatal(err)
			}
			if got := fsType(opts.StateDir); got != kind {
				t.Fatalf("state dir fs = %s", got)
			}
			if !probeReflink(opts.StateDir) {
				t.Fatal("no reflink on the new state dir")
			}
			if _, err := os.Stat(filepath.Join(opts.StateDir, "layers")); err != nil {
				t.Fatalf("store not initialised: %v", err)
			}
			// Idempotent.
			if _, err := InitStore(opts); err != nil {
				t.Fatalf("second init-store: %v", err)
			}
			// After an unmount (reboot), the daemon's EnsureStore brings the
			// same content back.
			if err := os.WriteFile(filepath.Join(opts.StateDir, "marker"), []byte("m"), 0o600); err != nil {
				t.Fatal(err)
			}
			if err := unix.Unmount(opts.StateDir, 0); err != nil {
				t.Fatal(err)
			}
			loaded, err := LoadStoreConfig(opts.ConfigPath)
			if err != nil {
				t.Fatal(err)
			}
			if loaded.Image != cfg.Image || loaded.StateDir != cfg.StateDir || loaded.FS != kind {
				t.Fatalf("config round trip: %+v vs %+v", loaded, cfg)
			}
			if err := EnsureStore(loaded); err != nil {
				t.Fatal(err)
			}
			if b, err := os.ReadFile(filepath.Join(opts.StateDir, "marker")); err != nil || string(b) != "m" {
				t.Fatalf("content after remount: %q %v", b, err)
			}
			// Bad input.
			busy := filepath.Join(dir, "busy")
			_ = os.MkdirAll(busy, 0o755)
			_ = os.WriteFile(filepath.Join(busy, "x"), nil, 0o600)
			if _, err := InitStore(StoreImage{Image: opts.Image, FS: kind, StateDir: busy}); err == nil || !strings.Contains(err.Error(), "not empty") {
				t.Fatalf("non-empty state dir: %v", err)
			}
			if _, err := InitStore(StoreImage{Image: filepath.Join(dir, "small"), FS: kind, Size: 1 << 20, StateDir: filepath.Join(dir, "s3")}); err == nil {
				t.Fatal("tiny image accepted")
			}
			// A state dir that is the mount of another image, or not
			// empty, is refused before any new image is made.
			other := filepath.Join(dir, "other.img")
			if _, err := InitStore(StoreImage{Image: other, FS: kind, Size: 1 << 30, StateDir: opts.StateDir}); err == nil || !strings.Contains(err.Error(), "already a mount point") {
				t.Fatalf("state dir mounted from another image: %v", err)
			}
			noImg := filepath.Join(dir, "never.img")
			if _, err := InitStore(StoreImage{Image: noImg, FS: kind, Size: 1 << 30, StateDir: busy}); err == nil {
				t.Fatal("non-empty state dir accepted")
			}
			for _, img := range []string{other, noImg} {
				if _, err := os.Stat(img); !os.IsNotExist(err) {
					t.Errorf("a refused init-store left the image %s: %v", filepath.Base(img), err)
				}
			}
		})
	}
}

func TestProbeSwitchIoctlAbsent(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	err := ProbeSwitchIoctl(dir)
	if err == nil {
		t.Skip("this kernel implements the layer-switch ioctl")
	}
	if !errorsIs(err, ErrIoctlAbsent) {
		t.Fatalf("probe on a stock kernel: %v (want ErrIoctlAbsent)", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 0 {
		t.Fatalf("probe left %d entries behind", len(ents))
	}
}

func TestSelfTest(t *testing.T) {
	for _, kind := range fsKinds {
		t.Run(kind, func(t *testing.T) {
			dir := loopFS(t, kind)
			r, err := SelfTest(dir)
			if err != nil {
				t.Fatal(err)
			}
			if r.FSType != kind || r.Freeze != FreezeReflink || r.Ioctl || r.LiveFDsFollow || r.Checkpoint <= 0 || r.Switch <= 0 {
				t.Fatalf("self-test report: %+v", r)
			}
			// On btrfs the rejected alternative (a subvolume snapshot) is
			// measured too, so doctor can explain the choice with numbers.
			if (kind == "btrfs") != (r.Snapshot > 0) || (kind == "btrfs") != strings.Contains(r.Detail, "btrfs read-only snapshot") {
				t.Fatalf("self-test on %s: snapshot %v, detail %q", kind, r.Snapshot, r.Detail)
			}
			t.Log(r.Detail)
			if ents, _ := os.ReadDir(dir); len(ents) > 0 {
				t.Fatalf("self-test left %v behind", ents)
			}
		})
	}
}
