package cr

import (
	"fmt"
	"testing"
)

func TestPoolEvictsOnlyImagedLRUUnreachableFirst(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	e := newEngine(t, Config{ImagesDir: t.TempDir(), MaxTemplates: 10})
	for i := 0; i < 3; i++ {
		bashChat(t, live, fmt.Sprintf("export N=%d", i))
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: fmt.Sprint("c", i)}); err != nil {
			t.Fatal(err)
		}
	}
	for i := 0; i < 3; i++ {
		if err := e.WaitImage(ctxT(t), fmt.Sprint("c", i)); err != nil {
			t.Fatal(err)
		}
	}
	templ := func(id string) bool { p, _ := e.Parts(id); return p.Template }
	// c1 is no longer reachable by the search: over the bound, it goes first.
	e.Hint("c1", false)
	e.SetLimits(2, 0)
	if templ("c1") || !templ("c0") || !templ("c2") {
		t.Fatalf("after bound 2: c0 %v c1 %v c2 %v; want c1 evicted", templ("c0"), templ("c1"), templ("c2"))
	}
	// Then least recently used: c0 (c2 is the newest).
	e.SetLimits(1, 0)
	if templ("c0") || !templ("c2") {
		t.Fatalf("after bound 1: c0 %v c2 %v; want c0 evicted", templ("c0"), templ("c2"))
	}
	if st := e.Stats(); st.WithTemplates != 1 || st.Checkpoints != 3 {
		t.Fatalf("stats %+v", st)
	}
	// Every checkpoint is still restorable: c1 from its image.
	stdio, sessions := freshStdio(t, sb)
	for _, id := range []string{"c1", "c0", "c2"} {
		res, err := e.Restore(ctxT(t), sb, id, RestoreOptions{Stdio: stdio})
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"c0": "0", "c1": "1", "c2": "2"}[id]
		if got := bashChat(t, <-sessions, "echo $N"); got != want {
			t.Fatalf("%s (%s): N=%q, want %q", id, res.Path, got, want)
		}
	}
}

func TestPoolWithoutImagesKeepsReachable(t *testing.T) {
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	e := newEngine(t, Config{MaxTemplates: 1})
	for i := 0; i < 3; i++ {
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: fmt.Sprint("c", i)}); err != nil {
			t.Fatal(err)
		}
	}
	// No image: nothing may be evicted (eviction never loses a checkpoint).
	if st := e.Stats(); st.WithTemplates != 3 {
		t.Fatalf("stats %+v", st)
	}
	e.Hint("c0", false)
	e.enforceBounds()
	if p, _ := e.Parts("c0"); p.Template {
		t.Fatal("unreachable c0 kept its template")
	}
	if st := e.Stats(); st.WithTemplates != 2 {
		t.Fatalf("stats after hint %+v", st)
	}
}

// TestPoolByteBound: the byte bound counts each template as last measured
// while the pool is far below it (no smaps_rollup read per template and
// checkpoint), measures every template again once the estimate passes half
// the bound, and then evicts the least recently used imaged checkpoints.
func TestPoolByteBound(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	e := newEngine(t, Config{ImagesDir: t.TempDir(), MaxTemplateBytes: 1 << 40})
	for i := 0; i < 3; i++ {
		id := fmt.Sprint("c", i)
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: id}); err != nil {
			t.Fatal(err)
		}
		if err := e.WaitImage(ctxT(t), id); err != nil {
			t.Fatal(err)
		}
	}
	tmOf := func(id string) *template {
		e.mu.Lock()
		defer e.mu.Unlock()
		if tms := e.ckpts[id].templates; len(tms) > 0 {
			return tms[0]
		}
		return nil
	}
	// A value no measurement gives marks c0's template as measured.
	const mark = 12345
	tm := tmOf("c0")
	e.mu.Lock()
	tm.dirty, tm.measured = mark, true
	e.mu.Unlock()
	e.enforceBounds()
	e.mu.Lock()
	got := tm.dirty
	e.mu.Unlock()
	if got != mark {
		t.Fatalf("far below the bound, c0's template was measured again: %d", got)
	}
	// A bound the estimate passes (one byte): everything is measured,
	// and all but the newest checkpoint lose their templates.
	e.SetLimits(0, 1)
	if tmOf("c0") != nil || tmOf("c1") != nil || tmOf("c2") == nil {
		t.Fatalf("after a one-byte bound: c0 %v c1 %v c2 %v; want only c2 kept", tmOf("c0") != nil, tmOf("c1") != nil, tmOf("c2") != nil)
	}
	e.mu.Lock()
	got = tm.dirty
	e.mu.Unlock()
	// (A measurement can give 0: a template whose every dirty page is
	// shared with the other templates and the live process, its spare
	// not warmed yet. It never gives mark, which is no multiple of 1 KiB.)
	if got == mark {
		t.Fatalf("near the bound, c0's template was not measured again: %d", got)
	}
}

// BenchmarkPoolBound is the bound check that runs after every checkpoint,
// over 32 checkpoints of a shell (no images, so nothing is evicted): far
// below the byte bound (each template counted as last measured) and near
// it (each measured again, as every check did before).
func BenchmarkPoolBound(b *testing.B) {
	needCRIU(b)
	sb := startSandbox(b, "bash", "--norc", "--noprofile")
	e := newEngine(b, Config{MaxTemplates: 1000})
	for i := 0; i < 32; i++ {
		if _, err := e.Checkpoint(ctxT(b), sb, CheckpointOptions{ID: fmt.Sprint("c", i)}); err != nil {
			b.Fatal(err)
		}
	}
	// Near: the templates' memory is more than half the bound, and within it.
	near := e.Stats().PrivateDirty * 3 / 2
	for _, bc := range []struct {
		name  string
		bound int64
	}{{"far", 1 << 40}, {"near", near}} {
		b.Run(bc.name, func(b *testing.B) {
			e.SetLimits(0, bc.bound)
			for i := 0; i < b.N; i++ {
				e.enforceBounds()
			}
			if st := e.Stats(); st.WithTemplates != 32 {
				b.Fatalf("templates evicted: %+v", st)
			}
		})
	}
}
