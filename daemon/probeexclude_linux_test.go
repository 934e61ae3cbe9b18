package daemon

import (
	"context"
	"os/exec"
	"testing"

	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/cr/inject"
	"github.com/rewind-sandbox/rewind/probe"
)

// TestProbeExcludeKeepsOnlyTheAgentsProcesses: the probe sees the
// sandbox's init's descendants (a session shell and its background job),
// and not the init itself, a process outside the init's tree, a process
// this daemon traces (a copy being made), or parked processes.
func TestProbeExcludeKeepsOnlyTheAgentsProcesses(t *testing.T) {
	ps, send := parkSandbox(t)
	ctx := context.Background()
	w := &probeWindow{eng: ps.b.eng, sb: ps.sb, t: probe.Target{InitPID: ps.sb.InitPID()}}
	shell := ps.sb.Session("sh").PID()
	send("sleep 1000 & echo $! > /tmp/bg")
	kids, err := ps.b.eng.Processes(ps.sb)
	if err != nil || len(kids) != 2 {
		t.Fatalf("live processes %+v %v", kids, err)
	}
	bg := 0
	for _, k := range kids {
		if k.PID != shell {
			bg = k.PID
		}
	}
	host := exec.Command("sleep", "1000")
	if err := host.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() { host.Process.Kill(); host.Wait() }()
	for _, tc := range []struct {
		name string
		pid  int
		want bool
	}{
		{"init", ps.sb.InitPID(), true},
		{"session shell", shell, false},
		{"background job", bg, false},
		{"host process", host.Process.Pid, true},
	} {
		if got := w.exclude(tc.pid); got != tc.want {
			t.Errorf("exclude(%s %d) = %v, want %v", tc.name, tc.pid, got, tc.want)
		}
	}

	// A process first seen while this daemon traces it (a copy cr is
	// making) is left out until it runs free.
	send("sleep 1000 & echo $! > /tmp/bg2")
	kids, err = ps.b.eng.Processes(ps.sb)
	if err != nil || len(kids) != 3 {
		t.Fatalf("live processes %+v %v", kids, err)
	}
	bg2 := 0
	for _, k := range kids {
		if k.PID != shell && k.PID != bg {
			bg2 = k.PID
		}
	}
	tr := inject.NewTracer()
	defer tr.Close()
	ip, err := tr.Attach(bg2)
	if err != nil {
		t.Fatal(err)
	}
	if !w.exclude(bg2) {
		t.Error("a process this daemon traces is not excluded")
	}
	if err := ip.Detach(); err != nil {
		t.Fatal(err)
	}
	if w.exclude(bg2) {
		t.Error("the background job is excluded once detached")
	}
	// A process known to be the agent's stays the agent's while this
	// daemon traces it for a moment (a checkpoint's or a digest's stop):
	// leaving it out would report it exited and then new.
	if ip, err = tr.Attach(bg); err != nil {
		t.Fatal(err)
	}
	if w.exclude(bg) {
		t.Error("a known agent process is excluded while traced")
	}
	if err := ip.Detach(); err != nil {
		t.Fatal(err)
	}

	send("kill %1 %2; wait")
	target, err := ps.Checkpoint(ctx, nil)
	if err != nil || target.Data["mode"] != string(cr.ModeTemplate) {
		t.Fatalf("checkpoint of the lone shell %+v: %v", target, err)
	}
	defer ps.b.Release(ctx, target)
	undo, err := ps.CheckpointUndo(ctx, target, nil)
	if err != nil || undo.Data["mode"] != string(cr.ModeParked) {
		t.Fatalf("undo point %+v: %v", undo, err)
	}
	if !w.exclude(shell) {
		t.Error("a parked shell is not excluded")
	}
	if _, err := ps.Restore(ctx, undo, func() error { return nil }); err != nil {
		t.Fatal(err)
	}
	ps.b.Release(ctx, undo)
	if w.exclude(shell) {
		t.Error("the shell is excluded once it runs on")
	}
}

// BenchmarkProbeExclude is exclude's cost for the session shell, once per
// snapshot: known as the agent's (its stat only) against found anew (its
// stat and status, as every snapshot did before agents were remembered).
func BenchmarkProbeExclude(b *testing.B) {
	ps, _ := parkSandbox(b)
	w := &probeWindow{eng: ps.b.eng, sb: ps.sb, t: probe.Target{InitPID: ps.sb.InitPID()}}
	shell := ps.sb.Session("sh").PID()
	b.Run("known", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if w.exclude(shell) {
				b.Fatal("shell excluded")
			}
		}
	})
	b.Run("anew", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			w.agentsMu.Lock()
			w.agents = nil
			w.agentsMu.Unlock()
			if w.exclude(shell) {
				b.Fatal("shell excluded")
			}
		}
	})
}
