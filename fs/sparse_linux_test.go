package fs

import (
	"os"
	"path/filepath"
	"testing"

	"golang.org/x/sys/unix"
)

// TestCopyUpKeepsHoles writes one byte into a sparse 256 MiB base file
// through the view: the copy-up holds the written data and the base's
// data, reads zeros in the holes, keeps the size, and allocates about
// what the data needs, not the whole file (it took 256 MiB on a root
// file system without reflink).
func TestCopyUpKeepsHoles(t *testing.T) {
	const size = 256 << 20
	fx := mountT(t, func(lower string) {
		f, err := os.Create(filepath.Join(lower, "sparse"))
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := f.Truncate(size); err != nil {
			t.Fatal(err)
		}
		if _, err := f.WriteAt([]byte("base"), 100<<20); err != nil {
			t.Fatal(err)
		}
	}, Options{})
	f, err := os.OpenFile(fx.p("sparse"), os.O_WRONLY, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := f.WriteAt([]byte("x"), 4096); err != nil {
		t.Fatal(err)
	}
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	g, err := os.Open(fx.p("sparse"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	for _, c := range []struct {
		off  int64
		want string
	}{{4096, "x"}, {100 << 20, "base"}, {0, "\x00\x00"}, {200 << 20, "\x00\x00"}, {size - 2, "\x00\x00"}} {
		b := make([]byte, len(c.want))
		if _, err := g.ReadAt(b, c.off); err != nil || string(b) != c.want {
			t.Errorf("at %d: %q, %v; want %q", c.off, b, err, c.want)
		}
	}
	st, err := g.Stat()
	if err != nil || st.Size() != size {
		t.Fatalf("size %d, %v; want %d", st.Size(), err, size)
	}
	// The copy in the upper layer.
	var us unix.Stat_t
	up := filepath.Join(fx.store.LayerPath(fx.fs.upper.Load().id), "sparse")
	if err := unix.Stat(up, &us); err != nil {
		t.Fatalf("the copy-up is not in the upper (%s): %v", up, err)
	}
	if alloc := us.Blocks * 512; alloc > 4<<20 {
		t.Errorf("the copy-up allocates %d bytes of a %d-byte file with two small data blocks", alloc, size)
	}
}
