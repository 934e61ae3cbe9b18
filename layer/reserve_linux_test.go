package layer

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestDeleteOnFullDisk fills the file system of a store (a small tmpfs)
// to the last byte: deleting a checkpoint, which writes a tombstone, still
// works thanks to the store's reserve, and GC allocates the reserve again
// once there is room.
func TestDeleteOnFullDisk(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=16m"); err != nil {
		testenv.RequireNoErr(t, err, "a tmpfs mount")
	}
	t.Cleanup(func() { unix.Unmount(dir, unix.MNT_DETACH) })
	st, err := OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	reserve := filepath.Join(dir, "state", "meta", ".reserve")
	if fi, err := os.Stat(reserve); err != nil || fi.Size() != reserveSize {
		t.Fatalf("reserve after open: %v, %v", fi, err)
	}
	var ids []string
	for i := 0; i < 3; i++ {
		c := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC()}
		if err := st.SaveCheckpoint(c); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, c.ID)
	}
	fill, err := os.Create(filepath.Join(dir, "fill"))
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64<<10)
	for {
		if _, err := fill.Write(buf); err != nil {
			if !errors.Is(err, unix.ENOSPC) {
				t.Fatal(err)
			}
			break
		}
	}
	for len(buf) > 1 { // the last partial blocks too
		buf = buf[:len(buf)/2]
		for {
			if _, err := fill.Write(buf); err != nil {
				break
			}
		}
	}
	fill.Close()
	if err := os.WriteFile(filepath.Join(dir, "probe"), []byte("x"), 0o600); !errors.Is(err, unix.ENOSPC) {
		t.Fatalf("the file system is not full: %v", err)
	}
	for _, id := range ids {
		if err := st.DeleteCheckpoint(id); err != nil {
			t.Fatalf("delete on a full disk: %v", err)
		}
		if _, err := st.Checkpoint(id); !errors.Is(err, ErrNotFound) {
			t.Fatalf("deleted checkpoint still there: %v", err)
		}
	}
	if err := os.Remove(filepath.Join(dir, "fill")); err != nil {
		t.Fatal(err)
	}
	if _, err := st.GC(0); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(reserve); err != nil || fi.Size() != reserveSize {
		t.Fatalf("reserve after GC: %v, %v", fi, err)
	}
}
