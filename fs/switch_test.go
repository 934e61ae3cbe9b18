package fs

import (
	"errors"
	"fmt"
	"os"
	"slices"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// readNames lists a directory with getdents, "." and ".." included,
// sorted.
func readNames(t testing.TB, dir string) []string {
	t.Helper()
	fd, err := unix.Open(dir, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	ents, err := readDirEntsAll(fd)
	if err != nil {
		t.Fatalf("getdents %s: %v", dir, err)
	}
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.name
	}
	slices.Sort(names)
	return names
}

// readDirEntsAll is getdents without any filtering.
func readDirEntsAll(fd int) ([]dirent, error) {
	var out []dirent
	buf := make([]byte, 8192)
	for {
		n, err := unix.Getdents(fd, buf)
		if err != nil {
			return nil, err
		}
		if n == 0 {
			return out, nil
		}
		for b := buf[:n]; len(b) > 0; {
			reclen := int(b[16]) | int(b[17])<<8
			name := b[19:reclen]
			if k := slices.Index(name, 0); k >= 0 {
				name = name[:k]
			}
			ino := uint64(0)
			for i := 7; i >= 0; i-- {
				ino = ino<<8 | uint64(b[i])
			}
			out = append(out, dirent{name: string(name), typ: b[18], ino: ino})
			b = b[reclen:]
		}
	}
}

// TestSwitchRefreshesCachedListings checks that a listing the kernel
// cached before a switch is never served after it, including when the
// directory's mtime is the same on both sides (file timestamps come from a
// coarse clock, so two fresh upper layers often share one) and when the
// cached listing was empty.
func TestSwitchRefreshesCachedListings(t *testing.T) {
	fixed := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)
	cases := []struct {
		name        string
		first, then []string // entries of d in the first and second view
	}{
		{"empty to one entry", nil, []string{"x"}},
		{"one entry to empty", []string{"x"}, nil},
		{"one entry to another", []string{"x"}, []string{"y"}},
		{"entries added", []string{"x"}, []string{"x", "y", "z"}},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fx := mountT(t, nil, Options{})
			if err := os.Mkdir(fx.p("d"), 0o755); err != nil {
				t.Fatal(err)
			}
			// d stays the same plain directory in both views (its
			// dentry is kept across switches), with the same mtime:
			// only the invalidation can tell the kernel its listing
			// changed.
			view := func(names []string) string {
				ents, err := os.ReadDir(fx.p("d"))
				if err != nil {
					t.Fatal(err)
				}
				for _, e := range ents {
					if !slices.Contains(names, e.Name()) {
						if err := os.Remove(fx.p("d/" + e.Name())); err != nil {
							t.Fatal(err)
						}
					}
				}
				for _, n := range names {
					mustWrite(t, fx.p("d/"+n), n)
				}
				if err := os.Chtimes(fx.p("d"), fixed, fixed); err != nil {
					t.Fatal(err)
				}
				return fx.checkpoint(t)
			}
			want := func(names []string) []string {
				return slices.Sorted(slices.Values(append([]string{".", ".."}, names...)))
			}
			a := view(tc.first)
			b := view(tc.then)
			for round := 0; round < 3; round++ {
				fx.restore(t, a)
				if got := readNames(t, fx.p("d")); !slices.Equal(got, want(tc.first)) {
					t.Fatalf("round %d, first view: d lists %q, want %q", round, got, want(tc.first))
				}
				fx.restore(t, b)
				if got := readNames(t, fx.p("d")); !slices.Equal(got, want(tc.then)) {
					t.Fatalf("round %d, second view: d lists %q, want %q", round, got, want(tc.then))
				}
			}
		})
	}
}

// TestSwitchBackToDirLookedUpAsMissing checks that a directory that is
// absent in one view, looked up there (the kernel caches the miss), and
// present again after a switch back is found - also while a descriptor
// keeps its old inode alive in the kernel.
func TestSwitchBackToDirLookedUpAsMissing(t *testing.T) {
	for _, hold := range []bool{false, true} {
		name := "no fd held"
		if hold {
			name = "fd held on the directory"
		}
		t.Run(name, func(t *testing.T) {
			fx := mountT(t, nil, Options{})
			empty := fx.checkpoint(t)
			if err := os.Mkdir(fx.p("s0"), 0o755); err != nil {
				t.Fatal(err)
			}
			mustWrite(t, fx.p("s0/f"), "data")
			with := fx.checkpoint(t)
			if hold {
				fd, err := unix.Open(fx.p("s0"), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unix.Close(fd) })
			}
			for round := 0; round < 3; round++ {
				fx.restore(t, empty)
				var s unix.Stat_t
				if err := unix.Lstat(fx.p("s0"), &s); err != unix.ENOENT {
					t.Fatalf("round %d: lstat s0 in the empty view: %v, want ENOENT", round, err)
				}
				fx.restore(t, with)
				if err := unix.Lstat(fx.p("s0"), &s); err != nil {
					t.Fatalf("round %d: lstat s0 after switching back: %v", round, err)
				}
				if got := mustRead(t, fx.p("s0/f")); got != "data" {
					t.Fatalf("round %d: s0/f = %q", round, got)
				}
				if got := readNames(t, fx.p(".")); !slices.Equal(got, []string{".", "..", "s0"}) {
					t.Fatalf("round %d: root lists %q", round, got)
				}
			}
		})
	}
}

// TestDeleteRightAfterCheckpointStaysDeleted: deleting a checkpoint whose
// record the background writer has not written yet must not be undone by
// that writer (the layers would never be freed).
func TestDeleteRightAfterCheckpointStaysDeleted(t *testing.T) {
	fx := mountT(t, nil, Options{})
	var ids []string
	for i := 0; i < 20; i++ {
		mustWrite(t, fx.p(fmt.Sprintf("f%d", i)), "x")
		id := fx.checkpoint(t)
		if err := fx.store.DeleteCheckpoint(id); err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	fx.fs.flushBG()
	for _, id := range ids {
		if _, err := fx.store.Checkpoint(id); !errors.Is(err, layer.ErrNotFound) {
			t.Fatalf("checkpoint %s after delete: %v, want not found", id, err)
		}
	}
}

// TestDirHandleAcrossSwitch: a directory stream opened before a switch
// and rewound after it lists the new view (rewinddir shows the current
// content), and neither it nor its release leaves the old listing in the
// kernel's cache for later readers.
func TestDirHandleAcrossSwitch(t *testing.T) {
	fixed := time.Date(2024, 1, 2, 3, 4, 5, 0, time.UTC)
	fx := mountT(t, nil, Options{})
	if err := os.Mkdir(fx.p("d"), 0o755); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, fx.p("d/old"), "1")
	if err := os.Chtimes(fx.p("d"), fixed, fixed); err != nil {
		t.Fatal(err)
	}
	a := fx.checkpoint(t)
	if err := os.Remove(fx.p("d/old")); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, fx.p("d/new"), "2")
	if err := os.Chtimes(fx.p("d"), fixed, fixed); err != nil {
		t.Fatal(err)
	}
	b := fx.checkpoint(t)
	fx.restore(t, a)
	fd, err := unix.Open(fx.p("d"), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	closed := false
	defer func() {
		if !closed {
			unix.Close(fd)
		}
	}()
	names := func(ents []dirent) []string {
		var out []string
		for _, e := range ents {
			out = append(out, e.name)
		}
		slices.Sort(out)
		return out
	}
	ents, err := readDirEntsAll(fd)
	if err != nil {
		t.Fatal(err)
	}
	if got, want := names(ents), []string{".", "..", "old"}; !slices.Equal(got, want) {
		t.Fatalf("before the switch: %q, want %q", got, want)
	}
	fx.restore(t, b)
	want := []string{".", "..", "new"}
	if _, err := unix.Seek(fd, 0, 0); err != nil {
		t.Fatal(err)
	}
	if ents, err = readDirEntsAll(fd); err != nil {
		t.Fatal(err)
	}
	if got := names(ents); !slices.Equal(got, want) {
		t.Fatalf("rewound stream after the switch: %q, want %q", got, want)
	}
	unix.Close(fd)
	closed = true
	for i := 0; i < 2; i++ {
		if got := readNames(t, fx.p("d")); !slices.Equal(got, want) {
			t.Fatalf("new stream %d after the switch: %q, want %q", i, got, want)
		}
	}
}

// TestSwitchAwayFromSubtree: a switch to a view without a directory drops
// the directory's entry only (the kernel prunes what lies below it), so
// nothing below it may be served after the directory comes back in a
// later view without it - also while descriptors keep the old file and
// directory inodes alive, whose dentries the kernel could splice back in
// with the old directory's.
func TestSwitchAwayFromSubtree(t *testing.T) {
	cases := []struct {
		name string
		hold bool
	}{
		{"nothing held", false},
		{"file and directory held open", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			fx := mountT(t, nil, Options{})
			empty := fx.checkpoint(t)
			mustWrite(t, fx.p("d/sub/x"), "old")
			mustWrite(t, fx.p("d/y"), "y")
			with := fx.checkpoint(t)
			fx.restore(t, empty)
			// Another branch: d/sub again, from a layer of its own,
			// without x or y.
			if err := os.MkdirAll(fx.p("d/sub"), 0o755); err != nil {
				t.Fatal(err)
			}
			mustWrite(t, fx.p("d/z"), "z")
			other := fx.checkpoint(t)
			for round := 0; round < 3; round++ {
				fx.restore(t, with)
				if got := mustRead(t, fx.p("d/sub/x")); got != "old" {
					t.Fatalf("round %d: d/sub/x = %q, want old", round, got)
				}
				var fds []int
				if tc.hold {
					for _, p := range []struct {
						path  string
						flags int
					}{{"d/sub/x", unix.O_RDONLY}, {"d/sub", unix.O_RDONLY | unix.O_DIRECTORY}} {
						fd, err := unix.Open(fx.p(p.path), p.flags|unix.O_CLOEXEC, 0)
						if err != nil {
							t.Fatal(err)
						}
						fds = append(fds, fd)
					}
				}
				fx.restore(t, empty)
				var s unix.Stat_t
				for _, p := range []string{"d", "d/sub", "d/sub/x", "d/y"} {
					if err := unix.Lstat(fx.p(p), &s); err != unix.ENOENT {
						t.Fatalf("round %d: lstat %s in the empty view: %v, want ENOENT", round, p, err)
					}
				}
				fx.restore(t, other)
				for _, p := range []string{"d/sub/x", "d/y"} {
					if err := unix.Lstat(fx.p(p), &s); err != unix.ENOENT {
						t.Fatalf("round %d: lstat %s in the other branch: %v, want ENOENT", round, p, err)
					}
				}
				if got, want := readNames(t, fx.p("d/sub")), []string{".", ".."}; !slices.Equal(got, want) {
					t.Fatalf("round %d: d/sub lists %q in the other branch, want %q", round, got, want)
				}
				if got, want := readNames(t, fx.p("d")), []string{".", "..", "sub", "z"}; !slices.Equal(got, want) {
					t.Fatalf("round %d: d lists %q in the other branch, want %q", round, got, want)
				}
				if tc.hold {
					// The descriptor still reads the file it opened.
					buf := make([]byte, 8)
					n, err := unix.Pread(fds[0], buf, 0)
					if err != nil || string(buf[:n]) != "old" {
						t.Fatalf("round %d: the held descriptor reads %q, %v; want old", round, buf[:n], err)
					}
					for _, fd := range fds {
						unix.Close(fd)
					}
				}
			}
		})
	}
}
