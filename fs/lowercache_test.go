package fs

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// TestLowerCacheShared: mounts over the same lower share its directory
// listings through a LowerCache, and a listing is read again once the
// directory changed (a host's package upgrade under its root), within
// lowerRecheck, for a mount made afterwards and for the one that cached
// it alike.
func TestLowerCacheShared(t *testing.T) {
	lc := NewLowerCache()
	fx := mountT(t, func(lower string) {
		mustWrite(t, filepath.Join(lower, "d/x"), "x")
	}, Options{LowerCache: lc})
	// Only a listing of a directory that changed more than racyListing
	// ago is kept in a shared cache.
	past := time.Now().Add(-time.Hour)
	if err := os.Chtimes(filepath.Join(fx.lower, "d"), past, past); err != nil {
		t.Fatal(err)
	}
	time.Sleep(racyListing + 100*time.Millisecond)
	var st unix.Stat_t
	if err := unix.Lstat(fx.p("d/x"), &st); err != nil {
		t.Fatal(err)
	}
	if err := unix.Lstat(fx.p("d/nope"), &st); err != unix.ENOENT {
		t.Fatalf("lstat d/nope: %v, want ENOENT", err)
	}

	mountB := func() string {
		mp := filepath.Join(t.TempDir(), "b")
		if err := os.Mkdir(mp, 0o755); err != nil {
			t.Fatal(err)
		}
		b, err := Mount(fx.store, mp, Options{Lowers: []string{fx.lower}, LowerCache: lc})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { b.Unmount() })
		if got := b.st.lowers[0].cache; got != fx.fs.st.lowers[0].cache {
			t.Fatal("the two mounts over the same lower do not share its listings")
		}
		return mp
	}
	b1 := mountB()
	if err := unix.Lstat(filepath.Join(b1, "d/x"), &st); err != nil {
		t.Fatalf("second mount: lstat d/x: %v", err)
	}
	lc.mu.Lock()
	n := len(lc.dirs)
	lc.mu.Unlock()
	if n != 1 {
		t.Fatalf("%d lowers in the cache, want 1", n)
	}

	// The host adds a file under the lower: lookups see it once the
	// listing is due for its check.
	mustWrite(t, filepath.Join(fx.lower, "d/y"), "y")
	time.Sleep(lowerRecheck + 100*time.Millisecond)
	b2 := mountB()
	for _, mp := range []string{b2, fx.mp} {
		if got := mustRead(t, filepath.Join(mp, "d/y")); got != "y" {
			t.Fatalf("%s: d/y = %q", mp, got)
		}
	}
}
