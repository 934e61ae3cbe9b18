package kernelpath

import (
	"errors"
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// TestDeferredCheckpoint: a checkpoint's layer is written after Checkpoint
// returns, from what was read inside it. Changes made to the view before
// the layer is written must not reach it, for a full freeze and for
// tracked deltas, small files (read into memory) and large ones (cloned
// inside the freeze), metadata and xattrs.
func TestDeferredCheckpoint(t *testing.T) {
	for _, kind := range fsKinds {
		t.Run(kind, func(t *testing.T) {
			st := newStore(t, kind)
			f := mountKP(t, st, Options{MountID: "late"})
			mp := f.Mountpoint()
			must := func(err error) {
				t.Helper()
				if err != nil {
					t.Fatal(err)
				}
			}
			gate := make(chan struct{})
			f.finishHook = func() error { <-gate; return nil }
			var ids, wants []string
			for round := range 4 {
				r := string(rune('a' + round))
				must(os.MkdirAll(mp+"/d/"+r, 0o755))
				writeFile(t, mp+"/d/small", "small "+r)
				writeFile(t, mp+"/d/"+r+"/new", r)
				writeFile(t, mp+"/big", strings.Repeat(r, 100000))
				must(unix.Setxattr(mp+"/big", "user.round", []byte(r), 0))
				must(os.Chmod(mp+"/d/small", 0o600+os.FileMode(round)))
				if round == 2 {
					must(os.Remove(mp + "/d/a/new"))
				}
				want := treeDump(t, mp)
				id, err := f.Checkpoint()
				must(err)
				// Change everything before the layer is written.
				writeFile(t, mp+"/d/small", "changed after the freeze")
				writeFile(t, mp+"/big", strings.Repeat("z", 50000))
				must(unix.Setxattr(mp+"/big", "user.round", []byte("late"), 0))
				must(os.Chmod(mp+"/d/small", 0o644))
				must(os.Remove(mp + "/d/" + r + "/new"))
				gate <- struct{}{}
				must(f.Flush())
				ids, wants = append(ids, id), append(wants, want)
				// Undo the late changes for the next round's baseline.
				writeFile(t, mp+"/d/"+r+"/new", r)
			}
			for i, id := range ids {
				g := mountKP(t, st, Options{MountID: "late-" + layer.NewID(), From: id})
				if got := treeDump(t, g.Mountpoint()); got != wants[i] {
					t.Fatalf("checkpoint %d: frozen view differs:\n%s\nwant:\n%s", i, got, wants[i])
				}
				must(g.Unmount())
			}
			if !f.Tracked() {
				t.Fatalf("the last checkpoint was not tracked: %s", f.lastFreeze)
			}
		})
	}
}

// TestDeferredCheckpointFails: a checkpoint whose layer cannot be written
// after the freeze is dropped: its readers get the error, Flush reports
// it, and the next checkpoint (a walk: the tracker's names were consumed)
// holds every change since the last good one.
func TestDeferredCheckpointFails(t *testing.T) {
	st := newStore(t, "xfs")
	f := mountKP(t, st, Options{MountID: "fail"})
	mp := f.Mountpoint()
	writeFile(t, mp+"/a", "1")
	id1, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	writeFile(t, mp+"/b", "2")
	writeFile(t, mp+"/a", "2")
	injected := errors.New("injected failure")
	f.finishHook = func() error { return injected }
	id2, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	f.finishHook = nil
	if _, err := st.Checkpoint(id2); !errors.Is(err, layer.ErrNotFound) || !errors.Is(err, injected) {
		t.Fatalf("dropped checkpoint: %v, want not found (injected)", err)
	}
	if err := f.Flush(); !errors.Is(err, injected) {
		t.Fatalf("Flush = %v, want the injected failure", err)
	}
	if err := f.Switch(id2); err == nil {
		t.Fatal("switch to a dropped checkpoint succeeded")
	}
	writeFile(t, mp+"/c", "3")
	want := treeDump(t, mp)
	id3, err := f.Checkpoint()
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Flush(); err != nil {
		t.Fatal(err)
	}
	if f.Tracked() || !strings.HasPrefix(f.lastFreeze, "walk") {
		t.Fatalf("checkpoint after a dropped one: %q, want a walk", f.lastFreeze)
	}
	for _, c := range []struct{ id, want string }{{id1, ""}, {id3, want}} {
		if err := f.Switch(c.id); err != nil {
			t.Fatal(err)
		}
		if c.want != "" {
			if got := treeDump(t, mp); got != c.want {
				t.Fatalf("after the dropped checkpoint: view differs:\n%s\nwant:\n%s", got, c.want)
			}
			continue
		}
		if got := readFile(t, mp+"/a"); got != "1" {
			t.Fatalf("first checkpoint: a = %q", got)
		}
		if _, err := os.Lstat(mp + "/b"); !errors.Is(err, os.ErrNotExist) {
			t.Fatalf("first checkpoint has b: %v", err)
		}
	}
}
