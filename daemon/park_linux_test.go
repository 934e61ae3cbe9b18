package daemon

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/sandbox"
	"github.com/rewind-sandbox/rewind/state"
)

// parkSandbox is a real sandbox (minimal root) with a persistent bash
// session "sh", driven through the daemon's process adapter.
func parkSandbox(t testing.TB) (*procSandbox, func(cmd string) string) {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat(filepath.Dir(sandbox.DefaultFreezerParent))
	testenv.Require(t, err == nil, "cgroup v1 freezer")
	log := slog.New(slog.NewTextHandler(os.Stderr, &slog.HandlerOptions{Level: slog.LevelWarn}))
	eng, err := cr.New(cr.Config{ImagesDir: t.TempDir(), Warm: true, Logger: log})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { eng.Close() })
	root := t.TempDir()
	binds, err := sandbox.MinimalRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	ctx := context.Background()
	sb, err := sandbox.Start(ctx, sandbox.Config{ID: fmt.Sprintf("parktest-%d-%d", os.Getpid(), time.Now().UnixNano()%1e6), Root: root, Binds: binds})
	if err != nil {
		t.Fatal(err)
	}
	ps := &procSandbox{b: &procBackend{eng: eng, log: log}, sb: sb, ckpts: map[string]bool{}}
	t.Cleanup(func() {
		eng.DropSandbox(sb.ID())
		if err := ps.Close(); err != nil {
			t.Errorf("close: %v", err)
		}
	})
	if err := ps.StartSession(ctx, "sh", []string{"bash", "--norc", "--noprofile"}, nil); err != nil {
		t.Fatal(err)
	}
	send := func(cmd string) string {
		t.Helper()
		out, err := ps.Send(ctx, state.SendRequest{Session: "sh", Text: cmd + "; echo @@done@@", Until: "@@done@@", Timeout: 30 * time.Second})
		if err != nil {
			t.Fatalf("send %q: %v (%q)", cmd, err, out.Output)
		}
		return strings.TrimSpace(strings.ReplaceAll(out.Output, "@@done@@", ""))
	}
	return ps, send
}

// TestUndoPointParksAProcessTree: the undo point of a restore to a
// template checkpoint keeps a shell with a background job (a tree no
// template fork copies) as it is, stopped; restoring the undo point, as a
// failed restore does, lets the same processes run on with the session,
// whether the failed restore gave the session to another process or not;
// releasing it kills them.
func TestUndoPointParksAProcessTree(t *testing.T) {
	ps, send := parkSandbox(t)
	ctx := context.Background()
	send("export V=1")
	target, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if target.Data["mode"] != string(cr.ModeTemplate) {
		t.Fatalf("checkpoint of a lone shell: mode %s", target.Data["mode"])
	}
	send("export V=2; sleep 1000 & BG=$!")
	before := send(`echo "$V $$ $BG $(jobs -p | wc -l)"`)

	for _, replaced := range []bool{false, true} {
		barrier := 0
		undo, err := ps.CheckpointUndo(ctx, target, func() error { barrier++; return nil })
		if err != nil {
			t.Fatal(err)
		}
		if undo.Data["mode"] != string(cr.ModeParked) || undo.Processes != 2 || barrier != 1 {
			t.Fatalf("undo point: mode %s, %d processes, barrier ran %d times", undo.Data["mode"], undo.Processes, barrier)
		}
		if replaced {
			// The restore itself went through: the target's copy has the
			// session now (what a failure after that step would leave).
			if path, err := ps.Restore(ctx, target, func() error { return nil }); err != nil || path != "template" {
				t.Fatalf("restore of the target: %s %v", path, err)
			}
			if got := send(`echo "$V $(jobs -p | wc -l)"`); got != "1 0" {
				t.Fatalf("target restored: %q", got)
			}
		}
		switched := false
		if _, err := ps.Restore(ctx, undo, func() error { switched = true; return nil }); err != nil {
			t.Fatalf("restore of the undo point (replaced=%v): %v", replaced, err)
		}
		if !switched {
			t.Fatal("the undo restore did not switch the fs")
		}
		if got := send(`echo "$V $$ $BG $(jobs -p | wc -l)"`); got != before {
			t.Fatalf("after the undo restore (replaced=%v): %q, want %q (the same shell and job)", replaced, got, before)
		}
		ps.b.Release(ctx, undo) // restored: releasing kills nothing
		if got := send(`kill -0 $BG && echo "$V"`); got != "2" {
			t.Fatalf("after releasing the restored undo point: %q", got)
		}
	}

	undo, err := ps.CheckpointUndo(ctx, target, nil)
	if err != nil || undo.Data["mode"] != string(cr.ModeParked) {
		t.Fatalf("park: %+v %v", undo, err)
	}
	if path, err := ps.Restore(ctx, target, func() error { return nil }); err != nil || path != "template" {
		t.Fatalf("restore of the target: %s %v", path, err)
	}
	rec, err := ps.b.eng.Record(undo.Data["cr"])
	if err != nil {
		t.Fatal(err)
	}
	ps.b.Release(ctx, undo)
	for _, p := range rec.Procs {
		deadline := time.Now().Add(10 * time.Second)
		for {
			st, err := procStateOf(p.PID)
			if err != nil || st == 'Z' || st == 'X' {
				break
			}
			if time.Now().After(deadline) {
				t.Fatalf("parked process %d (%s) survived the release (state %c)", p.PID, p.Comm, st)
			}
			time.Sleep(time.Millisecond)
		}
	}
	if got := send(`echo "$V $(jobs -p | wc -l)"`); got != "1 0" {
		t.Fatalf("the target's shell after the release: %q", got)
	}
}

// TestUndoPointBeforeCRIURestoreIsACopy: a restore to a CRIU checkpoint
// needs the exact pids the live processes may hold, so its undo point is
// not parked.
func TestUndoPointBeforeCRIURestoreIsACopy(t *testing.T) {
	_, err := criu.Find("")
	testenv.RequireNoErr(t, err, "criu")
	ps, send := parkSandbox(t)
	ctx := context.Background()
	send("sleep 1000 & true")
	tree, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tree.Data["mode"] != string(cr.ModeCRIU) {
		t.Fatalf("checkpoint of a tree: mode %s", tree.Data["mode"])
	}
	if ps.canPark(tree) {
		t.Fatal("canPark says yes before a CRIU restore")
	}
	undo, err := ps.CheckpointUndo(ctx, tree, nil)
	if err != nil {
		t.Fatal(err)
	}
	defer ps.b.Release(ctx, undo)
	if undo.Data["mode"] == string(cr.ModeParked) {
		t.Fatal("the undo point of a restore to a CRIU checkpoint is parked")
	}
}

// TestUndoPointBeforeCRIURestoreParksWhenPidsAreFree: once the sandbox
// runs other processes than the ones a CRIU checkpoint holds (a later
// branch, restored from a template), no live pid is one the image needs,
// so the undo point of a restore to it is the live tree parked, not a CRIU
// dump; the CRIU restore still gets its exact pids, and the parked tree
// comes back whole when the undo point is restored.
func TestUndoPointBeforeCRIURestoreParksWhenPidsAreFree(t *testing.T) {
	_, err := criu.Find("")
	testenv.RequireNoErr(t, err, "criu")
	ps, send := parkSandbox(t)
	ctx := context.Background()
	noop := func() error { return nil }
	send("export V=0")
	lone, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	send("export V=1; sleep 1000 & BG=$!")
	tree, err := ps.Checkpoint(ctx, nil)
	if err != nil {
		t.Fatal(err)
	}
	if tree.Data["mode"] != string(cr.ModeCRIU) {
		t.Fatalf("checkpoint of a tree: mode %s", tree.Data["mode"])
	}
	inTree := send(`echo "$V $$ $BG $(jobs -p | wc -l)"`)
	if ps.canPark(tree) {
		t.Fatal("canPark says yes while the tree's own processes hold its pids")
	}

	if path, err := ps.Restore(ctx, lone, noop); err != nil || path != "template" {
		t.Fatalf("restore of the lone shell: %s %v", path, err)
	}
	send("export V=2; sleep 1000 & BG=$!")
	later := send(`echo "$V $$ $BG $(jobs -p | wc -l)"`)
	// The tree's processes were killed; their pids free once reaped.
	deadline := time.Now().Add(10 * time.Second)
	for !ps.canPark(tree) {
		if time.Now().After(deadline) {
			t.Fatalf("canPark stays false for a CRIU checkpoint whose pids nobody holds (live: %q, tree: %q)", later, inTree)
		}
		time.Sleep(5 * time.Millisecond)
	}
	undo, err := ps.CheckpointUndo(ctx, tree, nil)
	if err != nil {
		t.Fatal(err)
	}
	if undo.Data["mode"] != string(cr.ModeParked) || undo.Processes != 2 {
		t.Fatalf("undo point: mode %s, %d processes", undo.Data["mode"], undo.Processes)
	}
	path, err := ps.Restore(ctx, tree, noop)
	if err != nil || path != "criu" {
		t.Fatalf("restore of the tree beside the parked one: %s %v", path, err)
	}
	if got := send(`echo "$V $$ $BG $(jobs -p | wc -l)"`); got != inTree {
		t.Fatalf("after the CRIU restore: %q, want %q (the same pids, variable and job)", got, inTree)
	}
	// As after a restore that failed past its CRIU step: back to the
	// undo point, the parked tree runs on.
	if _, err := ps.Restore(ctx, undo, noop); err != nil {
		t.Fatalf("restore of the parked undo point: %v", err)
	}
	if got := send(`echo "$V $$ $BG $(jobs -p | wc -l)"`); got != later {
		t.Fatalf("after the undo restore: %q, want %q (the parked shell and job)", got, later)
	}
	ps.b.Release(ctx, undo)
	if got := send(`kill -0 $BG && echo "$V"`); got != "2" {
		t.Fatalf("after releasing the restored undo point: %q", got)
	}
}
