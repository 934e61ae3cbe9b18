package state_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// goneLoader is statefake.Policies, except that the policy named gone can
// no longer be loaded (a .wasm file deleted while the daemon was down).
type goneLoader struct{ gone string }

func (l goneLoader) Load(ctx context.Context, name string) (state.Policy, error) {
	if name == l.gone {
		return nil, errors.New("open /policies/" + name + ".wasm: no such file or directory")
	}
	return statefake.Policies{}.Load(ctx, name)
}

// restartWith ends e's manager as the daemon would (killed: a crash;
// otherwise Close, as on SIGTERM) and opens a new one on the same state
// dir and disk, with the fake probe and policies (pol instead, if
// non-nil), as a daemon started again with the same flags.
func restartWith(e *env, killed bool, pol state.PolicyLoader) {
	e.t.Helper()
	if killed {
		e.m.CrashForTest()
	} else if err := e.m.Close(e.ctx); err != nil {
		e.t.Fatal(err)
	}
	e.b = &statefake.Backends{Disk: e.b.Disk, Faults: e.b.Faults,
		FS: &statefake.FS{Disk: e.b.Disk, Faults: e.b.Faults}, Proc: &statefake.Proc{Disk: e.b.Disk, Faults: e.b.Faults}}
	if pol == nil {
		pol = statefake.Policies{}
	}
	m, err := state.Open(e.ctx, state.Config{Dir: e.dir, FS: e.b.FS, Proc: e.b.Proc, BootID: "boot-1", NoSync: true,
		Probe: statefake.Probe{}, Policies: pol, DefaultPolicy: "fake"})
	if err != nil {
		e.t.Fatal(err)
	}
	e.m = m
}

// TestPolicySurvivesRestart: a sandbox brought back by a restore after the
// daemon restarted (killed, or stopped cleanly) decides its auto turns with
// the policy it was created with, as a new sandbox does, not with full
// checkpoints for want of a policy.
func TestPolicySurvivesRestart(t *testing.T) {
	for _, tc := range []struct {
		name   string
		killed bool
	}{{"killed", true}, {"stopped", false}} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, true)
			// ignore-fs, not the default: its decisions tell it apart.
			if _, err := e.m.Create(e.ctx, state.CreateRequest{Name: "a", Policy: "ignore-fs"}); err != nil {
				t.Fatal(err)
			}
			e.run("a", "write", "/f", "one")
			ck := e.turn("a", state.ModeFull, true)
			if !ck.Durable {
				t.Fatalf("checkpoint not durable: %+v", ck)
			}
			restartWith(e, tc.killed, nil)
			e.restore("a", ck.ID)

			for i := range 2 {
				r := e.turn("a", state.ModeAuto, true)
				if r.Decision != state.ModeSkip || r.ID != ck.ID || r.Report == nil {
					t.Fatalf("turn %d without effects after the restart: %+v", i+1, r)
				}
			}
			// The sandbox's own policy, not the default: a file change
			// alone is skipped.
			e.run("a", "write", "/cache", "x")
			if r := e.turn("a", state.ModeAuto, true); r.Decision != state.ModeSkip {
				t.Fatalf("file-only turn under ignore-fs after the restart: %+v", r)
			}
			sb, err := e.m.Get("a")
			if err != nil {
				t.Fatal(err)
			}
			if sb.Policy != "ignore-fs" || sb.Note != "" {
				t.Fatalf("sandbox after the restore: %+v", sb)
			}
		})
	}
}

// TestPolicyUnloadableAfterRestart: when the policy a sandbox names can no
// longer be loaded after a restart, the restore still brings the sandbox
// back (full checkpoints lose nothing), and the sandbox's note, every auto
// turn's reason and its turn report say which policy failed and why.
func TestPolicyUnloadableAfterRestart(t *testing.T) {
	e := newEnv(t, true)
	if _, err := e.m.Create(e.ctx, state.CreateRequest{Name: "a", Policy: "ignore-fs"}); err != nil {
		t.Fatal(err)
	}
	ck := e.turn("a", state.ModeFull, true)
	restartWith(e, true, goneLoader{gone: "ignore-fs"})
	e.restore("a", ck.ID)
	sb, err := e.m.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if sb.Status != state.StatusRunning || !strings.Contains(sb.Note, "policy ignore-fs") || !strings.Contains(sb.Note, "no such file") {
		t.Fatalf("sandbox whose policy is gone: %+v", sb)
	}
	r := e.turn("a", state.ModeAuto, true)
	if r.Decision != state.ModeFull || !strings.Contains(r.Reason, "policy ignore-fs") || !strings.Contains(r.Reason, "no such file") {
		t.Fatalf("auto turn whose policy is gone: %+v", r)
	}
	page, err := e.m.Reports(e.ctx, "a", 0, 0)
	if err != nil || len(page.Reports) == 0 {
		t.Fatalf("reports: %+v %v", page, err)
	}
	if tr := page.Reports[len(page.Reports)-1]; tr.Decision != "" || !strings.Contains(tr.Reason, "policy ignore-fs") {
		t.Fatalf("turn report whose policy is gone: %+v", tr)
	}
	// Explicit modes are unaffected.
	e.run("a", "write", "/f", "x")
	if r := e.turn("a", state.ModeFS, true); r.Decision != state.ModeFS {
		t.Fatalf("fs turn: %+v", r)
	}
}
