package daemon_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/layer"
)

// Any process on the host that makes a mount namespace while sandboxes run
// (unshare, a container start, another rewind) copies their FUSE mounts and
// keeps the connections alive after the daemon unmounts them. The daemon
// still stops promptly: it aborts those connections once the sandboxes'
// processes are dead, and the copies are dead too, not served.
func TestRealShutdownWithForeignCopiesOfTheMounts(t *testing.T) {
	dir := t.TempDir()
	d := startRealWith(t, dir, nil)
	c, ctx := d.c, context.Background()
	for _, n := range []string{"s1", "s2", "s3", "s4"} {
		if _, err := c.Create(ctx, api.CreateRequest{Name: n}); err != nil {
			t.Fatal(err)
		}
		if got := sh(t, c, n, "echo here > /f; cat /f"); got != "here" {
			t.Fatalf("%s: %q", n, got)
		}
	}
	mps, err := filepath.Glob(filepath.Join(dir, "state", "mnt", "*"))
	if err != nil || len(mps) < 4 {
		t.Fatalf("sandbox mount points %v %v", mps, err)
	}
	root := testenv.ForeignMountNS(t)
	served := 0
	for _, mp := range mps {
		if b, err := os.ReadFile(root + mp + "/f"); err == nil && string(b) == "here\n" {
			served++
		}
	}
	if served < 4 {
		t.Fatalf("%d of the sandbox mounts are copied into the new namespace", served)
	}
	start := time.Now()
	d.stop()
	t.Logf("shutdown with %d copied mounts took %v", served, time.Since(start))
	for _, mp := range mps {
		// ENOENT: the daemon removed the mount point, which detaches the
		// copies on it in other namespaces.
		if _, err := os.ReadFile(root + mp + "/f"); !errors.Is(err, syscall.ENOTCONN) && !errors.Is(err, syscall.ENOENT) {
			t.Errorf("copy of %s after shutdown: %v, want ENOTCONN or ENOENT", mp, err)
		}
	}
}

// A daemon that died while creating a sandbox leaves its mount and mount
// record without a sandbox record. The next daemon removes both.
func TestRealStartRemovesMountsWithoutARecord(t *testing.T) {
	dir := t.TempDir()
	st, err := layer.OpenStore(filepath.Join(dir, "state", "layers"))
	if err != nil {
		t.Fatal(err)
	}
	const id = "sb-0123456789ab"
	mp := filepath.Join(dir, "state", "mnt", id)
	if err := os.MkdirAll(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := fs.Mount(st, mp, fs.Options{MountID: id, UnmountGrace: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = f.Unmount() })
	if err := os.WriteFile(filepath.Join(mp, "f"), []byte("left"), 0o644); err != nil {
		t.Fatal(err)
	}
	startRealWith(t, dir, nil)
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	if strings.Contains(string(mi), " "+mp+" ") {
		t.Errorf("%s is still mounted", mp)
	}
	if _, err := st.Mount(id); !errors.Is(err, layer.ErrNotFound) {
		t.Errorf("mount record of %s: %v, want not found", id, err)
	}
}
