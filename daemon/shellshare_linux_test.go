package daemon_test

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"strconv"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/state"
)

// turn ends a turn in auto mode and returns the checkpoint it answered with
// and what that checkpoint really was once taken (a full decision becomes
// fs when the shell provably did not change).
func turn(t *testing.T, c *client.Client, name string) (string, *state.Checkpoint) {
	t.Helper()
	ctx := context.Background()
	res, err := c.Turn(ctx, name, api.TurnRequest{Mode: "auto"})
	if err != nil {
		t.Fatal(err)
	}
	ck, err := c.Wait(ctx, res.ID)
	if err != nil {
		t.Fatal(err)
	}
	if res.Decision == state.ModeSkip {
		return res.ID, &state.Checkpoint{ID: res.ID, Decision: state.ModeSkip}
	}
	return res.ID, ck
}

// shellSandbox creates sandbox "sh" under the effects policy with a
// persistent bash as session "b" (env added to PS1=), and returns a
// function that runs one command line in it and returns its output.
func shellSandbox(t *testing.T, c *client.Client, env ...string) func(cmd string) string {
	t.Helper()
	bashSandbox(t, c, api.CreateRequest{Name: "sh", Policy: "effects"}, env...)
	return func(cmd string) string { return send(t, c, "sh", "b", cmd+"\necho @@done@@") }
}

// bashSandbox creates sandbox req with a persistent bash as session "b"
// (env added to PS1=).
func bashSandbox(t *testing.T, c *client.Client, req api.CreateRequest, env ...string) {
	t.Helper()
	ctx := context.Background()
	if _, err := c.Create(ctx, req); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, req.Name, api.SessionRequest{ID: "b", Argv: []string{"bash", "--noprofile", "--norc"}, Env: append([]string{"PS1="}, env...)}); err != nil {
		t.Fatal(err)
	}
}

// TestRealUnchangedShellSharesItsProcessPart drives a persistent bash in a
// real sandbox under the effects policy: bash writes its own memory on
// every command, yet a command that leaves its state alone (true, ls) must
// not cost a new process checkpoint, while one that changes it (X=1, cd)
// must; and restoring each checkpoint must bring back the shell's state.
func TestRealUnchangedShellSharesItsProcessPart(t *testing.T) {
	d := startRealWith(t, t.TempDir(), func(cfg *daemon.Config) {
		cfg.Logger = slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelDebug}))
	})
	c, ctx := d.c, context.Background()
	run := shellSandbox(t, c)
	run("mkdir -p /w && cd /w && X=0")
	_, base := turn(t, c, "sh")
	if base.Decision != state.ModeFull {
		t.Fatalf("first turn: %s (%s), want full", base.Decision, base.Reason)
	}

	run("true")
	_, ckTrue := turn(t, c, "sh")
	run("ls / >/dev/null")
	_, ckLs := turn(t, c, "sh")
	for name, ck := range map[string]*state.Checkpoint{"true": ckTrue, "ls": ckLs} {
		if ck.Decision == state.ModeFull {
			t.Fatalf("%s: a full checkpoint (%s); the shell did not change", name, ck.Reason)
		}
		if ck.Decision == state.ModeFS && ck.ProcFrom != base.ID {
			t.Fatalf("%s: fs checkpoint shares the processes of %s, want %s", name, ck.ProcFrom, base.ID)
		}
	}

	// The same with the decision deferred to the checkpoint.
	run("pwd")
	dres, err := c.Turn(ctx, "sh", api.TurnRequest{Mode: "auto", Defer: true})
	if err != nil {
		t.Fatal(err)
	}
	ckPwd, err := c.Wait(ctx, dres.ID)
	if err != nil {
		t.Fatal(err)
	}
	if dres.Decision != state.ModeAuto || ckPwd.Decision != state.ModeFS || ckPwd.ProcFrom != base.ID {
		t.Fatalf("deferred pwd: answered %s, took %s from %s (%s); want auto, fs from %s", dres.Decision, ckPwd.Decision, ckPwd.ProcFrom, ckPwd.Reason, base.ID)
	}
	// The policy skipped it (on the report without the shell's memory
	// writes): the record says so, for a decision mix.
	if ckPwd.Decided != state.ModeSkip {
		t.Fatalf("deferred pwd: decided %q, want skip (%s)", ckPwd.Decided, ckPwd.Reason)
	}

	run("X=1")
	_, ckX := turn(t, c, "sh")
	if ckX.Decision != state.ModeFull || ckX.ProcFrom != ckX.ID {
		t.Fatalf("X=1: %s from %s (%s), want a full checkpoint of its own", ckX.Decision, ckX.ProcFrom, ckX.Reason)
	}
	run("echo data > /w/f")
	_, ckFile := turn(t, c, "sh")
	if ckFile.Decision != state.ModeFS || ckFile.ProcFrom != ckX.ID {
		t.Fatalf("file write: %s from %s (%s), want fs sharing %s", ckFile.Decision, ckFile.ProcFrom, ckFile.Reason, ckX.ID)
	}
	if ckFile.Decided != "" {
		t.Fatalf("file write: decided %q, want none (an fs checkpoint as decided)", ckFile.Decided)
	}
	run("cd /tmp")
	_, ckCd := turn(t, c, "sh")
	if ckCd.Decision != state.ModeFull {
		t.Fatalf("cd: %s (%s), want full", ckCd.Decision, ckCd.Reason)
	}

	// Right after a turn or a restore nothing has run: restoring the
	// checkpoint just taken or restored, or one that shares its process
	// part, only switches the fs, with the head as the undo point.
	// (The probe counts a process that merely ran as having written
	// memory: should the shell be scheduled once more after a window
	// opened, the head is not provably clean and the regular path is
	// right. A second restore right after then finds it clean.)
	fsOnly := func(ck string) {
		t.Helper()
		var res *api.RestoreResult
		for try := 0; try < 3; try++ {
			var err error
			if res, err = c.Restore(ctx, "sh", ck, 0); err != nil {
				t.Fatalf("restore %s: %v", ck, err)
			}
			if res.Path == "fs" && res.Phases.Undo == "head" {
				return
			}
		}
		t.Fatalf("restore %s: path %s, undo %s; want fs, head", ck, res.Path, res.Phases.Undo)
	}
	shellState := func() string { return run(`echo "$X $PWD $(cat /w/f 2>/dev/null)"`) }
	fsOnly(ckCd.ID)
	for _, tc := range []struct {
		ck   string
		want string
	}{
		{ckTrue.ID, "0 /w"},
		{ckFile.ID, "1 /w data"},
		{ckLs.ID, "0 /w"},
		{ckCd.ID, "1 /tmp data"},
		{ckFile.ID, "1 /w data"},
	} {
		if _, err := c.Restore(ctx, "sh", tc.ck, 0); err != nil {
			t.Fatalf("restore %s: %v", tc.ck, err)
		}
		fsOnly(tc.ck) // right after a restore, nothing ran either
		if got := shellState(); got != tc.want {
			t.Fatalf("after restoring %s: %q, want %q", tc.ck, got, tc.want)
		}
	}
	run("echo more >> /w/f")
	_, ckMore := turn(t, c, "sh")
	if ckMore.Decision != state.ModeFS {
		t.Fatalf("append: %s (%s), want fs", ckMore.Decision, ckMore.Reason)
	}
	fsOnly(ckFile.ID) // a sibling's checkpoint with the same processes
	if got := shellState(); got != "1 /w data" {
		t.Fatalf("after restoring %s: %q", ckFile.ID, got)
	}
	run("echo data > /w/f")
	if got := shellState(); got != "1 /w data" {
		t.Fatalf("at the end: %q", got)
	}
}

// TestRealFSRestoresChain: a restore that only switches the fs leaves the
// sandbox exactly its new head, so the next restore to a checkpoint with
// the same processes is fs-only again with the head as its undo point —
// every time, not only on a retry — and each brings back its files.
func TestRealFSRestoresChain(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	run := shellSandbox(t, c)
	run("mkdir -p /w && cd /w")
	turn(t, c, "sh")
	run("echo one > /w/f")
	_, one := turn(t, c, "sh")
	run("echo two > /w/f")
	_, two := turn(t, c, "sh")
	if one.Decision != state.ModeFS || two.Decision != state.ModeFS || one.ProcFrom != two.ProcFrom {
		t.Fatalf("file writes: %s from %s, %s from %s; want fs sharing one process part", one.Decision, one.ProcFrom, two.Decision, two.ProcFrom)
	}
	// Right after a turn the head may not be provably clean yet (see
	// TestRealUnchangedShellSharesItsProcessPart): one restore first.
	if _, err := c.Restore(ctx, "sh", two.ID, 0); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Restore(ctx, "sh", two.ID, 0); err != nil {
		t.Fatal(err)
	}
	for i, ck := range []*state.Checkpoint{one, two, one, one, two, one} {
		res, err := c.Restore(ctx, "sh", ck.ID, 0)
		if err != nil {
			t.Fatal(err)
		}
		if res.Path != "fs" || res.Phases.Undo != "head" {
			t.Fatalf("restore %d (%s): path %s, undo %s; want fs, head", i, ck.ID, res.Path, res.Phases.Undo)
		}
	}
	if got := run("cat /w/f"); got != "one" {
		t.Fatalf("after the chain: %q", got)
	}
	if got := run("cat /w/f; echo again > /w/f"); got != "one" {
		t.Fatalf("the shell sees %q", got)
	}
	_, three := turn(t, c, "sh")
	if three.Decision != state.ModeFS {
		t.Fatalf("a file write after the chain: %s (%s), want fs", three.Decision, three.Reason)
	}
}

// TestRealRestoreAdoptsEqualShell: restoring a checkpoint whose process
// part is not the head's but holds a shell in the same state (same
// variables, cwd, …: equal digests) only switches the fs — the live shell
// runs on (same pid) — and the shell then counts as that part's, so the
// next turn shares it. A part with a different shell state is restored
// from its template.
func TestRealRestoreAdoptsEqualShell(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	run := shellSandbox(t, c, "RWB_ADOPT_MARK="+t.Name())
	// The live shell, seen from the host: the one running (not stopped
	// as a template) process with the session's environment.
	livePID := func() int {
		t.Helper()
		var pids []int
		ents, _ := os.ReadDir("/proc")
		for _, e := range ents {
			pid, err := strconv.Atoi(e.Name())
			if err != nil {
				continue
			}
			env, _ := os.ReadFile("/proc/" + e.Name() + "/environ")
			st, _ := os.ReadFile("/proc/" + e.Name() + "/stat")
			if !bytes.Contains(env, []byte("RWB_ADOPT_MARK="+t.Name()+"\x00")) {
				continue
			}
			if f := strings.Fields(string(st[bytes.LastIndexByte(st, ')')+1:])); len(f) > 0 && f[0] != "t" && f[0] != "T" && f[0] != "Z" {
				pids = append(pids, pid)
			}
		}
		if len(pids) != 1 {
			t.Fatalf("live shells: %v, want one", pids)
		}
		return pids[0]
	}
	run("mkdir -p /w && cd /w && X=0")
	_, base := turn(t, c, "sh")
	run("X=1")
	_, one := turn(t, c, "sh")
	run("X=0")
	_, zero := turn(t, c, "sh")
	run("echo data > /w/f")
	_, file := turn(t, c, "sh")
	for _, ck := range []*state.Checkpoint{base, one, zero} {
		if ck.Decision != state.ModeFull || ck.ProcFrom != ck.ID {
			t.Fatalf("%s: %s from %s (%s), want a full checkpoint of its own", ck.ID, ck.Decision, ck.ProcFrom, ck.Reason)
		}
	}
	if file.Decision != state.ModeFS || file.ProcFrom != zero.ID {
		t.Fatalf("file write: %s from %s (%s), want fs sharing %s", file.Decision, file.ProcFrom, file.Reason, zero.ID)
	}
	// Make the head provably clean (see TestRealFSRestoresChain).
	for i := 0; i < 2; i++ {
		if _, err := c.Restore(ctx, "sh", file.ID, 0); err != nil {
			t.Fatal(err)
		}
	}
	pid := livePID()
	res, err := c.Restore(ctx, "sh", base.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "fs" || res.Phases.Undo != "head" {
		t.Fatalf("restore of the equal shell's checkpoint: path %s, undo %s; want fs, head", res.Path, res.Phases.Undo)
	}
	if got := livePID(); got != pid {
		t.Fatalf("the fs-only restore replaced the shell: pid %d, was %d", got, pid)
	}
	if got := run(`echo "$X $PWD $(cat /w/f 2>/dev/null)"`); got != "0 /w" {
		t.Fatalf("after the fs-only restore: %q, want %q", got, "0 /w")
	}
	run("true")
	_, after := turn(t, c, "sh")
	if after.Decision != state.ModeFS || after.ProcFrom != base.ID {
		t.Fatalf("turn after the fs-only restore: %s from %s (%s), want fs sharing %s", after.Decision, after.ProcFrom, after.Reason, base.ID)
	}
	res, err = c.Restore(ctx, "sh", one.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Path == "fs" {
		t.Fatalf("restore of a different shell state: path fs")
	}
	if got := run(`echo "$X $PWD $(cat /w/f 2>/dev/null)"`); got != "1 /w" {
		t.Fatalf("after restoring X=1: %q", got)
	}
	if got := livePID(); got == pid {
		t.Fatalf("the shell was not recreated (pid %d)", got)
	}
}

// TestRealRestoreAdoptsWithDigestTakenAhead: a full checkpoint's shell
// digest is taken while the checkpoint is made durable, so a restore from
// it to an equal shell's checkpoint keeps the live shell even when no turn
// asked for that digest since (no later turn compared the shell with it).
func TestRealRestoreAdoptsWithDigestTakenAhead(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	run := shellSandbox(t, c)
	run("mkdir -p /w && cd /w && X=0")
	_, base := turn(t, c, "sh")
	run("X=1")
	_, one := turn(t, c, "sh")
	run("X=0 && echo data > /w/f")
	_, zero := turn(t, c, "sh") // the head; nothing compares the shell with it
	for _, ck := range []*state.Checkpoint{base, one, zero} {
		if ck.Decision != state.ModeFull || ck.ProcFrom != ck.ID {
			t.Fatalf("%s: %s from %s (%s), want a full checkpoint of its own", ck.ID, ck.Decision, ck.ProcFrom, ck.Reason)
		}
	}
	// Make the head provably clean (see TestRealFSRestoresChain).
	for i := 0; i < 2; i++ {
		if _, err := c.Restore(ctx, "sh", zero.ID, 0); err != nil {
			t.Fatal(err)
		}
	}
	res, err := c.Restore(ctx, "sh", base.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "fs" || res.Phases.Undo != "head" {
		t.Fatalf("restore from %s to the equal shell's %s: path %s, undo %s; want fs, head", zero.ID, base.ID, res.Path, res.Phases.Undo)
	}
	if got := run(`echo "$X $PWD $(cat /w/f 2>/dev/null)"`); got != "0 /w" {
		t.Fatalf("after the fs-only restore: %q, want %q", got, "0 /w")
	}
}
