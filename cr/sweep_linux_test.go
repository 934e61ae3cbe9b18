package cr

import (
	"os"
	"path/filepath"
	"sort"
	"testing"
)

// TestSweepImages: SweepImages removes the image directories no one uses
// (a failed CRIU-path dump's, one cut short by a crash, one half removed),
// and empty sandbox directories, and keeps those the caller's records name,
// the ones the engine holds and the ones being written. At start it also
// drops loaded images no record names and removes a named directory that
// holds no complete image.
func TestSweepImages(t *testing.T) {
	dir := t.TempDir()
	e := newEngine(t, Config{ImagesDir: dir})
	file := func(rel string, n int) {
		t.Helper()
		p := filepath.Join(dir, rel)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, make([]byte, n), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	// A complete image (metadata written), as an earlier engine left it.
	complete := func(sb, id string) {
		t.Helper()
		file(filepath.Join(sb, id, "0", "pages-1.img"), 4096)
		c := &ckpt{rec: Checkpoint{ID: id, Sandbox: sb, Mode: ModeTemplate}, image: Parts{Image: true, ImageDir: filepath.Join(dir, sb, id)}}
		c.images = []image{{orig: Proc{PID: 1}, dir: filepath.Join(dir, sb, id, "0")}}
		if err := writeMeta(c); err != nil {
			t.Fatal(err)
		}
	}
	complete("sb-a", "p-kept")                                             // a record uses it
	complete("sb-a", "p-held")                                             // loaded; no record (yet) names it
	complete("sb-b", "p-unused")                                           // loaded; no record names it
	file("sb-a/p-failed/0/dump.log", 100)                                  // a failed CRIU-path dump
	file("sb-c/p-cut/0/pages-1.img", 8192)                                 // a dump cut short: no record
	file("sb-a/p-partial/0/pages-1.img", 8192)                             // a record's, dump cut short
	file("sb-d/p-busy/0/pages-1.img", 10)                                  // being written now
	if err := os.MkdirAll(filepath.Join(dir, "sb-e"), 0o700); err != nil { // a removed sandbox's, empty
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Join(dir, "sb-f"), 0o700); err != nil { // empty, a dump about to make its image
		t.Fatal(err)
	}
	if _, err := e.LoadImages(); err != nil {
		t.Fatal(err)
	}
	e.writingImage("p-busy", "sb-d")
	e.writingImage("p-new", "sb-f")
	keep := map[string]bool{"p-kept": true, "p-partial": true}
	list := func() []string {
		t.Helper()
		var out []string
		sbs, _ := os.ReadDir(dir)
		for _, sb := range sbs {
			cks, _ := os.ReadDir(filepath.Join(dir, sb.Name()))
			if len(cks) == 0 {
				out = append(out, sb.Name()+"/")
			}
			for _, ck := range cks {
				out = append(out, sb.Name()+"/"+ck.Name())
			}
		}
		sort.Strings(out)
		return out
	}
	eq := func(what string, got, want []string) {
		t.Helper()
		sort.Strings(want)
		if len(got) != len(want) {
			t.Fatalf("%s: %q, want %q", what, got, want)
		}
		for i := range got {
			if got[i] != want[i] {
				t.Fatalf("%s: %q, want %q", what, got, want)
			}
		}
	}

	// After a collection: nothing held or being written goes.
	res, err := e.SweepImages(SweepOptions{Keep: keep})
	if err != nil {
		t.Fatal(err)
	}
	sort.Strings(res.Removed)
	eq("removed", res.Removed, []string{"sb-a/p-failed", "sb-c/p-cut"})
	if res.Bytes != 100+8192 {
		t.Fatalf("bytes %d, want %d", res.Bytes, 100+8192)
	}
	eq("left", list(), []string{"sb-a/p-held", "sb-a/p-kept", "sb-a/p-partial", "sb-b/p-unused", "sb-d/p-busy", "sb-f/"})

	// The dump is done and its checkpoint is no one's: it goes next time.
	e.written("p-busy")
	if _, err := e.SweepImages(SweepOptions{Keep: keep}); err != nil {
		t.Fatal(err)
	}
	eq("left after the dump", list(), []string{"sb-a/p-held", "sb-a/p-kept", "sb-a/p-partial", "sb-b/p-unused", "sb-f/"})

	// At start: the loaded images no record names are dropped, and a
	// record's directory without a complete image goes.
	res, err = e.SweepImages(SweepOptions{Keep: keep, Start: true})
	if err != nil {
		t.Fatal(err)
	}
	eq("left at start", list(), []string{"sb-a/p-kept", "sb-f/"})
	if _, err := e.Parts("p-held"); err == nil {
		t.Fatal("p-held is still held after the sweep at start")
	}
	if p, err := e.Parts("p-kept"); err != nil || !p.Image {
		t.Fatalf("p-kept: %+v %v", p, err)
	}
	e.written("p-new")
	if _, err := e.SweepImages(SweepOptions{Keep: keep}); err != nil {
		t.Fatal(err)
	}
	eq("left at the end", list(), []string{"sb-a/p-kept"})
}
