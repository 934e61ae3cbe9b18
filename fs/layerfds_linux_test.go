package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// openFDs lists this process's open descriptors with their targets.
func openFDs(t testing.TB) map[string]string {
	t.Helper()
	ents, err := os.ReadDir("/proc/self/fd")
	if err != nil {
		t.Fatal(err)
	}
	fds := map[string]string{}
	for _, e := range ents {
		// The directory's own descriptor is closed by now: no target.
		if target, err := os.Readlink("/proc/self/fd/" + e.Name()); err == nil {
			fds[e.Name()] = target
		}
	}
	return fds
}

// TestRestoreReleasesLayerDescriptors runs the daemon's restore loop (a
// file changes, then the view goes back to a checkpoint) and checks that
// the mount's open descriptors do not grow with the number of restores,
// and that none is left on a layer that was removed from the store.
//
// "undo checkpoint" is what the daemon does: the changed upper is frozen
// by a checkpoint first (the restore's undo point), which is deleted after
// the switch and whose layer the store's GC then removes (renamed to
// work/gc-<id>, then deleted). "discard" switches without one: the
// switch discards the changed upper itself.
func TestRestoreReleasesLayerDescriptors(t *testing.T) {
	for _, undo := range []bool{true, false} {
		name := "discard"
		if undo {
			name = "undo checkpoint"
		}
		t.Run(name, func(t *testing.T) {
			fx := mountT(t, func(l string) { mustWrite(t, l+"/base", "b") }, Options{})
			mustWrite(t, fx.p("work/f"), "start")
			c := fx.checkpoint(t)
			cycle := func(i int) {
				mustWrite(t, fx.p("work/i"), fmt.Sprint(i))
				var u string
				if undo {
					u = fx.checkpoint(t)
				}
				fx.restore(t, c)
				if _, err := os.Stat(fx.p("work/i")); !os.IsNotExist(err) {
					t.Fatalf("cycle %d: work/i after the restore: %v", i, err)
				}
				if !undo {
					return
				}
				rec, err := fx.store.Checkpoint(u)
				if err != nil {
					t.Fatal(err)
				}
				if err := fx.store.DeleteCheckpoint(u); err != nil {
					t.Fatal(err)
				}
				// The undo point's own layer (the changed upper, frozen)
				// is now referenced by nothing: remove it as the store's
				// GC does. (GC itself would race with the mount's spare
				// upper, which is created before its mount record names
				// it; GC keeps such young layers, this test does not
				// wait for them to age.)
				top := rec.Layers[len(rec.Layers)-1]
				gc := filepath.Join(fx.store.WorkDir(), "gc-"+top)
				if err := os.Rename(fx.store.LayerPath(top), gc); err != nil {
					t.Fatal(err)
				}
				if err := os.RemoveAll(gc); err != nil {
					t.Fatal(err)
				}
			}
			const warm, more = 5, 20
			for i := 0; i < warm; i++ {
				cycle(i)
			}
			fx.fs.flushBG()
			before := openFDs(t)
			for i := warm; i < warm+more; i++ {
				cycle(i)
			}
			fx.fs.flushBG()
			after := openFDs(t)
			// A little slack for descriptors of the runtime and of the
			// FUSE server that come and go.
			if len(after) > len(before)+3 {
				var added []string
				for fd, target := range after {
					if before[fd] != target && len(added) < 5 {
						added = append(added, fd+" -> "+target)
					}
				}
				t.Errorf("open descriptors grew from %d to %d over %d restores; new: %s",
					len(before), len(after), more, strings.Join(added, ", "))
			}
			bad := 0
			for fd, target := range after {
				// (Only this mount's: an earlier test may leave a
				// descriptor behind on purpose, see TestAbortFUSE.)
				if !strings.HasPrefix(target, fx.store.Dir()+"/") {
					continue
				}
				if strings.Contains(target, "gc-") || strings.Contains(target, "(deleted)") {
					if bad++; bad <= 5 {
						t.Errorf("descriptor %s left on a removed layer: %s", fd, target)
					}
				}
			}
			if got := mustRead(t, fx.p("work/f")); got != "start" {
				t.Fatalf("work/f = %q after the restores", got)
			}
		})
	}
}

// heldLayers returns the registered layers of f with an open descriptor,
// and how many are registered in all.
func heldLayers(f *FS) (held map[string]*layerDir, registered int) {
	f.reg.mu.Lock()
	defer f.reg.mu.Unlock()
	held = map[string]*layerDir{}
	for k, l := range f.reg.byID {
		if l.refs > 0 {
			held[k] = l
		}
	}
	return held, len(f.reg.byID)
}

// layerFD reads l's descriptor (guarded by the registry's lock).
func layerFD(f *FS, l *layerDir) int {
	f.reg.mu.Lock()
	defer f.reg.mu.Unlock()
	return l.fd
}

// TestSwitchBackReopensLeftLayer: a layer a switch leaves loses its
// descriptor but stays registered, and a switch back to a checkpoint
// holding it opens it again as the same layerDir (what was cached and
// walked in it stays).
func TestSwitchBackReopensLeftLayer(t *testing.T) {
	fx := mountT(t, nil, Options{})
	c0 := fx.checkpoint(t)
	mustWrite(t, fx.p("d/f"), "one")
	c1 := fx.checkpoint(t)
	fx.fs.mu.RLock()
	left := fx.fs.st.frozen[len(fx.fs.st.frozen)-1]
	fx.fs.mu.RUnlock()
	fx.restore(t, c0)
	held, _ := heldLayers(fx.fs)
	if fd := layerFD(fx.fs, left); held[left.id] != nil || fd != -1 {
		t.Fatalf("layer %s still open (fd %d) after the switch left it", left.id, fd)
	}
	fx.fs.mu.RLock()
	want := len(fx.fs.st.top)
	fx.fs.mu.RUnlock()
	if len(held) != want {
		t.Fatalf("%d layers open, the stack has %d", len(held), want)
	}
	fx.restore(t, c1)
	if got := mustRead(t, fx.p("d/f")); got != "one" {
		t.Fatalf("d/f = %q after switching back", got)
	}
	held, _ = heldLayers(fx.fs)
	if fd := layerFD(fx.fs, left); held[left.id] != left || fd < 0 {
		t.Fatalf("switching back did not reopen layer %s as the same layerDir (fd %d)", left.id, fd)
	}
	// (Inode numbers are not compared: a node the kernel forgot gets a
	// new number on its next lookup, before this change as after it.)
}

// TestRegistryForgetsRemovedLayers: the layers a mount left, once the
// store removed them, are forgotten (prune) rather than registered
// forever; the ones still in the store stay.
func TestRegistryForgetsRemovedLayers(t *testing.T) {
	fx := mountT(t, nil, Options{})
	c := fx.checkpoint(t)
	var kept []string
	const cycles = 3 * pruneMin
	for i := 0; i < cycles; i++ {
		mustWrite(t, fx.p("i"), fmt.Sprint(i))
		u := fx.checkpoint(t)
		fx.restore(t, c)
		rec, err := fx.store.Checkpoint(u)
		if err != nil {
			t.Fatal(err)
		}
		top := rec.Layers[len(rec.Layers)-1]
		if i%16 == 0 {
			kept = append(kept, top) // its checkpoint stays
			continue
		}
		if err := fx.store.DeleteCheckpoint(u); err != nil {
			t.Fatal(err)
		}
		if err := os.RemoveAll(fx.store.LayerPath(top)); err != nil {
			t.Fatal(err)
		}
	}
	fx.fs.flushBG()
	_, n := heldLayers(fx.fs)
	// The stack, the kept layers, and what came since the last prune
	// (it looks again once the registry has doubled).
	if limit := 2 * (pruneMin + len(kept)); n > limit {
		t.Fatalf("%d layers registered after %d restores, want at most %d", n, cycles, limit)
	}
	fx.fs.reg.mu.Lock()
	for _, id := range kept {
		if fx.fs.reg.byID[id] == nil {
			t.Errorf("layer %s forgotten while its checkpoint exists", id)
		}
	}
	fx.fs.reg.mu.Unlock()
	// The inode numbers of the forgotten layers' entries are dropped too
	// (a batch at a time), not kept for every layer ever passed through.
	fx.fs.inoMu.Lock()
	layersWithInos := map[*layerDir]bool{}
	for k := range fx.fs.inos {
		layersWithInos[k.l] = true
	}
	fx.fs.inoMu.Unlock()
	if limit := n + inoGoneBatch + 2; len(layersWithInos) > limit {
		t.Fatalf("inode numbers kept for %d layers after %d restores (%d registered), want at most %d", len(layersWithInos), cycles, n, limit)
	}
}
