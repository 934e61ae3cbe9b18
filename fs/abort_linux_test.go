package fs

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"testing"

	"golang.org/x/sys/unix"
)

// TestAbortFUSE: the device number recorded at mount names the mount's
// FUSE connection, and aborting it fails requests instead of leaving
// clients blocked (what Unmount falls back to when requests never end).
func TestAbortFUSE(t *testing.T) {
	fx := mountT(t, func(string) {}, Options{})
	mustWrite(t, fx.p("f"), "x")
	if fx.fs.dev == 0 {
		t.Fatal("no device number recorded at mount")
	}
	if err := AbortConnection(fx.fs.dev); err != nil {
		t.Fatalf("abort: %v", err)
	}
	_, err := os.ReadFile(fx.p("g"))
	if !errors.Is(err, unix.ENOTCONN) && !errors.Is(err, unix.ECONNABORTED) {
		t.Fatalf("after abort, a lookup returned %v, want ENOTCONN", err)
	}
}

// TestAbortConnectionMountsFusectl: on a machine where fusectl is not
// mounted (a fresh one: systemd mounts it only when the fuse module loads),
// AbortConnection mounts it and aborts all the same. Run in a private mount
// namespace of one locked thread, where fusectl is unmounted, so tests of
// other packages running meanwhile keep theirs.
func TestAbortConnectionMountsFusectl(t *testing.T) {
	fx := mountT(t, func(string) {}, Options{})
	mustWrite(t, fx.p("f"), "x")
	errc := make(chan error, 1)
	go func() {
		// The thread is never unlocked: it ends with the goroutine,
		// and its mount namespace with it.
		runtime.LockOSThread()
		errc <- func() error {
			if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
				return fmt.Errorf("unshare: %w", err)
			}
			if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
				return fmt.Errorf("make mounts private: %w", err)
			}
			for unix.Unmount(fusectl, unix.MNT_DETACH) == nil {
			}
			if ents, err := os.ReadDir(fusectl); err != nil {
				return fmt.Errorf("fusectl's mount point: %w", err)
			} else if len(ents) != 0 {
				return fmt.Errorf("fusectl still mounted: %d entries", len(ents))
			}
			return AbortConnection(fx.fs.dev)
		}()
	}()
	if err := <-errc; err != nil {
		t.Fatal(err)
	}
	_, err := os.ReadFile(fx.p("g"))
	if !errors.Is(err, unix.ENOTCONN) && !errors.Is(err, unix.ECONNABORTED) {
		t.Fatalf("after abort, a lookup returned %v, want ENOTCONN", err)
	}
}
