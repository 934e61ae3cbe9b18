package state_test

import (
	"context"
	"sort"
	"strings"
	"sync"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// sweepingProc is the fake process back end with an ImageSweeper that
// records what each sweep was asked to keep.
type sweepingProc struct {
	*statefake.Proc
	mu    sync.Mutex
	calls []string // "start|gc: template,template,..."
}

func (p *sweepingProc) SweepImages(_ context.Context, keep []*state.ProcPart, start bool) (int, int64, error) {
	var tpls []string
	for _, part := range keep {
		tpls = append(tpls, part.Templates...)
	}
	sort.Strings(tpls)
	what := "gc"
	if start {
		what = "start"
	}
	p.mu.Lock()
	p.calls = append(p.calls, what+": "+strings.Join(tpls, ","))
	p.mu.Unlock()
	return 0, 0, nil
}

func (p *sweepingProc) take() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	out := p.calls
	p.calls = nil
	return out
}

// TestImageSweepKeepsEveryRecordsPart: the process back end's image sweep
// runs when the store is opened (start) and after each collection (not a
// dry run), and is told the process part of every checkpoint kept, and of
// none freed or dropped.
func TestImageSweepKeepsEveryRecordsPart(t *testing.T) {
	ctx := context.Background()
	dir := t.TempDir()
	b := statefake.New(nil)
	proc := &sweepingProc{Proc: b.Proc}
	open := func() *state.Manager {
		t.Helper()
		m, err := state.Open(ctx, state.Config{Dir: dir, FS: b.FS, Proc: proc, BootID: "boot-1", NoSync: true})
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	m := open()
	if got := proc.take(); len(got) != 1 || got[0] != "start: " {
		t.Fatalf("sweeps at the first start: %q", got)
	}
	tpl := func(id string) string {
		t.Helper()
		c, err := m.GetCheckpoint(id)
		if err != nil || c.Proc == nil || len(c.Proc.Templates) != 1 {
			t.Fatalf("checkpoint %s: %+v %v", id, c, err)
		}
		return c.Proc.Templates[0]
	}
	turn := func(name string) string {
		t.Helper()
		if _, err := m.Exec(ctx, name, 0, state.ExecRequest{Argv: []string{"write", "/f"}}); err != nil {
			t.Fatal(err)
		}
		r, err := m.Turn(ctx, name, state.TurnRequest{Mode: state.ModeFull, Wait: true})
		if err != nil {
			t.Fatal(err)
		}
		return r.ID
	}
	for _, name := range []string{"a", "b"} {
		if _, err := m.Create(ctx, state.CreateRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	a1, a2, b1 := turn("a"), turn("a"), turn("b")
	kept := []string{tpl(a1), tpl(a2)}
	sort.Strings(kept)
	want := strings.Join(kept, ",")
	if err := m.Remove(ctx, "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := m.GC(ctx, true); err != nil {
		t.Fatal(err)
	}
	if got := proc.take(); len(got) != 0 {
		t.Fatalf("a dry run swept: %q", got)
	}
	res, err := m.GC(ctx, false)
	if err != nil || len(res.Freed) != 1 || res.Freed[0] != b1 {
		t.Fatalf("gc: %+v %v", res, err)
	}
	if got := proc.take(); len(got) != 1 || got[0] != "gc: "+want {
		t.Fatalf("sweeps after the gc: %q, want %q", got, "gc: "+want)
	}
	if err := m.Close(ctx); err != nil {
		t.Fatal(err)
	}
	m = open()
	defer m.Close(ctx)
	if got := proc.take(); len(got) != 1 || got[0] != "start: "+want {
		t.Fatalf("sweeps at a restart: %q, want %q", got, "start: "+want)
	}
}
