package fs

import (
	"errors"
	"os"
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
	if err := abortFUSE(fx.fs.dev); err != nil {
		t.Fatalf("abort: %v", err)
	}
	_, err := os.ReadFile(fx.p("g"))
	if !errors.Is(err, unix.ENOTCONN) && !errors.Is(err, unix.ECONNABORTED) {
		t.Fatalf("after abort, a lookup returned %v, want ENOTCONN", err)
	}
}
