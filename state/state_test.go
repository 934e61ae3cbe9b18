package state_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

type env struct {
	t   *testing.T
	dir string
	b   *statefake.Backends
	m   *state.Manager
	ctx context.Context
}

func newEnv(t *testing.T, auto bool) *env {
	t.Helper()
	e := &env{t: t, dir: t.TempDir(), b: statefake.New(nil), ctx: context.Background()}
	e.open(auto, "boot-1")
	t.Cleanup(func() { e.m.Close(context.Background()) })
	return e
}

func (e *env) open(auto bool, boot string) {
	e.t.Helper()
	cfg := state.Config{Dir: e.dir, FS: e.b.FS, Proc: e.b.Proc, BootID: boot, NoSync: true}
	if auto {
		cfg.Probe, cfg.Policies, cfg.DefaultPolicy = statefake.Probe{}, statefake.Policies{}, "fake"
	}
	m, err := state.Open(e.ctx, cfg)
	if err != nil {
		e.t.Fatal(err)
	}
	e.m = m
}

func (e *env) create(name string) {
	e.t.Helper()
	if _, err := e.m.Create(e.ctx, state.CreateRequest{Name: name}); err != nil {
		e.t.Fatal(err)
	}
}

// run executes a fake command and returns its output.
func (e *env) run(name string, argv ...string) string {
	e.t.Helper()
	var out bytes.Buffer
	code, err := e.m.Exec(e.ctx, name, 0, state.ExecRequest{Argv: argv, Stdout: &out})
	if err != nil {
		e.t.Fatalf("exec %v: %v", argv, err)
	}
	if code != 0 {
		e.t.Fatalf("exec %v: exit %d: %s", argv, code, out.String())
	}
	return strings.TrimSuffix(out.String(), "\n")
}

func (e *env) turn(name string, mode state.Mode, wait bool) *state.TurnResult {
	e.t.Helper()
	r, err := e.m.Turn(e.ctx, name, state.TurnRequest{Mode: mode, Wait: wait})
	if err != nil {
		e.t.Fatalf("turn %s: %v", mode, err)
	}
	return r
}

func (e *env) restore(name, id string) *state.RestoreResult {
	e.t.Helper()
	r, err := e.m.Restore(e.ctx, name, id, 0)
	if err != nil {
		e.t.Fatalf("restore %s: %v", id, err)
	}
	return r
}

func TestTurnModes(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.run("a", "write", "/f", "one")
	full := e.turn("a", state.ModeFull, true)
	if full.Decision != state.ModeFull || !full.Durable {
		t.Fatalf("full turn: %+v", full)
	}
	skip := e.turn("a", state.ModeSkip, false)
	if skip.ID != full.ID || skip.Decision != state.ModeSkip {
		t.Fatalf("skip must return the previous id %s: %+v", full.ID, skip)
	}
	e.run("a", "write", "/f", "two")
	fsr := e.turn("a", state.ModeFS, true)
	c, err := e.m.GetCheckpoint(fsr.ID)
	if err != nil {
		t.Fatal(err)
	}
	if c.ProcFrom != full.ID || c.Parent != full.ID || c.Proc != nil {
		t.Fatalf("fs-only checkpoint must share its parent's process part: %+v", c)
	}
	if !c.Durable {
		t.Fatalf("fs-only checkpoint of a durable parent must be durable")
	}
	log, err := e.m.Log("a")
	if err != nil || len(log) != 2 || log[0].ID != full.ID || log[1].ID != fsr.ID {
		t.Fatalf("log: %v %v", log, err)
	}
}

func TestFirstTurnUpgrades(t *testing.T) {
	for _, mode := range []state.Mode{state.ModeSkip, state.ModeFS} {
		t.Run(string(mode), func(t *testing.T) {
			e := newEnv(t, false)
			e.create("a")
			r := e.turn("a", mode, true)
			if r.Decision != state.ModeFull || r.ID == "" || !strings.Contains(r.Reason, "no earlier checkpoint") {
				t.Fatalf("first %s turn must become full: %+v", mode, r)
			}
		})
	}
}

func TestRestoreFilesAndProcesses(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.run("a", "write", "/src/main.py", "print(1)")
	e.run("a", "set", "CWD", "/src")
	c1 := e.turn("a", state.ModeFull, false)
	e.run("a", "write", "/src/main.py", "print(2)")
	e.run("a", "set", "CWD", "/tmp")
	e.run("a", "write", "/new", "x")
	c2 := e.turn("a", state.ModeFull, false)
	e.run("a", "write", "/src/main.py", "print(3)") // never checkpointed

	r := e.restore("a", c1.ID)
	if r.Path != "template" || r.Epoch != 2 {
		t.Fatalf("restore result %+v", r)
	}
	if got := e.run("a", "cat", "/src/main.py"); got != "print(1)" {
		t.Fatalf("file after restore = %q", got)
	}
	if got := e.run("a", "get", "CWD"); got != "/src" {
		t.Fatalf("process variable after restore = %q", got)
	}
	var out bytes.Buffer
	if code, _ := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"cat", "/new"}, Stdout: &out}); code == 0 {
		t.Fatalf("/new must not exist after restoring c1")
	}
	e.restore("a", c2.ID)
	if got := e.run("a", "cat", "/src/main.py"); got != "print(2)" {
		t.Fatalf("file after restore c2 = %q", got)
	}
	sb, _ := e.m.Get("a")
	if sb.Head != c2.ID || sb.Epoch != 3 {
		t.Fatalf("sandbox after restores: %+v", sb)
	}
	// The next checkpoint's parent is the restored one: a branch.
	e.restore("a", c1.ID)
	e.run("a", "write", "/branch", "b")
	c3 := e.turn("a", state.ModeFS, true)
	ck, _ := e.m.GetCheckpoint(c3.ID)
	if ck.Parent != c1.ID || ck.ProcFrom != c1.ID {
		t.Fatalf("branch checkpoint %+v, want parent %s", ck, c1.ID)
	}
}

func TestStaleEpochRejected(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	c := e.turn("a", state.ModeFull, true)
	old := c.Epoch
	r := e.restore("a", c.ID)
	if r.Epoch != old+1 {
		t.Fatalf("epoch %d after restore, want %d", r.Epoch, old+1)
	}
	calls := map[string]func() error{
		"exec": func() error {
			_, err := e.m.Exec(e.ctx, "a", old, state.ExecRequest{Argv: []string{"echo"}})
			return err
		},
		"turn": func() error {
			_, err := e.m.Turn(e.ctx, "a", state.TurnRequest{Mode: state.ModeFull, Epoch: old})
			return err
		},
		"restore": func() error { _, err := e.m.Restore(e.ctx, "a", c.ID, old); return err },
		"send": func() error {
			_, err := e.m.Send(e.ctx, "a", old, state.SendRequest{Session: "s", Text: "get x"})
			return err
		},
	}
	for name, call := range calls {
		if err := call(); !errors.Is(err, state.ErrStaleEpoch) {
			t.Errorf("%s with a stale epoch: err = %v, want stale epoch", name, err)
		}
	}
	if _, err := e.m.Exec(e.ctx, "a", r.Epoch, state.ExecRequest{Argv: []string{"echo"}}); err != nil {
		t.Fatalf("exec with the current epoch: %v", err)
	}
	// An epoch the sandbox never handed out is refused too, but not as
	// one it was restored since.
	_, err := e.m.Exec(e.ctx, "a", r.Epoch+1, state.ExecRequest{Argv: []string{"echo"}})
	if !errors.Is(err, state.ErrStaleEpoch) || !strings.Contains(err.Error(), "ahead of") || strings.Contains(err.Error(), "restored since") {
		t.Fatalf("exec with an epoch ahead of the sandbox's: %v", err)
	}
}

func TestRestoreAllOrNothing(t *testing.T) {
	cases := []struct {
		name  string
		fault func(*statefake.Faults) *bool
	}{
		{"fs switch fails", func(f *statefake.Faults) *bool { f.FailSwitch.Store(1); return nil }},
		{"process restore fails", func(f *statefake.Faults) *bool { f.FailRestore.Store(1); return nil }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, false)
			e.create("a")
			e.run("a", "write", "/f", "old")
			e.run("a", "set", "v", "old")
			c := e.turn("a", state.ModeFull, true)
			e.run("a", "write", "/f", "new")
			e.run("a", "write", "/g", "uncheckpointed")
			e.run("a", "set", "v", "new")
			before, _ := e.m.Get("a")

			tc.fault(e.b.Faults)
			if _, err := e.m.Restore(e.ctx, "a", c.ID, 0); err == nil {
				t.Fatal("restore with an injected fault succeeded")
			}
			e.b.Faults.FailCheckpoint.Store(false)

			after, _ := e.m.Get("a")
			if after.Epoch != before.Epoch || after.Head != before.Head || after.Status != state.StatusRunning {
				t.Fatalf("sandbox changed by a failed restore: before %+v after %+v", before, after)
			}
			for path, want := range map[string]string{"/f": "new", "/g": "uncheckpointed"} {
				if got := e.run("a", "cat", path); got != want {
					t.Errorf("%s = %q after failed restore, want %q", path, got, want)
				}
			}
			if got := e.run("a", "get", "v"); got != "new" {
				t.Errorf("process variable = %q after failed restore, want new", got)
			}
			// And a retry works.
			e.restore("a", c.ID)
			if got := e.run("a", "cat", "/f"); got != "old" {
				t.Errorf("retry: /f = %q", got)
			}
		})
	}
}

// TestRestoreWhenTheStateLeftCannotBeSaved: when the undo point cannot be
// taken (here its fs checkpoint fails; in a real sandbox a traced process
// cannot be seized), the restore goes on without one (undo "none") and
// brings the checkpoint back. If the restore then fails too, the error and
// the sandbox's note say that the state before it was not saved, and a
// later restore works.
func TestRestoreWhenTheStateLeftCannotBeSaved(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.run("a", "write", "/f", "old")
	e.run("a", "set", "v", "old")
	c := e.turn("a", state.ModeFull, true)
	e.run("a", "write", "/f", "new")
	e.run("a", "set", "v", "new")

	e.b.Faults.FailCheckpoint.Store(true)
	r, err := e.m.Restore(e.ctx, "a", c.ID, 0)
	e.b.Faults.FailCheckpoint.Store(false)
	if err != nil {
		t.Fatalf("restore whose undo point cannot be saved: %v", err)
	}
	if r.Phases.Undo != "none" {
		t.Errorf("undo = %q, want none", r.Phases.Undo)
	}
	if got := e.run("a", "cat", "/f"); got != "old" {
		t.Errorf("/f = %q after the restore, want old", got)
	}
	if got := e.run("a", "get", "v"); got != "old" {
		t.Errorf("v = %q after the restore, want old", got)
	}

	e.run("a", "write", "/f", "newer")
	e.run("a", "set", "v", "newer")
	e.b.Faults.FailCheckpoint.Store(true)
	e.b.Faults.FailRestore.Store(1)
	_, err = e.m.Restore(e.ctx, "a", c.ID, 0)
	e.b.Faults.FailCheckpoint.Store(false)
	if err == nil || !strings.Contains(err.Error(), "could not be saved") {
		t.Fatalf("failed restore without an undo point: %v, want it to say the state was not saved", err)
	}
	if sb, _ := e.m.Get("a"); !strings.Contains(sb.Note, "could not be undone") {
		t.Errorf("note after a failed restore without an undo point: %q", sb.Note)
	}
	e.restore("a", c.ID)
	if got := e.run("a", "cat", "/f"); got != "old" {
		t.Errorf("retry: /f = %q", got)
	}
}

func TestAsyncCheckpointOrderedBeforeLaterOps(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.run("a", "write", "/f", "at-turn")
	e.b.Faults.CheckpointDelay.Store(int64(50 * time.Millisecond))
	r := e.turn("a", state.ModeFull, false)
	if r.Status != state.CkptPending {
		t.Fatalf("turn must return before the checkpoint is done: %+v", r)
	}
	e.b.Faults.CheckpointDelay.Store(0)
	// This write is ordered after the pending checkpoint.
	e.run("a", "write", "/f", "after-turn")
	e.restore("a", r.ID)
	if got := e.run("a", "cat", "/f"); got != "at-turn" {
		t.Fatalf("checkpoint saw %q, want the state at the turn", got)
	}
	c, err := e.m.Wait(e.ctx, r.ID)
	if err != nil || !c.Durable || c.Status != state.CkptReady {
		t.Fatalf("wait: %+v %v", c, err)
	}
}

func TestFailedCheckpointLeavesTreeClean(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	c1 := e.turn("a", state.ModeFull, true)
	e.b.Faults.FailCheckpoint.Store(true)
	bad := e.turn("a", state.ModeFull, false)
	if _, err := e.m.Wait(e.ctx, bad.ID); err == nil {
		t.Fatal("wait on a failed checkpoint must fail")
	}
	e.b.Faults.FailCheckpoint.Store(false)
	c3 := e.turn("a", state.ModeFull, true)
	ck, _ := e.m.GetCheckpoint(c3.ID)
	if ck.Parent != c1.ID {
		t.Fatalf("parent of the next checkpoint = %s, want %s (the failed one is not in the tree)", ck.Parent, c1.ID)
	}
	if _, err := e.m.Restore(e.ctx, "a", bad.ID, 0); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("restore of a failed checkpoint: %v", err)
	}
}

func TestAutoMode(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "set", "x", "1")
	first := e.turn("a", state.ModeAuto, true)
	if first.Decision != state.ModeFull || first.Report == nil {
		t.Fatalf("first auto turn: %+v", first)
	}
	e.run("a", "echo", "read-only") // no effect
	skip := e.turn("a", state.ModeAuto, false)
	if skip.Decision != state.ModeSkip || skip.ID != first.ID {
		t.Fatalf("read-only turn: %+v", skip)
	}
	e.run("a", "write", "/f", "x")
	fsr := e.turn("a", state.ModeAuto, false)
	if fsr.Decision != state.ModeFS {
		t.Fatalf("file-writing turn: %+v", fsr)
	}
	e.run("a", "set", "x", "2")
	full := e.turn("a", state.ModeAuto, false)
	if full.Decision != state.ModeFull {
		t.Fatalf("process-changing turn: %+v", full)
	}

	// Without a probe, auto is full and says why.
	e2 := newEnv(t, false)
	e2.create("b")
	e2.turn("b", state.ModeFull, true)
	r := e2.turn("b", state.ModeAuto, false)
	if r.Decision != state.ModeFull || !strings.Contains(r.Reason, "no effect probe") {
		t.Fatalf("auto without probe: %+v", r)
	}
}

func TestFork(t *testing.T) {
	e := newEnv(t, false)
	e.create("src")
	e.run("src", "write", "/data", "shared")
	e.run("src", "set", "seed", "42")
	c := e.turn("src", state.ModeFull, false) // fork waits for it
	kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 3, Prefix: "r"})
	if err != nil {
		t.Fatal(err)
	}
	if len(kids) != 3 || kids[0].Name != "r1" || kids[2].Name != "r3" {
		t.Fatalf("children: %+v", kids)
	}
	for i, k := range kids {
		if got := strings.TrimSpace(e.run(k.Name, "cat", "/run/rewind/copy")); got != string(rune('1'+i)) {
			t.Errorf("%s copy number = %q", k.Name, got)
		}
		if got := e.run(k.Name, "cat", "/data"); got != "shared" {
			t.Errorf("%s /data = %q", k.Name, got)
		}
		if got := e.run(k.Name, "get", "seed"); got != "42" {
			t.Errorf("%s process state = %q", k.Name, got)
		}
		if k.Origin != c.ID || k.Head != c.ID {
			t.Errorf("%s origin/head: %+v", k.Name, k)
		}
	}
	// Isolation.
	e.run("r1", "write", "/data", "r1-only")
	if got := e.run("r2", "cat", "/data"); got != "shared" {
		t.Fatalf("r2 sees r1's write: %q", got)
	}
	if got := e.run("src", "cat", "/data"); got != "shared" {
		t.Fatalf("src sees r1's write: %q", got)
	}
	// A child's first checkpoint hangs under the fork point.
	k1 := e.turn("r1", state.ModeFS, true)
	ck, _ := e.m.GetCheckpoint(k1.ID)
	if ck.Parent != c.ID || ck.ProcFrom != c.ID {
		t.Fatalf("child checkpoint: %+v", ck)
	}
	// Restoring another sandbox's checkpoint is refused.
	if _, err := e.m.Restore(e.ctx, "r2", k1.ID, 0); !errors.Is(err, state.ErrBadRequest) || !strings.Contains(err.Error(), "sandbox r1") {
		t.Fatalf("restore of another sandbox's checkpoint: %v", err)
	}
	// So is a child's own origin, with a word on why.
	if _, err := e.m.Restore(e.ctx, "r2", c.ID, 0); !errors.Is(err, state.ErrBadRequest) || !strings.Contains(err.Error(), "origin") {
		t.Fatalf("restore of a fork child to its origin: %v", err)
	}
	// Names in use.
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "r"}); !errors.Is(err, state.ErrExists) {
		t.Fatalf("fork over existing names: %v", err)
	}
	// The default prefix numbers a fork's children after the last fork's.
	for _, want := range [][]string{{"src-1", "src-2"}, {"src-3", "src-4"}} {
		kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2})
		if err != nil {
			t.Fatalf("fork with the default prefix: %v", err)
		}
		if len(kids) != 2 || kids[0].Name != want[0] || kids[1].Name != want[1] {
			t.Fatalf("fork with the default prefix: %+v, want %v", kids, want)
		}
	}
	// All or nothing.
	e.b.Faults.FailStart.Store(true)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 4, Prefix: "bad"}); err == nil {
		t.Fatal("fork with failing starts succeeded")
	}
	e.b.Faults.FailStart.Store(false)
	for _, sb := range e.m.List() {
		if strings.HasPrefix(sb.Name, "bad") {
			t.Fatalf("a failed fork left %s behind", sb.Name)
		}
	}
}

// A fork child whose restore fails gets one more try when the failure may
// pass, none when its error says it is permanent; and the first child that
// fails for good fails the fork without the children not started yet.
func TestForkChildFailures(t *testing.T) {
	for _, tc := range []struct {
		name      string
		fails     int32
		permanent bool
		count     int
		wantErr   bool
		// restores attempted: at least, at most
		min, max int32
	}{
		{"transient failure retried", 1, false, 1, false, 2, 2},
		{"failing twice fails the fork", 2, false, 1, true, 2, 2},
		{"permanent failure not retried", 1, true, 1, true, 1, 1},
		// 4 children are made at a time: those under way when the first
		// fails may still try, the others never start.
		{"permanent failure stops the rest", 100, true, 12, true, 1, 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, false)
			e.create("src")
			e.run("src", "set", "x", "1")
			c := e.turn("src", state.ModeFull, false)
			e.b.Faults.RestoreFailsForGood.Store(tc.permanent)
			e.b.Faults.FailRestore.Store(tc.fails)
			e.b.Faults.Restores.Store(0)
			kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: tc.count, Prefix: "k"})
			if (err != nil) != tc.wantErr {
				t.Fatalf("fork: %v, want error %v", err, tc.wantErr)
			}
			if n := e.b.Faults.Restores.Load(); n < tc.min || n > tc.max {
				t.Errorf("%d restores attempted, want %d to %d", n, tc.min, tc.max)
			}
			if err != nil {
				if !strings.Contains(err.Error(), "injected") {
					t.Errorf("fork error %q does not name the child's failure", err)
				}
				for _, sb := range e.m.List() {
					if strings.HasPrefix(sb.Name, "k") {
						t.Errorf("a failed fork left %s behind", sb.Name)
					}
				}
				return
			}
			if got := e.run(kids[0].Name, "get", "x"); got != "1" {
				t.Errorf("child's x = %q", got)
			}
		})
	}
}

// A fork right after a turn, before the checkpoint's process image is
// written (its durable phase), waits for the image its children are
// restored from; with NoWait it is refused as not ready; and a checkpoint
// whose image could not be written cannot be forked, saying why.
func TestForkWaitsForImage(t *testing.T) {
	e := newEnv(t, false)
	e.create("src")
	e.run("src", "set", "x", "7")
	e.b.Faults.PersistDelay.Store(int64(300 * time.Millisecond))
	c := e.turn("src", state.ModeFull, false)
	for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(time.Millisecond) {
		ck, err := e.m.GetCheckpoint(c.ID)
		if err != nil {
			t.Fatal(err)
		}
		if ck.Status == state.CkptReady {
			if ck.Durable {
				t.Fatal("the image was written before the fork could try")
			}
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("checkpoint still %s", ck.Status)
		}
	}
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 1, Prefix: "n", NoWait: true}); !errors.Is(err, state.ErrNotReady) || !strings.Contains(err.Error(), "image") {
		t.Fatalf("no-wait fork of a ready checkpoint before its image: %v, want not ready", err)
	}
	kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "k"})
	if err != nil {
		t.Fatalf("fork before the image is written: %v", err)
	}
	for _, k := range kids {
		if got := e.run(k.Name, "get", "x"); got != "7" {
			t.Errorf("%s: x = %q", k.Name, got)
		}
	}

	e.b.Faults.PersistDelay.Store(0)
	e.b.Faults.FailPersist.Store(true)
	e.run("src", "set", "x", "8")
	c2 := e.turn("src", state.ModeFull, false)
	_, err = e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c2.ID, Count: 1, Prefix: "f"})
	if err == nil || !strings.Contains(err.Error(), "process image could not be written") {
		t.Fatalf("fork of a checkpoint without an image: %v", err)
	}
	// With NoWait too: that image will not come, retrying cannot help.
	_, err = e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c2.ID, Count: 1, Prefix: "g", NoWait: true})
	if err == nil || !strings.Contains(err.Error(), "process image could not be written") {
		t.Fatalf("fork with NoWait of a checkpoint without an image: %v", err)
	}
	// It still restores in its own sandbox (templates).
	e.run("src", "set", "x", "9")
	if _, err := e.m.Restore(e.ctx, "src", c2.ID, 0); err != nil {
		t.Fatal(err)
	}
	if got := e.run("src", "get", "x"); got != "8" {
		t.Errorf("x after the restore = %q", got)
	}
}

func TestForkNoWait(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.b.Faults.CheckpointDelay.Store(int64(200 * time.Millisecond))
	c := e.turn("a", state.ModeFull, false)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 1, NoWait: true}); !errors.Is(err, state.ErrNotReady) {
		t.Fatalf("fork --no-wait of a pending checkpoint: %v", err)
	}
	e.b.Faults.CheckpointDelay.Store(0)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 1}); err != nil {
		t.Fatalf("fork that waits: %v", err)
	}
}

func TestBadInput(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	cases := []struct {
		name string
		err  error
		want error
	}{
		{"dup create", func() error { _, err := e.m.Create(e.ctx, state.CreateRequest{Name: "a"}); return err }(), state.ErrExists},
		{"bad name", func() error { _, err := e.m.Create(e.ctx, state.CreateRequest{Name: "../x"}); return err }(), state.ErrBadRequest},
		{"bad fs", func() error { _, err := e.m.Create(e.ctx, state.CreateRequest{Name: "z", FS: "zfs"}); return err }(), state.ErrBadRequest},
		{"name of an id's form", func() error {
			_, err := e.m.Create(e.ctx, state.CreateRequest{Name: "sb-0123456789ab"})
			return err
		}(), state.ErrBadRequest},
		{"relative base", func() error {
			_, err := e.m.Create(e.ctx, state.CreateRequest{Name: "z", Bases: []string{"rel"}})
			return err
		}(), state.ErrBadRequest},
		{"unknown sandbox", func() error { _, err := e.m.Turn(e.ctx, "nope", state.TurnRequest{Mode: state.ModeFull}); return err }(), state.ErrNotFound},
		{"unknown checkpoint", func() error { _, err := e.m.Restore(e.ctx, "a", "ck-nope", 0); return err }(), state.ErrNotFound},
		{"unknown fork source", func() error {
			_, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: "ck-nope", Count: 1})
			return err
		}(), state.ErrNotFound},
		{"fork count", func() error { _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: "x", Count: 0}); return err }(), state.ErrBadRequest},
		{"pin unknown", e.m.Pin([]string{"ck-nope"}), state.ErrNotFound},
		{"unknown session", func() error {
			_, err := e.m.Send(e.ctx, "a", 0, state.SendRequest{Session: "nope", Text: "x"})
			return err
		}(), state.ErrNotFound},
		{"bad until", func() error {
			_, err := e.m.Send(e.ctx, "a", 0, state.SendRequest{Session: "s", Text: "x", Until: "("})
			return err
		}(), state.ErrBadRequest},
	}
	for _, tc := range cases {
		if !errors.Is(tc.err, tc.want) {
			t.Errorf("%s: err = %v, want code %s", tc.name, tc.err, state.CodeOf(tc.want))
		}
	}
}

func TestRemove(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	c := e.turn("a", state.ModeFull, false)
	if err := e.m.Pin([]string{c.ID}); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Remove(e.ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.Get("a"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("removed sandbox still there: %v", err)
	}
	// Pinned checkpoints of a removed sandbox stay usable by fork.
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 1, Prefix: "again"}); err != nil {
		t.Fatalf("fork from a removed sandbox's pinned checkpoint: %v", err)
	}
	e.create("a") // the name is free again
}

func TestSessions(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	id, err := e.m.StartSession(e.ctx, "a", 0, "sh", []string{"bash"}, nil)
	if err != nil || id != "sh" {
		t.Fatalf("session: %q %v", id, err)
	}
	if _, err := e.m.StartSession(e.ctx, "a", 0, "sh", []string{"bash"}, nil); !errors.Is(err, state.ErrExists) {
		t.Fatalf("duplicate session: %v", err)
	}
	if _, err := e.m.Send(e.ctx, "a", 0, state.SendRequest{Session: "sh", Text: "set cwd /work"}); err != nil {
		t.Fatal(err)
	}
	c := e.turn("a", state.ModeFull, false)
	e.m.Send(e.ctx, "a", 0, state.SendRequest{Session: "sh", Text: "set cwd /elsewhere"})
	e.restore("a", c.ID)
	out, err := e.m.Send(e.ctx, "a", 0, state.SendRequest{Session: "sh", Text: "get cwd"})
	if err != nil || out.Output != "/work\n" {
		t.Fatalf("session after restore: %q %v", out.Output, err)
	}
}

func TestCrashRecovery(t *testing.T) {
	for _, tc := range []struct {
		name     string
		boot     string
		wantNote string
	}{
		{"daemon killed", "boot-1", "daemon restarted"},
		{"host rebooted", "boot-2", "host rebooted"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newEnv(t, false)
			e.create("a")
			e.run("a", "write", "/f", "durable")
			e.run("a", "set", "v", "durable")
			durable := e.turn("a", state.ModeFull, true)
			if !durable.Durable {
				t.Fatalf("checkpoint not durable: %+v", durable)
			}
			e.run("a", "write", "/f", "fs-only")
			fsOnly := e.turn("a", state.ModeFS, true)
			e.b.Faults.FailPersist.Store(true)
			e.run("a", "set", "v", "template-only")
			tplOnly := e.turn("a", state.ModeFull, true)
			if tplOnly.Durable {
				t.Fatalf("checkpoint without images must not be durable")
			}
			e.b.Faults.FailPersist.Store(false)
			if err := e.m.Pin([]string{tplOnly.ID}); err != nil {
				t.Fatal(err)
			}
			e.m.CrashForTest()

			// A new daemon: same disk, templates gone with the old one.
			e.b = &statefake.Backends{Disk: e.b.Disk, Faults: e.b.Faults,
				FS: &statefake.FS{Disk: e.b.Disk, Faults: e.b.Faults}, Proc: &statefake.Proc{Disk: e.b.Disk, Faults: e.b.Faults}}
			e.open(false, tc.boot)
			sb, err := e.m.Get("a")
			if err != nil {
				t.Fatal(err)
			}
			if sb.Status != state.StatusStopped || !strings.Contains(sb.Note, tc.wantNote) || sb.Head != tplOnly.ID {
				t.Fatalf("after restart: %+v", sb)
			}
			if _, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"echo"}}); !errors.Is(err, state.ErrConflict) {
				t.Fatalf("exec in a stopped sandbox: %v", err)
			}
			for id, want := range map[string]bool{durable.ID: true, fsOnly.ID: true, tplOnly.ID: false} {
				c, err := e.m.GetCheckpoint(id)
				if err != nil {
					t.Fatalf("checkpoint %s lost: %v", id, err)
				}
				if c.Restorable != want {
					t.Errorf("checkpoint %s (%s) restorable = %v, want %v", id, c.Decision, c.Restorable, want)
				}
			}
			if got := e.m.Pins(); len(got) != 1 || got[0] != tplOnly.ID {
				t.Errorf("pins after restart: %v", got)
			}
			if _, err := e.m.Restore(e.ctx, "a", tplOnly.ID, 0); !errors.Is(err, state.ErrNotReady) {
				t.Fatalf("restore of a template-only checkpoint after restart: %v", err)
			}
			r := e.restore("a", fsOnly.ID)
			if r.Path != "criu" {
				t.Errorf("restore path after restart = %q, want criu", r.Path)
			}
			if got := e.run("a", "cat", "/f"); got != "fs-only" {
				t.Errorf("/f = %q", got)
			}
			if got := e.run("a", "get", "v"); got != "durable" {
				t.Errorf("v = %q", got)
			}
			// Life goes on: a new turn on the restarted sandbox.
			e.run("a", "write", "/f", "after")
			n := e.turn("a", state.ModeFS, true)
			ck, _ := e.m.GetCheckpoint(n.ID)
			if ck.Parent != fsOnly.ID || ck.ProcFrom != durable.ID {
				t.Errorf("checkpoint after restart: %+v", ck)
			}
		})
	}
}

// TestRestoreFromCleanHead: right after a turn nothing changed, so the
// head is the undo point (no extra checkpoint is taken); a failing restore
// still leaves the sandbox exactly at its head.
func TestRestoreFromCleanHead(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "write", "/f", "one")
	e.run("a", "set", "v", "one")
	c1 := e.turn("a", state.ModeFull, true)
	e.run("a", "write", "/f", "two")
	e.run("a", "set", "v", "two")
	c2 := e.turn("a", state.ModeFull, true)

	layers := e.b.Disk.Layers()
	e.restore("a", c1.ID) // clean: c2 is the current state
	if got := e.b.Disk.Layers(); got != layers {
		t.Fatalf("a restore from a clean head took %d extra fs checkpoints", got-layers)
	}
	e.b.Faults.FailRestore.Store(1)
	if _, err := e.m.Restore(e.ctx, "a", c2.ID, 0); err == nil {
		t.Fatal("restore with an injected failure succeeded")
	}
	if got := e.run("a", "cat", "/f") + " " + e.run("a", "get", "v"); got != "one one" {
		t.Fatalf("after a failed restore from a clean head: %q, want the head's state", got)
	}
	// Dirty: an operation since the head forces a real undo point.
	e.run("a", "write", "/f", "dirty")
	layers = e.b.Disk.Layers()
	e.restore("a", c2.ID)
	if got := e.b.Disk.Layers(); got != layers+1 {
		t.Fatalf("a restore of a dirty sandbox took %d fs checkpoints, want 1 (the undo point)", got-layers)
	}
	if got := e.run("a", "cat", "/f"); got != "two" {
		t.Fatalf("/f = %q", got)
	}
}

// TestRestoreKeepsProcessesOfSharedPart: when the target shares its process
// part with a clean head, a restore only switches the fs and leaves the
// processes (and their state) alone.
func TestRestoreKeepsProcessesOfSharedPart(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "write", "/f", "one")
	e.run("a", "set", "v", "one")
	c1 := e.turn("a", state.ModeFull, true)
	e.run("a", "write", "/f", "two")
	c2 := e.turn("a", state.ModeFS, true)
	if r := e.restore("a", c1.ID); r.Path != "fs" || r.Phases.Undo != "head" {
		t.Fatalf("restore of a checkpoint sharing the clean head's processes: path %s, undo %s", r.Path, r.Phases.Undo)
	}
	if got := e.run("a", "cat", "/f") + " " + e.run("a", "get", "v"); got != "one one" {
		t.Fatalf("after the restore: %q", got)
	}
	// Not clean (an operation ran): the regular path, with an undo point.
	e.run("a", "set", "v", "changed")
	if r := e.restore("a", c2.ID); r.Path == "fs" || r.Phases.Undo != "checkpoint" {
		t.Fatalf("restore of a dirty sandbox: path %s, undo %s", r.Path, r.Phases.Undo)
	}
	if got := e.run("a", "cat", "/f") + " " + e.run("a", "get", "v"); got != "two one" {
		t.Fatalf("after the second restore: %q", got)
	}
}

// TestEpochsAfterLostRestoreRecords: restores write their record in the
// background; a crash that loses those writes must still never let an
// epoch handed out before it be accepted after it.
func TestEpochsAfterLostRestoreRecords(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	c := e.turn("a", state.ModeFull, true)
	first := e.restore("a", c.ID)
	old, err := e.m.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	last := first.Epoch
	for i := 0; i < 5; i++ {
		last = e.restore("a", c.ID).Epoch
	}
	// The store as a crash right after the first restore's write leaves it.
	if err := e.m.StoreSandboxForTest(old); err != nil {
		t.Fatal(err)
	}
	e.m.CrashForTest()
	e.open(false, "boot-1")
	sb, err := e.m.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if sb.Epoch <= last {
		t.Fatalf("epoch after recovery %d, but %d was handed out before the crash", sb.Epoch, last)
	}
	r := e.restore("a", c.ID)
	if r.Epoch <= sb.Epoch {
		t.Fatalf("restore after recovery: epoch %d", r.Epoch)
	}
	if _, err := e.m.Exec(e.ctx, "a", last, state.ExecRequest{Argv: []string{"echo"}}); !errors.Is(err, state.ErrStaleEpoch) {
		t.Fatalf("an epoch from before the crash: %v", err)
	}
}

// TestRestoreAfterProcessesDiverged: an fs-only turn that keeps an earlier
// process part although the processes changed (a requested mode here; a
// policy that ignores processes likewise) leaves the live processes unlike
// the head's part: a later restore must recreate the processes, not only
// switch the fs.
func TestRestoreAfterProcessesDiverged(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "set", "v", "one")
	c1 := e.turn("a", state.ModeFull, true)
	e.run("a", "set", "v", "two")
	e.run("a", "write", "/f", "two")
	e.turn("a", state.ModeFS, true) // shares c1's processes: v=one
	if r := e.restore("a", c1.ID); r.Path == "fs" {
		t.Fatalf("restore after a turn that kept c1's processes despite a change: path fs")
	}
	if got := e.run("a", "get", "v"); got != "one" {
		t.Fatalf("v = %q after restoring c1", got)
	}
}

// TestDeferredTurn: a deferred turn answers with a new id at once; the
// checkpoint closes the window and decides, before any later operation.
func TestDeferredTurn(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "set", "v", "one")
	first := e.turn("a", state.ModeAuto, true)
	deferred := func() *state.Checkpoint {
		t.Helper()
		r, err := e.m.Turn(e.ctx, "a", state.TurnRequest{Mode: state.ModeAuto, Defer: true})
		if err != nil {
			t.Fatal(err)
		}
		if r.Decision != state.ModeAuto || r.ID == "" {
			t.Fatalf("deferred turn answered %+v", r)
		}
		c, err := e.m.Wait(e.ctx, r.ID)
		if err != nil {
			t.Fatal(err)
		}
		return c
	}
	e.run("a", "write", "/f", "two")
	files := deferred()
	if files.Decision != state.ModeFS || files.Parent != first.ID || files.ProcFrom != first.ID {
		t.Fatalf("files only: %+v", files)
	}
	nothing := deferred()
	if nothing.Decision != state.ModeFS || nothing.Decided != state.ModeSkip || nothing.Parent != files.ID {
		t.Fatalf("nothing changed: %+v", nothing)
	}
	if files.Decided != "" {
		t.Fatalf("files only: decided %q", files.Decided)
	}
	e.run("a", "set", "v", "three")
	procs := deferred()
	if procs.Decision != state.ModeFull || procs.ProcFrom != procs.ID {
		t.Fatalf("process change: %+v", procs)
	}
	e.restore("a", files.ID)
	if got := e.run("a", "cat", "/f") + " " + e.run("a", "get", "v"); got != "two one" {
		t.Fatalf("after restoring the deferred fs checkpoint: %q", got)
	}
	rs, err := e.m.Reports(e.ctx, "a", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if n := len(rs.Reports); n != 4 || rs.Reports[3].Applied != state.ModeFull || rs.Reports[1].Applied != state.ModeFS {
		t.Fatalf("turn reports: %+v", rs.Reports)
	}
}

// TestDeferredTurnHold: a deferred turn's checkpoint waits for its Hold
// to close, and an operation sent meanwhile still waits for the checkpoint:
// the checkpoint has the state of the turn, not the operation's.
func TestDeferredTurnHold(t *testing.T) {
	e := newEnv(t, true)
	e.m.SetHoldMaxForTest(time.Hour)
	e.create("a")
	e.run("a", "write", "/f", "one")
	e.turn("a", state.ModeAuto, true)
	e.run("a", "write", "/f", "two")
	hold := make(chan struct{})
	r, err := e.m.Turn(e.ctx, "a", state.TurnRequest{Mode: state.ModeAuto, Defer: true, Hold: hold})
	if err != nil {
		t.Fatal(err)
	}
	wctx, cancel := context.WithTimeout(e.ctx, 50*time.Millisecond)
	_, err = e.m.Wait(wctx, r.ID)
	cancel()
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("the held checkpoint did not wait for its hold: %v", err)
	}
	wrote := make(chan string, 1)
	go func() {
		var out bytes.Buffer
		_, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"write", "/f", "three"}, Stdout: &out})
		wrote <- fmt.Sprint(err)
	}()
	select {
	case w := <-wrote:
		t.Fatalf("an operation ran before the held checkpoint: %s", w)
	case <-time.After(50 * time.Millisecond):
	}
	close(hold)
	if w := <-wrote; w != "<nil>" {
		t.Fatalf("write after the hold: %s", w)
	}
	c, err := e.m.Wait(e.ctx, r.ID)
	if err != nil {
		t.Fatal(err)
	}
	e.restore("a", c.ID)
	if got := e.run("a", "cat", "/f"); got != "two" {
		t.Fatalf("/f = %q after restoring the held checkpoint, want two", got)
	}
	// A turn that waits for its checkpoint is not held (its answer comes
	// after the checkpoint): it returns durable with the hold never closed.
	never := make(chan struct{})
	e.run("a", "write", "/f", "four")
	wr, err := e.m.Turn(e.ctx, "a", state.TurnRequest{Mode: state.ModeAuto, Defer: true, Wait: true, Hold: never})
	if err != nil || wr.Status != state.CkptReady {
		t.Fatalf("waited held turn: %+v %v", wr, err)
	}
}

// TestCrashRecoveryDropsLostFS: a checkpoint whose fs part did not survive
// the daemon (a kernel-path checkpoint's layer is written after the freeze
// window) is dropped when the store is opened again; the sandbox's head no
// longer names it and the earlier checkpoints stay restorable.
func TestCrashRecoveryDropsLostFS(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.run("a", "write", "/f", "kept")
	kept := e.turn("a", state.ModeFull, true)
	e.run("a", "write", "/f", "lost")
	lost := e.turn("a", state.ModeFS, true)
	c, err := e.m.GetCheckpoint(lost.ID)
	if err != nil || c.FS == "" {
		t.Fatalf("checkpoint %s: %+v %v", lost.ID, c, err)
	}
	e.m.CrashForTest()
	e.b.Disk.LoseCheckpoint(c.FS)

	e.b = &statefake.Backends{Disk: e.b.Disk, Faults: e.b.Faults,
		FS: &statefake.FS{Disk: e.b.Disk, Faults: e.b.Faults}, Proc: &statefake.Proc{Disk: e.b.Disk, Faults: e.b.Faults}}
	e.open(false, "boot-1")
	if _, err := e.m.GetCheckpoint(lost.ID); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("lost checkpoint after restart: %v", err)
	}
	if _, err := e.m.GetCheckpoint(kept.ID); err != nil {
		t.Fatalf("kept checkpoint after restart: %v", err)
	}
	sb, err := e.m.Get("a")
	if err != nil {
		t.Fatal(err)
	}
	if sb.Head == lost.ID {
		t.Fatalf("head is the lost checkpoint: %+v", sb)
	}
	e.restore("a", kept.ID)
	if got := e.run("a", "cat", "/f"); got != "kept" {
		t.Errorf("/f = %q after restoring the kept checkpoint", got)
	}
}

// TestNotDurableWhenFSUnwritten: a checkpoint whose fs part could not be
// written after its turn returned (FSWaiter) is never reported durable.
func TestNotDurableWhenFSUnwritten(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.run("a", "write", "/f", "x")
	if ok := e.turn("a", state.ModeFull, true); !ok.Durable {
		t.Fatalf("control checkpoint not durable: %+v", ok)
	}
	e.b.Faults.FailAwait.Store(true)
	e.run("a", "write", "/f", "y")
	if bad := e.turn("a", state.ModeFull, true); bad.Durable {
		t.Fatalf("checkpoint durable although its fs part was not written: %+v", bad)
	}
}

// writeUnseen writes a file into sandbox name's view that no operation
// made and no probe window sees (see statefake.Disk.WriteUnseen).
func (e *env) writeUnseen(name, path, data string) {
	e.t.Helper()
	sb, err := e.m.Get(name)
	if err != nil {
		e.t.Fatal(err)
	}
	if !e.b.Disk.WriteUnseen(sb.ID, path, data) {
		e.t.Fatalf("sandbox %s has no mount", name)
	}
}

// TestSkipRefusesUnseenWrite: an auto turn whose window saw nothing, while
// the writable layer holds a write no window reported (one made between
// windows), is not a skip: the head lacks that write. A write the policy
// chose to skip (seen, ignored) keeps later turns skipping until the next
// checkpoint.
func TestSkipRefusesUnseenWrite(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "set", "x", "1")
	first := e.turn("a", state.ModeAuto, true)
	e.run("a", "echo", "nothing")
	if r := e.turn("a", state.ModeAuto, true); r.Decision != state.ModeSkip || r.ID != first.ID {
		t.Fatalf("idle turn: %+v", r)
	}
	e.writeUnseen("a", "/late", "data")
	r := e.turn("a", state.ModeAuto, true)
	if r.Decision != state.ModeFS || r.ID == first.ID || !strings.Contains(r.Reason, "unseen") {
		t.Fatalf("turn after an unseen write: %+v", r)
	}
	// The write is in the turn's checkpoint, not in the earlier one.
	e.run("a", "write", "/late", "overwritten")
	e.turn("a", state.ModeAuto, true)
	e.restore("a", r.ID)
	if got := e.run("a", "cat", "/late"); got != "data" {
		t.Fatalf("/late after restoring the turn's checkpoint = %q", got)
	}
	e.restore("a", first.ID)
	if got, _ := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"cat", "/late"}}); got == 0 {
		t.Fatalf("/late exists in the checkpoint before the write")
	}
	// After a restore the writable layer is the checkpoint's: no unseen
	// write, the next idle turn skips.
	if r := e.turn("a", state.ModeAuto, true); r.Decision != state.ModeSkip {
		t.Fatalf("idle turn after a restore: %+v", r)
	}

	// A policy that skips seen file changes keeps skipping on them.
	if _, err := e.m.Create(e.ctx, state.CreateRequest{Name: "b", Policy: "ignore-fs"}); err != nil {
		t.Fatal(err)
	}
	e.run("b", "set", "x", "1")
	bf := e.turn("b", state.ModeAuto, true)
	e.run("b", "write", "/cache", "c1")
	if r := e.turn("b", state.ModeAuto, true); r.Decision != state.ModeSkip || r.ID != bf.ID {
		t.Fatalf("ignored write: %+v", r)
	}
	if r := e.turn("b", state.ModeAuto, true); r.Decision != state.ModeSkip || r.ID != bf.ID {
		t.Fatalf("idle turn after an ignored write: %+v", r)
	}
	// Until a checkpoint: then an unseen write is refused again.
	e.turn("b", state.ModeFS, true)
	e.writeUnseen("b", "/late", "x")
	if r := e.turn("b", state.ModeAuto, true); r.Decision != state.ModeFS {
		t.Fatalf("unseen write after a checkpoint: %+v", r)
	}
}

// TestRestoreUndoSeesUnseenWrite: a restore that fails goes back to where
// the sandbox was, including a write no window reported (its undo point is
// a checkpoint, not the head that lacks the write).
func TestRestoreUndoSeesUnseenWrite(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.run("a", "set", "x", "1")
	first := e.turn("a", state.ModeAuto, true)
	e.run("a", "set", "x", "2")
	if r := e.turn("a", state.ModeAuto, true); r.Decision != state.ModeFull {
		t.Fatalf("process-changing turn: %+v", r)
	}
	e.writeUnseen("a", "/late", "data")
	e.b.Faults.FailRestore.Store(1)
	if _, err := e.m.Restore(e.ctx, "a", first.ID, 0); err == nil {
		t.Fatal("restore with an injected failure succeeded")
	}
	if got := e.run("a", "get", "x"); got != "2" {
		t.Fatalf("x after the failed restore = %q", got)
	}
	if got := e.run("a", "cat", "/late"); got != "data" {
		t.Fatalf("/late after the failed restore = %q", got)
	}
}

// TestRestoreWaitsForLastUndoRelease: a restore's undo point is released
// after the restore returned, off the caller's path. Until then its
// processes (templates) hold their pids, and a process part restored from
// an image needs its exact pids: the next restore of the sandbox's
// processes waits for that release before it takes its own undo point.
func TestRestoreWaitsForLastUndoRelease(t *testing.T) {
	for _, exact := range []bool{true, false} {
		t.Run(fmt.Sprintf("exact-pids=%v", exact), func(t *testing.T) { restoreAfterUndo(t, exact) })
	}
}

// restoreAfterUndo: with exact, the second restore needs exact pids and
// must come after the first undo point's release; without (a restore
// through templates, ExactPidsRestorer), it must not wait for it.
func restoreAfterUndo(t *testing.T, exact bool) {
	e := newEnv(t, false)
	e.b.Faults.TemplatesKeepNoPids.Store(!exact)
	e.create("a")
	e.run("a", "set", "x", "1")
	c1 := e.turn("a", state.ModeFull, true)
	e.run("a", "set", "x", "2")
	c2 := e.turn("a", state.ModeFull, true)
	e.b.Faults.ReleaseDelay.Store(int64(200 * time.Millisecond))
	e.run("a", "set", "x", "3")
	n := len(e.b.Proc.Events())
	e.restore("a", c1.ID)
	var undo1 string
	for _, ev := range e.b.Proc.Events()[n:] {
		if tpl, ok := strings.CutPrefix(ev, "checkpoint "); ok {
			undo1 = tpl
			break
		}
	}
	if undo1 == "" {
		t.Fatalf("the first restore took no undo point: %v", e.b.Proc.Events()[n:])
	}
	e.run("a", "set", "x", "4")
	e.restore("a", c2.ID)
	if got := e.run("a", "get", "x"); got != "2" {
		t.Fatalf("x = %q after the second restore", got)
	}
	evs := e.b.Proc.Events()[n:]
	released, undo2 := -1, -1
	for i, ev := range evs {
		if ev == "release "+undo1 {
			released = i
		}
		if tpl, ok := strings.CutPrefix(ev, "checkpoint "); ok && tpl != undo1 && undo2 < 0 {
			undo2 = i
		}
	}
	waited := released >= 0 && released < undo2
	if undo2 < 0 || waited != exact {
		t.Fatalf("the first undo point (%s) was released at event %d, the second restore's undo point taken at %d (the restore needs exact pids: %v): %v", undo1, released, undo2, exact, evs)
	}
}
