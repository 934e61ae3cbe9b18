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
// namespace of one thread, where fusectl is unmounted, so the other tests
// (and tests of other packages running meanwhile) keep theirs.
func TestAbortConnectionMountsFusectl(t *testing.T) {
	fx := mountT(t, func(string) {}, Options{})
	mustWrite(t, fx.p("f"), "x")
	err := inPrivateMountNS(func() error {
		for unix.Unmount(fusectl, unix.MNT_DETACH) == nil {
		}
		if ents, err := os.ReadDir(fusectl); err != nil {
			return fmt.Errorf("fusectl's mount point: %w", err)
		} else if len(ents) != 0 {
			return fmt.Errorf("fusectl still mounted: %d entries", len(ents))
		}
		return AbortConnection(fx.fs.dev)
	})
	if err != nil {
		t.Fatal(err)
	}
	_, err = os.ReadFile(fx.p("g"))
	if !errors.Is(err, unix.ENOTCONN) && !errors.Is(err, unix.ECONNABORTED) {
		t.Fatalf("after abort, a lookup returned %v, want ENOTCONN", err)
	}
}

// inPrivateMountNS runs f on a thread of its own in a new mount namespace
// with private propagation; the thread ends with f (its goroutine exits
// locked to it), and the namespace with it. Never the main thread: the
// process's /proc/self/mountinfo is the main thread's view, which other
// tests read, and Go parks the main thread rather than ending it.
func inPrivateMountNS(f func() error) error {
	errc := make(chan error, 1)
	run := func() {
		runtime.LockOSThread() // never unlocked
		if err := unix.Unshare(unix.CLONE_NEWNS); err != nil {
			errc <- fmt.Errorf("unshare: %w", err)
			return
		}
		if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
			errc <- fmt.Errorf("make mounts private: %w", err)
			return
		}
		errc <- f()
	}
	go func() {
		runtime.LockOSThread()
		if unix.Gettid() != unix.Getpid() {
			run()
			return
		}
		// On the main thread: keep it while another goroutine, which
		// cannot get it now, does the work.
		done := make(chan struct{})
		go func() { defer close(done); run() }()
		<-done
		runtime.UnlockOSThread()
	}()
	return <-errc
}
