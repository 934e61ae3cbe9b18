package daemon

import (
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/kernelpath"
)

// The daemon mounts the image `rewind init-store` recorded for its state
// dir at start (after a reboot the state dir is an empty mount point).
func TestMountStoreFromConfig(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := exec.LookPath("mkfs.xfs")
	testenv.Require(t, err == nil, "mkfs.xfs (xfsprogs)")
	dir := t.TempDir()
	state := filepath.Join(dir, "state")
	cfgPath := filepath.Join(dir, "store.json")
	log := slog.New(slog.DiscardHandler)
	sc, err := kernelpath.InitStore(kernelpath.StoreImage{Image: filepath.Join(dir, "store.img"), FS: "xfs", Size: kernelpath.MinImageSize, StateDir: state, ConfigPath: cfgPath})
	if err != nil {
		t.Fatal(err)
	}
	unmount := func() {
		if err := unix.Unmount(state, 0); err != nil {
			t.Fatalf("unmount %s: %v", state, err)
		}
	}
	isXFS := func() bool {
		var st unix.Statfs_t
		return unix.Statfs(state, &st) == nil && uint32(st.Type) == unix.XFS_SUPER_MAGIC
	}
	unmount() // as after a reboot
	if isXFS() {
		t.Fatal("still mounted")
	}
	if err := mountStore(Config{StateDir: state, StoreConfig: cfgPath}, log); err != nil {
		t.Fatal(err)
	}
	if !isXFS() {
		t.Fatalf("state dir %s not mounted from %s", state, sc.Image)
	}
	// Already mounted: nothing to do.
	if err := mountStore(Config{StateDir: state, StoreConfig: cfgPath}, log); err != nil {
		t.Fatal(err)
	}
	unmount()
	// A config for another state dir, or none at all, mounts nothing.
	other := filepath.Join(dir, "other")
	if err := mountStore(Config{StateDir: other, StoreConfig: cfgPath}, log); err != nil {
		t.Fatal(err)
	}
	if err := mountStore(Config{StateDir: state, StoreConfig: filepath.Join(dir, "absent.json")}, log); err != nil {
		t.Fatal(err)
	}
	if isXFS() {
		t.Fatal("mounted without a matching config")
	}
	if _, err := os.Stat(other); err == nil {
		t.Fatal("created the other state dir")
	}
}
