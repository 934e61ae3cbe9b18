package daemon

import (
	"context"
	"slices"
	"testing"

	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/probe"
)

// handedOver returns, sorted, the pids ps holds for the next probe window
// and the pids of the sandbox's live processes.
func handedOver(t *testing.T, ps *procSandbox) (got, want []int) {
	t.Helper()
	live, err := ps.b.eng.Processes(ps.sb)
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range live {
		want = append(want, l.PID)
	}
	ps.mu.Lock()
	got = slices.Clone(ps.restored)
	ps.mu.Unlock()
	slices.Sort(got)
	slices.Sort(want)
	return got, want
}

// TestRestoreOpensTheProbeWindowOnItsCopies: a template restore hands the
// next probe window the processes it left alive, once (the window then
// lists no cgroup), and that window reports the next turn's effects as a
// window on a listing of the cgroup does; a window's End forgets them.
func TestRestoreOpensTheProbeWindowOnItsCopies(t *testing.T) {
	ps, send := parkSandbox(t)
	ctx := context.Background()
	p, err := probe.OpenEBPF(probe.Options{})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer p.Close()
	target, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	pw, err := (&probeAdapter{p: p, eng: ps.b.eng}).Watch(ctx, "known", nil, ps)
	if err != nil {
		t.Fatal(err)
	}
	w := pw.(*probeWindow)
	defer w.Close()
	if _, ok := ps.takeRestored(); ok {
		t.Fatal("pids to hand over before any restore")
	}
	for _, tc := range []struct {
		name    string
		cmd     string // run in the restored shell in the window
		newLong uint64
		alive   uint64
	}{
		{name: "idle", alive: 1},
		{name: "builtin", cmd: "V=3", alive: 1},
		{name: "background job", cmd: "sleep 1000 & true", newLong: 1, alive: 2},
		{name: "job and its exit", cmd: "sleep 1000 & kill $!; wait", alive: 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			send("sleep 1000 & true") // killed by the restore
			if _, err := w.End(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := ps.Restore(ctx, target, func() error { return nil }); err != nil {
				t.Fatal(err)
			}
			if got, want := handedOver(t, ps); !slices.Equal(got, want) || len(got) != 1 {
				t.Fatalf("restore hands over %v, live processes %v", got, want)
			}
			if err := w.Begin(ctx); err != nil {
				t.Fatal(err)
			}
			if _, ok := ps.takeRestored(); ok {
				t.Fatal("the restore's pids are handed over twice")
			}
			if tc.cmd != "" {
				send(tc.cmd)
			}
			r, err := w.End(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if r.Proc.NewLongLived != tc.newLong || r.Proc.Alive != tc.alive || r.Proc.Exited != 0 {
				t.Errorf("report %+v, want %d new, %d alive, none exited", r.Proc, tc.newLong, tc.alive)
			}
			if err := w.Begin(ctx); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestCheckpointOpensTheProbeWindowOnItsProcesses: a checkpoint (template
// or CRIU) hands the next probe window the processes it took, so a process
// one of them starts after the checkpoint resumed them and before the
// window opens is new in that window; with a window on a fresh listing of
// the cgroup it would hide in the first snapshot. An undo checkpoint hands
// nothing over (its restore does).
func TestCheckpointOpensTheProbeWindowOnItsProcesses(t *testing.T) {
	ps, send := parkSandbox(t)
	ctx := context.Background()
	p, err := probe.OpenEBPF(probe.Options{})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer p.Close()
	pw, err := (&probeAdapter{p: p, eng: ps.b.eng}).Watch(ctx, "ckpt-known", nil, ps)
	if err != nil {
		t.Fatal(err)
	}
	w := pw.(*probeWindow)
	defer w.Close()
	if _, err := w.End(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := ps.Checkpoint(ctx, nil); err != nil {
		t.Fatal(err)
	}
	live, err := ps.b.eng.Processes(ps.sb)
	if err != nil || len(live) != 1 {
		t.Fatalf("live processes %+v %v", live, err)
	}
	w.ps.mu.Lock()
	got := slices.Clone(w.ps.restored)
	w.ps.mu.Unlock()
	if !slices.Equal(got, []int{live[0].PID}) {
		t.Fatalf("checkpoint hands over %v, live %v", got, live)
	}
	// Between the checkpoint and the window: a lasting background job.
	send("sleep 1000 & true")
	if err := w.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := w.End(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Proc.NewLongLived != 1 || r.Proc.Alive != 2 {
		t.Fatalf("report %+v: the job started before the window opened is not new in it", r.Proc)
	}
	// The same after a CRIU checkpoint (the shell and its job: a tree).
	if err := w.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := w.End(ctx); err != nil {
		t.Fatal(err)
	}
	part, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if part.Data["mode"] != string(cr.ModeCRIU) {
		t.Fatalf("checkpoint of a shell with a job: mode %q", part.Data["mode"])
	}
	send("sleep 1001 & true")
	if err := w.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	if r, err = w.End(ctx); err != nil {
		t.Fatal(err)
	}
	if r.Proc.NewLongLived != 1 || r.Proc.Alive != 3 {
		t.Fatalf("report %+v after a CRIU checkpoint: want the second job new", r.Proc)
	}
	send("kill %2; wait %2")
	// An undo checkpoint (a restore's) hands nothing over: the restore does.
	send("kill %1; wait")
	if err := w.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	if _, err := w.End(ctx); err != nil {
		t.Fatal(err)
	}
	part, err = ps.checkpoint(ctx, nil, true, false)
	if err != nil {
		t.Fatal(err)
	}
	if part.Data["mode"] != string(cr.ModeTemplate) {
		t.Fatalf("undo checkpoint of a lone shell: mode %q", part.Data["mode"])
	}
	if _, ok := ps.takeRestored(); ok {
		t.Fatal("an undo checkpoint hands its processes over")
	}
}

// TestCRIURestoreOpensTheProbeWindowOnItsTrees: a CRIU restore hands the
// next probe window every process of the trees it restored (not only
// their roots), so a process one of them starts before the window opens
// is new in that window, and the restored job is not.
func TestCRIURestoreOpensTheProbeWindowOnItsTrees(t *testing.T) {
	ps, send := parkSandbox(t)
	ctx := context.Background()
	p, err := probe.OpenEBPF(probe.Options{})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer p.Close()
	send("sleep 1000 & true")
	target, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if target.Data["mode"] != string(cr.ModeCRIU) {
		t.Fatalf("checkpoint of a shell with a job: mode %q", target.Data["mode"])
	}
	pw, err := (&probeAdapter{p: p, eng: ps.b.eng}).Watch(ctx, "criu-known", nil, ps)
	if err != nil {
		t.Fatal(err)
	}
	w := pw.(*probeWindow)
	defer w.Close()
	send("sleep 1001 & true") // killed by the restore
	if _, err := w.End(ctx); err != nil {
		t.Fatal(err)
	}
	path, err := ps.Restore(ctx, target, func() error { return nil })
	if err != nil {
		t.Fatal(err)
	}
	if path != "criu" {
		t.Fatalf("restore path %q, want criu", path)
	}
	if got, want := handedOver(t, ps); !slices.Equal(got, want) || len(got) != 2 {
		t.Fatalf("CRIU restore hands over %v, live processes %v (want the shell and its job)", got, want)
	}
	// Between the restore and the window: a lasting job of the restored
	// shell.
	send("sleep 1002 & true")
	if err := w.Begin(ctx); err != nil {
		t.Fatal(err)
	}
	r, err := w.End(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if r.Proc.NewLongLived != 1 || r.Proc.Alive != 3 {
		t.Fatalf("report %+v after a CRIU restore: want the job started before the window new, 3 alive", r.Proc)
	}
}
