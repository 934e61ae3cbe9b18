package kernelpath

import (
	"os"
	"testing"

	"golang.org/x/sys/unix"
)

// usedBytes is the space used on the file system of path, after a sync.
func usedBytes(t *testing.T, path string) int64 {
	t.Helper()
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Syncfs(fd); err != nil {
		t.Fatal(err)
	}
	var s unix.Statfs_t
	if err := unix.Fstatfs(fd, &s); err != nil {
		t.Fatal(err)
	}
	return int64(s.Blocks-s.Bfree) * s.Bsize
}

// TestWriteAmplification: a small write into a large file of a frozen
// layer copies the file up by reflink (overlayfs does it itself on XFS and
// btrfs), and a checkpoint freezes a large upper file by reflink: neither
// duplicates the data. 64 MiB file; a copy would use 64 MiB more.
func TestWriteAmplification(t *testing.T) {
	const size = 64 << 20
	const limit = 2 << 20 // generous: CoW extent hints, metadata, log
	for _, kind := range fsKinds {
		t.Run(kind, func(t *testing.T) {
			st := newStore(t, kind)
			f := mountKP(t, st, Options{MountID: "amp"})
			mp := f.Mountpoint()
			buf := make([]byte, size)
			for i := range buf {
				buf[i] = byte(i * 7)
			}
			if err := os.WriteFile(mp+"/big", buf, 0o644); err != nil {
				t.Fatal(err)
			}
			u0 := usedBytes(t, st.Dir())
			c1, err := f.Checkpoint() // freezes the 64 MiB upper file
			if err != nil {
				t.Fatal(err)
			}
			u1 := usedBytes(t, st.Dir())
			t.Logf("%s: checkpoint of a 64 MiB upper file used %d bytes", kind, u1-u0)
			if u1-u0 > limit {
				t.Errorf("checkpoint copied data: %d bytes used", u1-u0)
			}
			if err := f.Switch(c1); err != nil { // now it lives in a lower
				t.Fatal(err)
			}
			u2 := usedBytes(t, st.Dir())
			fh, err := os.OpenFile(mp+"/big", os.O_WRONLY, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := fh.WriteAt([]byte("Z"), 12345678); err != nil {
				t.Fatal(err)
			}
			fh.Close()
			u3 := usedBytes(t, st.Dir())
			t.Logf("%s: 1-byte write into a 64 MiB lower file used %d bytes (copy-up)", kind, u3-u2)
			if u3-u2 > limit {
				t.Errorf("copy-up copied data: %d bytes used", u3-u2)
			}
			got, err := os.ReadFile(mp + "/big")
			if err != nil {
				t.Fatal(err)
			}
			buf[12345678] = 'Z'
			if string(got) != string(buf) {
				t.Fatal("content after copy-up differs")
			}
		})
	}
}
