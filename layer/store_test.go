package layer

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestStoreRecords(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(filepath.Join(st.Dir(), "ctl")); err != nil || fi.Mode().Perm() != 0o700 {
		t.Fatalf("ctl dir must be root-only: %v %v", fi.Mode(), err)
	}
	l1, err := st.NewLayer("")
	if err != nil {
		t.Fatal(err)
	}
	l2, _ := st.NewLayer("")
	l3, _ := st.NewLayer("")
	orphan, _ := st.NewLayer("")
	c1 := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{l1}}
	c2 := Checkpoint{ID: NewID(), Mount: "m", Parent: c1.ID, Created: time.Now().UTC().Add(time.Second), Layers: []string{l1, l2}}
	for _, c := range []Checkpoint{c1, c2} {
		if err := st.SaveCheckpoint(c); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.SaveMount(MountRecord{ID: "m", PID: os.Getpid(), Layers: []string{l1, l2}, Upper: l3}, true); err != nil {
		t.Fatal(err)
	}
	got, err := st.Checkpoint(c2.ID)
	if err != nil || got.Parent != c1.ID || len(got.Layers) != 2 {
		t.Fatalf("read back %+v %v", got, err)
	}
	cps, _ := st.Checkpoints()
	if len(cps) != 2 || cps[0].ID != c1.ID {
		t.Fatalf("list %+v", cps)
	}
	for _, bad := range []string{"", "..", "../x", "a/b", "nope"} {
		if _, err := st.Checkpoint(bad); err == nil {
			t.Fatalf("checkpoint %q found", bad)
		}
	}
	// GC keeps what records reference, frees the rest.
	removed, err := st.GC(0)
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != orphan {
		t.Fatalf("gc removed %v, want [%s]", removed, orphan)
	}
	if err := st.DeleteCheckpoint(c2.ID); err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteCheckpoint(c2.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("double delete: %v", err)
	}
	if err := st.RemoveMount("m"); err != nil {
		t.Fatal(err)
	}
	removed, _ = st.GC(0)
	if len(removed) != 2 {
		t.Fatalf("gc after deleting c2 and the mount removed %v", removed)
	}
	if _, err := os.Stat(st.LayerPath(l1)); err != nil {
		t.Fatal("gc removed a layer c1 uses")
	}
	// A checkpoint whose layer vanished is reported corrupted.
	os.RemoveAll(st.LayerPath(l1))
	if _, err := st.Checkpoint(c1.ID); err == nil {
		t.Fatal("corrupted checkpoint read back")
	}
	// Young unreferenced layers survive GC with a minimum age.
	young, _ := st.NewLayer("")
	if removed, _ := st.GC(time.Hour); len(removed) != 0 {
		t.Fatalf("gc removed a young layer %v (%s)", removed, young)
	}
}

func TestWriteFileAtomic(t *testing.T) {
	p := filepath.Join(t.TempDir(), "r.json")
	for _, durable := range []bool{false, true} {
		if err := WriteFileAtomic(p, []byte("x"), durable); err != nil {
			t.Fatal(err)
		}
	}
	ents, _ := os.ReadDir(filepath.Dir(p))
	if len(ents) != 1 {
		t.Fatalf("temp files left: %v", ents)
	}
}

// TestGCNeverFreesALayerBeingCreated runs GC in a loop while layers are
// created: a layer NewLayer returned must exist (GC keeps layers younger
// than its minimum age, which it can only tell once the layer's metadata
// is there).
func TestGCNeverFreesALayerBeingCreated(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	stop := make(chan struct{})
	gcDone := make(chan error, 1)
	go func() {
		for {
			select {
			case <-stop:
				gcDone <- nil
				return
			default:
			}
			if _, err := st.GC(time.Minute); err != nil {
				gcDone <- err
				return
			}
		}
	}()
	var lost []string
	for i := 0; i < 200 && len(lost) == 0; i++ {
		id, err := st.NewLayer("")
		if err != nil {
			close(stop)
			t.Fatal(err)
		}
		if err := st.CheckLayer(id); err != nil {
			lost = append(lost, id)
		}
	}
	close(stop)
	if err := <-gcDone; err != nil {
		t.Fatalf("gc: %v", err)
	}
	if len(lost) > 0 {
		t.Fatalf("GC freed layers NewLayer had just created: %v", lost)
	}
}

// TestGCDatesLayersWithoutMetadata: a layer directory without metadata,
// and what a crash leaves in the work directory, are dated by their change
// time: never freed young, freed once old.
func TestGCDatesLayersWithoutMetadata(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	id := NewID()
	if err := os.Mkdir(st.LayerPath(id), 0o755); err != nil {
		t.Fatal(err)
	}
	// Leftovers of a crash in the work directory: a layer being created,
	// one being removed.
	var left []string
	for _, n := range []string{"new-" + NewID(), "gc-" + NewID()} {
		p := filepath.Join(st.WorkDir(), n)
		if err := os.MkdirAll(filepath.Join(p, "sub"), 0o755); err != nil {
			t.Fatal(err)
		}
		left = append(left, p)
	}
	cases := []struct {
		minAge time.Duration
		freed  bool
	}{{time.Hour, false}, {0, true}}
	for _, c := range cases {
		removed, err := st.GC(c.minAge)
		if err != nil {
			t.Fatal(err)
		}
		_, statErr := os.Stat(st.LayerPath(id))
		if freed := len(removed) == 1 && os.IsNotExist(statErr); freed != c.freed {
			t.Fatalf("GC(%v): removed %v (layer dir: %v), want freed=%v", c.minAge, removed, statErr, c.freed)
		}
		for _, p := range left {
			if _, err := os.Stat(p); os.IsNotExist(err) != c.freed {
				t.Fatalf("GC(%v): work leftover %s: %v, want freed=%v", c.minAge, filepath.Base(p), err, c.freed)
			}
		}
	}
}

// TestRewriteCheckpointKeepsTombstones: a rewrite (compaction) changes a
// live record and never brings back a deleted one.
func TestRewriteCheckpointKeepsTombstones(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	l1, _ := st.NewLayer("")
	l2, _ := st.NewLayer("")
	live := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{l1}}
	gone := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{l1}}
	for _, c := range []Checkpoint{live, gone} {
		if err := st.SaveCheckpoint(c); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.DeleteCheckpoint(gone.ID); err != nil {
		t.Fatal(err)
	}
	to := func(c *Checkpoint) bool { c.Layers = []string{l2}; return true }
	for _, id := range []string{live.ID, gone.ID} {
		if err := st.RewriteCheckpoint(id, to); err != nil {
			t.Fatalf("rewrite %s: %v", id, err)
		}
	}
	if c, err := st.Checkpoint(live.ID); err != nil || len(c.Layers) != 1 || c.Layers[0] != l2 {
		t.Fatalf("live checkpoint after rewrite: %+v, %v", c, err)
	}
	if c, err := st.Checkpoint(gone.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("deleted checkpoint came back: %+v, %v", c, err)
	}
}

// TestCheckpointPending: the mount that journaled a checkpoint reads it
// without its record file, and a record that exists (a tombstone) wins.
func TestCheckpointPending(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	l1, _ := st.NewLayer("")
	c := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{l1}}
	if _, err := st.Checkpoint(c.ID); !errors.Is(err, ErrNotFound) {
		t.Fatalf("checkpoint neither journaled nor materialized: %v, want ErrNotFound", err)
	}
	if got, err := st.CheckpointPending(c); err != nil || got.ID != c.ID || len(got.Layers) != 1 || got.Layers[0] != l1 {
		t.Fatalf("pending checkpoint: %+v, %v", got, err)
	}
	missing := c
	missing.ID, missing.Layers = NewID(), []string{NewID()}
	if _, err := st.CheckpointPending(missing); err == nil {
		t.Fatal("pending checkpoint with a missing layer: no error")
	}
	if err := st.MaterializeCheckpoint(c, false); err != nil {
		t.Fatal(err)
	}
	if err := st.DeleteCheckpoint(c.ID); err != nil {
		t.Fatal(err)
	}
	if got, err := st.CheckpointPending(c); !errors.Is(err, ErrNotFound) {
		t.Fatalf("deleted checkpoint read as pending: %+v, %v", got, err)
	}
}

// TestBeginCheckpoint: readers of a checkpoint whose record is still being
// written wait for it; a checkpoint that failed reads as not found, with
// its error.
func TestBeginCheckpoint(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	l, err := st.NewLayer("")
	if err != nil {
		t.Fatal(err)
	}
	c := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{l}}
	end := st.BeginCheckpoint(c.ID)
	got := make(chan error, 2)
	go func() { _, err := st.Checkpoint(c.ID); got <- err }()
	go func() { _, err := st.Record(c.ID); got <- err }()
	select {
	case err := <-got:
		t.Fatalf("a reader returned before the record was written: %v", err)
	case <-time.After(50 * time.Millisecond):
	}
	if err := st.SaveCheckpoint(c); err != nil {
		t.Fatal(err)
	}
	end(nil)
	for range 2 {
		if err := <-got; err != nil {
			t.Fatalf("reader: %v", err)
		}
	}

	bad := NewID()
	boom := errors.New("layer write failed")
	st.BeginCheckpoint(bad)(boom)
	if _, err := st.Checkpoint(bad); !errors.Is(err, ErrNotFound) || !errors.Is(err, boom) {
		t.Fatalf("failed checkpoint: %v", err)
	}
	if err := st.DeleteCheckpoint(bad); !errors.Is(err, ErrNotFound) {
		t.Fatalf("delete of a failed checkpoint: %v", err)
	}
}

// TestRecordCache: records are read from the cache only while their file
// is the one read, also when another store (another process) replaces
// it, and a caller's changes to a returned record do not reach the cache.
func TestRecordCache(t *testing.T) {
	dir := t.TempDir()
	a, err := OpenStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	b, err := OpenStore(dir)
	if err != nil {
		t.Fatal(err)
	}
	l1, _ := a.NewLayer("")
	l2, _ := a.NewLayer("")
	c := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{l1}}
	if err := a.SaveCheckpoint(c); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name   string
		change func() error
		// The layers Checkpoint and Record return ("" for an error).
		checkpoint, record string
	}{
		{"first read", func() error { return nil }, l1, l1},
		{"caller changes its copy", func() error {
			got, err := a.Checkpoint(c.ID)
			if err == nil {
				got.Layers[0] = "changed"
			}
			return err
		}, l1, l1},
		{"rewritten by another store", func() error {
			return b.RewriteCheckpoint(c.ID, func(r *Checkpoint) bool { r.Layers = []string{l1, l2}; return true })
		}, l1 + "," + l2, l1 + "," + l2},
		{"a layer moved away", func() error {
			return os.Rename(a.LayerPath(l2), a.LayerPath("moved"))
		}, "", l1 + "," + l2},
		{"moved back", func() error {
			return os.Rename(a.LayerPath("moved"), a.LayerPath(l2))
		}, l1 + "," + l2, l1 + "," + l2},
		{"deleted by another store", func() error { return b.DeleteCheckpoint(c.ID) }, "", ""},
	}
	layers := func(c Checkpoint, err error) string {
		if err != nil {
			return ""
		}
		return strings.Join(c.Layers, ",")
	}
	for _, tc := range tests {
		if err := tc.change(); err != nil {
			t.Fatalf("%s: %v", tc.name, err)
		}
		if got := layers(a.Checkpoint(c.ID)); got != tc.checkpoint {
			t.Errorf("%s: Checkpoint's layers %q, want %q", tc.name, got, tc.checkpoint)
		}
		if got := layers(a.Record(c.ID)); got != tc.record {
			t.Errorf("%s: Record's layers %q, want %q", tc.name, got, tc.record)
		}
	}
}

// TestGCFreesSettledLayersAtOnce replays a restore's journal (the changed
// upper frozen by an undo checkpoint, a switch back, the undo checkpoint
// deleted) and checks that GC with a minimum age frees the undo point's
// layer right away, as it was part of the mount's stack (a later journal
// entry superseded it), while it still keeps every young layer whose
// creation may not be over: one no journal names, and the upper a mount
// being created journals before its mount record names it.
func TestGCFreesSettledLayersAtOnce(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	newLayer := func() string {
		id, err := st.NewLayer("")
		if err != nil {
			t.Fatal(err)
		}
		return id
	}
	base, undone, upper, fresh, mounting := newLayer(), newLayer(), newLayer(), newLayer(), newLayer()
	j, err := st.OpenJournal("m")
	if err != nil {
		t.Fatal(err)
	}
	defer j.Close()
	c := Checkpoint{ID: NewID(), Mount: "m", Created: time.Now().UTC(), Layers: []string{base}}
	undo := Checkpoint{ID: NewID(), Mount: "m", Parent: c.ID, Created: time.Now().UTC(), Layers: []string{base, undone}}
	for _, e := range []JournalEntry{
		{Op: "checkpoint", Checkpoint: c, Upper: undone},
		{Op: "checkpoint", Checkpoint: undo, Upper: upper},
		{Op: "switch", Checkpoint: c, Upper: upper},
	} {
		if err := j.Append(e); err != nil {
			t.Fatal(err)
		}
	}
	for _, r := range []Checkpoint{c, undo} {
		if err := st.MaterializeCheckpoint(r, false); err != nil {
			t.Fatal(err)
		}
	}
	if err := st.SaveMount(MountRecord{ID: "m", PID: os.Getpid(), Layers: []string{base}, Upper: upper}, false); err != nil {
		t.Fatal(err)
	}
	// A second mount being created: its journal names its upper, its
	// mount record is not written yet.
	j2, err := st.OpenJournal("m2")
	if err != nil {
		t.Fatal(err)
	}
	defer j2.Close()
	if err := j2.Append(JournalEntry{Op: "mount", Checkpoint: Checkpoint{ID: c.ID, Layers: []string{base}}, Upper: mounting}); err != nil {
		t.Fatal(err)
	}
	if removed, err := st.GC(time.Hour); err != nil || len(removed) != 0 {
		t.Fatalf("GC before the deletion removed %v (%v)", removed, err)
	}
	if err := st.DeleteCheckpoint(undo.ID); err != nil {
		t.Fatal(err)
	}
	removed, err := st.GC(time.Hour)
	if err != nil {
		t.Fatal(err)
	}
	if len(removed) != 1 || removed[0] != undone {
		t.Fatalf("GC after the deletion removed %v, want [%s] (the undo point's layer)", removed, undone)
	}
	for _, id := range []string{base, upper, fresh, mounting} {
		if err := st.CheckLayer(id); err != nil {
			t.Errorf("GC freed %s: %v", id, err)
		}
	}
}

// TestGCSkipsLayersRemovedMeanwhile: a layer removed between GC's listing
// and its removal (a mount discarding its upper, another GC) does not end
// the pass.
func TestGCSkipsLayersRemovedMeanwhile(t *testing.T) {
	st, err := OpenStore(t.TempDir())
	if err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i := 0; i < 8; i++ {
		id, err := st.NewLayer("")
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, id)
	}
	// Several collectors at once: each layer is renamed away by one of
	// them, the others find it gone.
	errs := make(chan error, 4)
	for i := 0; i < cap(errs); i++ {
		go func() {
			_, err := st.GC(0)
			errs <- err
		}()
	}
	for i := 0; i < cap(errs); i++ {
		if err := <-errs; err != nil {
			t.Errorf("concurrent GC: %v", err)
		}
	}
	for _, id := range ids {
		if err := st.CheckLayer(id); err == nil {
			t.Errorf("layer %s survived", id)
		}
	}
}

// TestDirSizeCountsDiskUse: DirSize is disk use, as du counts it: many
// small files take a block each (their sizes alone were a few bytes), a
// sparse file's hole takes nothing, a hard link counts once.
func TestDirSizeCountsDiskUse(t *testing.T) {
	dir := t.TempDir()
	const n = 200
	var sizes int64
	for i := 0; i < n; i++ {
		b := []byte(fmt.Sprintf("%d\n", i))
		sizes += int64(len(b))
		if err := os.WriteFile(filepath.Join(dir, fmt.Sprintf("f%d", i)), b, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.Link(filepath.Join(dir, "f0"), filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	sp, err := os.Create(filepath.Join(dir, "sparse"))
	if err != nil {
		t.Fatal(err)
	}
	if err := sp.Truncate(1 << 30); err != nil {
		t.Fatal(err)
	}
	sp.Close()
	got, err := DirSize(dir)
	if err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command("du", "-s", "-B1", dir).Output()
	if err != nil {
		t.Fatal(err)
	}
	du, _ := strconv.ParseInt(strings.Fields(string(out))[0], 10, 64)
	// du counts the root directory too; DirSize only what is under it.
	var rootSt syscall.Stat_t
	if err := syscall.Stat(dir, &rootSt); err != nil {
		t.Fatal(err)
	}
	if want := du - rootSt.Blocks*512; got != want {
		t.Fatalf("DirSize %d, du without the root %d (the files' sizes sum to %d)", got, want, sizes)
	}
	if got < n*512 || got >= 1<<30 {
		t.Fatalf("DirSize %d: want at least a block per small file and nothing for the hole", got)
	}
}
