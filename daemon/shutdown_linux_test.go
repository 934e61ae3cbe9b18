package daemon_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/internal/testenv"
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
