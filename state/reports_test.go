package state_test

import (
	"context"
	"errors"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// openRing opens a manager with the fake probe and policy and a report ring
// of size ring.
func openRing(t *testing.T, ring int) *env {
	t.Helper()
	e := &env{t: t, dir: t.TempDir(), b: statefake.New(nil), ctx: context.Background()}
	m, err := state.Open(e.ctx, state.Config{Dir: e.dir, FS: e.b.FS, Proc: e.b.Proc, NoSync: true,
		Probe: statefake.Probe{}, Policies: statefake.Policies{}, DefaultPolicy: "fake", ReportRing: ring})
	if err != nil {
		t.Fatal(err)
	}
	e.m = m
	t.Cleanup(func() { m.Close(context.Background()) })
	return e
}

func TestReportsRecordTurns(t *testing.T) {
	e := openRing(t, 0)
	e.create("a")
	type step struct {
		argv      []string
		mode      state.Mode
		decision  state.Mode // the policy's ("" when it was not asked)
		applied   state.Mode
		reasonSet bool
	}
	steps := []step{
		{[]string{"set", "x", "1"}, state.ModeAuto, state.ModeFull, state.ModeFull, true},
		{[]string{"echo", "read-only"}, state.ModeAuto, state.ModeSkip, state.ModeSkip, true},
		{[]string{"write", "/f", "x"}, state.ModeAuto, state.ModeFS, state.ModeFS, true},
		{[]string{"write", "/g", "y"}, state.ModeFull, "", state.ModeFull, false},
		{[]string{"echo", "again"}, "", state.ModeSkip, state.ModeSkip, true},
	}
	var ids []string
	for _, s := range steps {
		e.run("a", s.argv...)
		ids = append(ids, e.turn("a", s.mode, false).ID)
	}
	page, err := e.m.Reports(e.ctx, "a", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Reports) != len(steps) || page.Last != uint64(len(steps)) || page.Dropped != 0 {
		t.Fatalf("page: %d reports, last %d, dropped %d", len(page.Reports), page.Last, page.Dropped)
	}
	for i, s := range steps {
		r := page.Reports[i]
		wantReq := s.mode
		if wantReq == "" {
			wantReq = state.ModeAuto
		}
		if r.Seq != uint64(i+1) || r.Requested != wantReq || r.Decision != s.decision || r.Applied != s.applied ||
			r.Checkpoint != ids[i] || r.Policy != "fake" || r.Epoch != 1 || (r.Reason != "") != s.reasonSet || r.Fallback {
			t.Errorf("report %d: %+v, want %+v and checkpoint %s", i, r, s, ids[i])
		}
		if r.Report == nil || r.Report.Turn != uint64(i+1) {
			t.Errorf("report %d carries effect report %+v", i, r.Report)
		}
	}
	// The skip reports the head it kept.
	if page.Reports[1].Checkpoint != ids[0] {
		t.Errorf("skip answered %s, want the head %s", page.Reports[1].Checkpoint, ids[0])
	}
	if page.Reports[2].Report.FS.Modified == 0 {
		t.Errorf("file-writing turn reports no fs change: %+v", page.Reports[2].Report.FS)
	}

	tests := []struct {
		after     uint64
		wantFirst uint64
		wantN     int
	}{{0, 1, 5}, {2, 3, 3}, {4, 5, 1}, {5, 0, 0}, {99, 0, 0}}
	for _, tt := range tests {
		p, err := e.m.Reports(e.ctx, "a", tt.after, 0)
		if err != nil {
			t.Fatal(err)
		}
		if len(p.Reports) != tt.wantN || (tt.wantN > 0 && p.Reports[0].Seq != tt.wantFirst) || p.Last != 5 {
			t.Errorf("after %d: %d reports (last %d), want %d from %d", tt.after, len(p.Reports), p.Last, tt.wantN, tt.wantFirst)
		}
	}
	if _, err := e.m.Reports(e.ctx, "nope", 0, 0); !errors.Is(err, state.ErrNotFound) {
		t.Errorf("unknown sandbox: %v", err)
	}
}

func TestReportsRingBounded(t *testing.T) {
	e := openRing(t, 3)
	e.create("a")
	for i := 0; i < 7; i++ {
		e.run("a", "write", "/f", "x")
		e.turn("a", state.ModeAuto, false)
	}
	tests := []struct {
		after            uint64
		wantSeqs         []uint64
		wantDropped      uint64
		wantLastReported uint64
	}{
		{0, []uint64{5, 6, 7}, 4, 7},
		{3, []uint64{5, 6, 7}, 1, 7},
		{4, []uint64{5, 6, 7}, 0, 7},
		{6, []uint64{7}, 0, 7},
	}
	for _, tt := range tests {
		p, err := e.m.Reports(e.ctx, "a", tt.after, 0)
		if err != nil {
			t.Fatal(err)
		}
		var seqs []uint64
		for _, r := range p.Reports {
			seqs = append(seqs, r.Seq)
			if r.Report.Turn != r.Seq {
				t.Errorf("seq %d holds turn %d", r.Seq, r.Report.Turn)
			}
		}
		if len(seqs) != len(tt.wantSeqs) || p.Dropped != tt.wantDropped || p.Last != tt.wantLastReported {
			t.Errorf("after %d: seqs %v dropped %d last %d, want %v %d %d", tt.after, seqs, p.Dropped, p.Last, tt.wantSeqs, tt.wantDropped, tt.wantLastReported)
			continue
		}
		for i := range seqs {
			if seqs[i] != tt.wantSeqs[i] {
				t.Errorf("after %d: seqs %v, want %v", tt.after, seqs, tt.wantSeqs)
			}
		}
	}

	// A disabled ring keeps nothing.
	off := openRing(t, -1)
	off.create("b")
	off.run("b", "write", "/f", "x")
	off.turn("b", state.ModeAuto, false)
	if p, err := off.m.Reports(off.ctx, "b", 0, 0); err != nil || len(p.Reports) != 0 || p.Last != 0 {
		t.Errorf("disabled ring: %+v %v", p, err)
	}
	// Without a probe there is no report to keep.
	np := newEnv(t, false)
	np.create("c")
	np.turn("c", state.ModeFull, false)
	if p, err := np.m.Reports(np.ctx, "c", 0, 0); err != nil || len(p.Reports) != 0 {
		t.Errorf("no probe: %+v %v", p, err)
	}
}

func TestReportsWaitForNextTurn(t *testing.T) {
	e := openRing(t, 0)
	e.create("a")
	e.turn("a", state.ModeFull, true)
	type answer struct {
		p   *state.ReportPage
		err error
	}
	got := make(chan answer, 1)
	go func() {
		p, err := e.m.Reports(e.ctx, "a", 1, time.Minute)
		got <- answer{p, err}
	}()
	e.run("a", "write", "/f", "x")
	id := e.turn("a", state.ModeAuto, false).ID
	a := <-got
	if a.err != nil || len(a.p.Reports) != 1 || a.p.Reports[0].Seq != 2 || a.p.Reports[0].Checkpoint != id {
		t.Fatalf("waiting reader got %+v %v, want seq 2 of %s", a.p, a.err, id)
	}
	// A cancelled wait answers what there is (nothing new) without error.
	ctx, cancel := context.WithCancel(e.ctx)
	cancel()
	if p, err := e.m.Reports(ctx, "a", 2, time.Minute); err != nil || len(p.Reports) != 0 || p.Last != 2 {
		t.Fatalf("cancelled wait: %+v %v", p, err)
	}
}
