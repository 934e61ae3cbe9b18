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
