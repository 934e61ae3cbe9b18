package state_test

import (
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// TestClientMistakesAreBadRequests: what no sandbox could ever run or
// mount is the caller's mistake (400, bad_request), said as such, not a
// failure of the daemon (500, internal).
func TestClientMistakesAreBadRequests(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		call func() error
		want string
	}{
		{"base is a file", func() error {
			_, err := e.m.Create(e.ctx, state.CreateRequest{Name: "b1", Bases: []string{file}})
			return err
		}, "not a directory"},
		{"base is missing", func() error {
			_, err := e.m.Create(e.ctx, state.CreateRequest{Name: "b2", Bases: []string{file + ".none"}})
			return err
		}, "no such file"},
		{"relative policy module path", func() error {
			_, err := e.m.Create(e.ctx, state.CreateRequest{Name: "b3", Policy: "pol/skip.wasm"})
			return err
		}, "not absolute"},
		{"policy module in the daemon's cwd", func() error {
			_, err := e.m.Create(e.ctx, state.CreateRequest{Name: "b4", Policy: "skip.wasm"})
			return err
		}, "not absolute"},
		{"fork prefix ending with a digit", func() error {
			c := e.turn("a", state.ModeFull, true)
			_, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "p-1"})
			return err
		}, "ends with a digit"},
		{"exec in a relative dir", func() error {
			_, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"echo"}, Dir: "tmp"})
			return err
		}, "not an absolute path"},
		{"env entry without =", func() error {
			_, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"echo"}, Env: []string{"NOEQUALS"}})
			return err
		}, "not NAME=VALUE"},
		{"env entry with a NUL", func() error {
			_, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"echo"}, Env: []string{"A=b\x00c"}})
			return err
		}, "not NAME=VALUE"},
		{"env entry with an empty name", func() error {
			_, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"echo"}, Env: []string{"=x"}})
			return err
		}, "not NAME=VALUE"},
		{"argument with a NUL", func() error {
			_, err := e.m.Exec(e.ctx, "a", 0, state.ExecRequest{Argv: []string{"ec\x00ho"}})
			return err
		}, "NUL"},
		{"session argument with a NUL", func() error {
			_, err := e.m.StartSession(e.ctx, "a", 0, "s1", []string{"ba\x00sh"}, nil)
			return err
		}, "NUL"},
		{"session env without =", func() error {
			_, err := e.m.StartSession(e.ctx, "a", 0, "s2", []string{"bash"}, []string{"X"})
			return err
		}, "not NAME=VALUE"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.call()
			if !errors.Is(err, state.ErrBadRequest) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v (code %s), want bad_request saying %q", err, state.CodeOf(err), tc.want)
			}
		})
	}
	// What is fine still runs.
	if got := e.run("a", "echo", "ok"); !strings.Contains(got, "ok") {
		t.Errorf("a plain exec after the refusals: %q", got)
	}
}

// TestRestartNoteWithoutCheckpoint: after a restart, a sandbox with a
// checkpoint of its own is told to restore one; one without (created and
// never checkpointed) is told to go and be made again, since no restore
// can bring it back.
func TestRestartNoteWithoutCheckpoint(t *testing.T) {
	e := newEnv(t, false)
	e.create("with")
	e.turn("with", state.ModeFull, true)
	e.create("without")
	e.m.CrashForTest()
	e.b = &statefake.Backends{Disk: e.b.Disk, Faults: e.b.Faults,
		FS: &statefake.FS{Disk: e.b.Disk, Faults: e.b.Faults}, Proc: &statefake.Proc{Disk: e.b.Disk, Faults: e.b.Faults}}
	e.open(false, "boot-1")
	for name, want := range map[string]string{
		"with":    "restore a checkpoint to bring it back",
		"without": "no checkpoint of its own",
	} {
		sb, err := e.m.Get(name)
		if err != nil {
			t.Fatal(err)
		}
		if sb.Status != state.StatusStopped || !strings.Contains(sb.Note, want) {
			t.Errorf("%s after a restart: status %s, note %q; want it to say %q", name, sb.Status, sb.Note, want)
		}
	}
}

// TestAutoTurnAfterFailedCheckpoint: when an auto turn's checkpoint fails,
// what that turn did is in no checkpoint, while the probe window it
// consumed is gone. The next auto turn, whose own window shows nothing,
// must take a full checkpoint (saying why) rather than skip to the parent,
// which lacks the changes; once one succeeds, idle turns skip again.
func TestAutoTurnAfterFailedCheckpoint(t *testing.T) {
	e := newEnv(t, true)
	e.create("a")
	e.turn("a", state.ModeFull, true)
	e.run("a", "write", "/f", "new")
	e.run("a", "set", "v", "new")
	e.b.Faults.FailCheckpoint.Store(true)
	r, err := e.m.Turn(e.ctx, "a", state.TurnRequest{Mode: state.ModeAuto, Wait: true})
	e.b.Faults.FailCheckpoint.Store(false)
	if err == nil && r.Status != state.CkptFailed {
		t.Fatalf("turn with an injected failure: %+v", r)
	}
	next := e.turn("a", state.ModeAuto, true)
	if next.Decision != state.ModeFull || !strings.Contains(next.Reason, "last checkpoint failed") {
		t.Fatalf("turn after a failed checkpoint: %s (%s), want full saying why", next.Decision, next.Reason)
	}
	e.run("a", "write", "/f", "newer")
	e.run("a", "set", "v", "newer")
	e.restore("a", next.ID)
	if got := e.run("a", "cat", "/f"); got != "new" {
		t.Errorf("restore of the turn after the failure: /f = %q, want new", got)
	}
	if got := e.run("a", "get", "v"); got != "new" {
		t.Errorf("restore of the turn after the failure: v = %q, want new", got)
	}
	if idle := e.turn("a", state.ModeAuto, true); idle.Decision == state.ModeFull {
		t.Errorf("an idle turn once a checkpoint succeeded again: %s (%s)", idle.Decision, idle.Reason)
	}
}
