package daemon_test

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/conformance"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestRealRandomSessions drives a daemon's sandbox (the eBPF probe, the
// effects policy, shell digests, deferred turns: everything a harness
// meets) with the random session steps of conformance.GenerateProcess — a
// bash whose variables, array, cwd, umask, options, traps, functions,
// descriptors and jobs change, and for some seeds a python beside it —
// with an auto turn (half of them deferred) at each of its turns and
// checkpoints, and some of its restores turned into forks. Each session's
// state is printed right after every turn. Whatever the policy decides,
// an id must stand for one state: a turn that hands out an id again (a
// skip) must find the state unchanged, and a restore to an id, or a fork
// of it, must give back the state printed at its turn. (A fork of an id
// whose processes hold a file of the sandbox's /dev/shm, which checkpoints
// do not hold, must fail and name the file.)
func TestRealRandomSessions(t *testing.T) {
	for _, tc := range []struct {
		fs    string
		seeds []uint64
	}{
		{"fuse", []uint64{1, 2}},
		{"kernel", []uint64{5}},
	} {
		for _, seed := range tc.seeds {
			t.Run(fmt.Sprintf("%s/seed%d", tc.fs, seed), func(t *testing.T) {
				var d *realDaemon
				if tc.fs == "kernel" {
					d = startKernelDaemon(t)
				} else {
					d = startReal(t, t.TempDir())
				}
				randomSessions(t, d.c, nil, "a", tc.fs, seed, 90)
			})
		}
	}
}

// randomSessions runs GenerateProcess(seed, n) through client c as
// TestRealRandomSessions says. With crash, the daemon is killed and
// started again (crash returns the new daemon's client) before one of the
// workload's restores in its second half, which then restores the
// stopped sandbox from the checkpoint's image.
// TestCrashRandomSessions is TestRealRandomSessions with the daemon killed
// (SIGKILL) and started again on the same state before one of the
// workload's later restores: every id handed out before the crash was
// durable, and the restore after it must give back its turn's state from
// the checkpoint's image, and the run goes on. (A restore of a checkpoint
// from before the crash whose processes held a file of the sandbox's
// /dev/shm, which checkpoints do not hold, must fail, naming the file; the
// test then restores another.)
func TestCrashRandomSessions(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.Require(t, err == nil, "/dev/fuse")
	for _, seed := range []uint64{4, 6} {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			dir := t.TempDir()
			stateDir, sock := filepath.Join(dir, "state"), filepath.Join(dir, "run", "rewind.sock")
			cmd, c := spawnDaemon(t, stateDir, sock, "real")
			crash := func() *client.Client {
				killDaemon(t, cmd)
				var c2 *client.Client
				cmd, c2 = spawnDaemon(t, stateDir, sock, "real")
				return c2
			}
			randomSessions(t, c, crash, "a", "", seed, 90)
		})
	}
}

func randomSessions(t *testing.T, c *client.Client, crash func() *client.Client, name, fsKind string, seed uint64, n int) {
	ctx := context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: name, Policy: "effects", FS: fsKind}); err != nil {
		t.Fatal(err)
	}
	w := conformance.GenerateProcess(seed, n)
	type session struct{ id, marker, state string }
	var sessions []session
	sendTo := func(s session, text string) string {
		t.Helper()
		return send(t, c, name, s.id, text+"\n"+strings.ReplaceAll(s.marker, "{m}", "@@done@@"))
	}
	byID := func(id string) session {
		for _, s := range sessions {
			if s.id == id {
				return s
			}
		}
		t.Fatalf("no session %q", id)
		return session{}
	}
	recordIn := func(name string) string {
		t.Helper()
		var b strings.Builder
		for _, s := range sessions {
			out := send(t, c, name, s.id, s.state+"\n"+strings.ReplaceAll(s.marker, "{m}", "@@done@@"))
			fmt.Fprintf(&b, "[%s] %s\n", s.id, out)
		}
		return b.String()
	}
	record := func() string { t.Helper(); return recordIn(name) }
	rng := rand.New(rand.NewPCG(seed, 0x73657373))
	states := map[string]string{} // checkpoint id -> state printed at its turn
	labels := map[string]string{} // the workload's label -> checkpoint id
	decisions := map[string]int{}
	turn := func(i int) string {
		t.Helper()
		def := rng.IntN(2) == 0
		r, err := c.Turn(ctx, name, api.TurnRequest{Mode: "auto", Wait: true, Defer: def})
		if err != nil {
			t.Fatalf("step %d: turn: %v", i, err)
		}
		decisions[string(r.Decision)]++
		t.Logf("step %d: turn %s %s: %s", i, r.ID, r.Decision, r.Reason)
		now := record()
		if prev, seen := states[r.ID]; seen && prev != now {
			t.Fatalf("step %d: the turn (deferred %v) handed out %s again (%s: %s), but the state changed:\n%s",
				i, def, r.ID, r.Decision, r.Reason, diffLines(prev, now))
		} else if !seen {
			states[r.ID] = now
		}
		return r.ID
	}
	restores, forks := 0, 0
	crashAt, crashed := -1, false
	preCrash := map[string]bool{} // ids handed out before the crash
	const shmFile = "/dev/shm/ro" // GenerateProcess's file on the sandbox's /dev/shm
	if crash != nil {
		var late []int
		for i, s := range w.Steps {
			if s.Op == "restore" && i >= len(w.Steps)/2 {
				late = append(late, i)
			}
		}
		if len(late) == 0 {
			t.Fatalf("%s has no restore in its second half to crash before", w.Name)
		}
		crashAt = late[rng.IntN(len(late))]
	}
	for i, s := range w.Steps {
		switch s.Op {
		case "session":
			if _, err := c.StartSession(ctx, name, api.SessionRequest{ID: s.Session, Argv: s.Argv}); err != nil {
				t.Fatal(err)
			}
			sessions = append(sessions, session{id: s.Session, marker: s.Marker, state: s.State})
		case "send":
			sendTo(byID(s.Session), s.Data)
		case "write", "append", "rmtree":
			p := "/" + s.Path
			script := map[string]string{
				"write":  fmt.Sprintf("printf '%%s' '%s' > %s", s.Data, p),
				"append": fmt.Sprintf("printf '%%s' '%s' >> %s", s.Data, p),
				"rmtree": "rm -rf " + p,
			}[s.Op]
			sh(t, c, name, script)
		case "turn":
			turn(i)
		case "checkpoint":
			labels[s.Label] = turn(i)
		case "restore":
			id := labels[s.Label]
			if i == crashAt {
				c = crash()
				crashed = true
				for x := range states {
					preCrash[x] = true
				}
			}
			// The sandbox started again after the crash has an empty
			// /dev/shm, which checkpoints do not hold: a process of a
			// checkpoint from before that held a file there cannot come
			// back, and the restore must fail, naming the file. The test
			// then restores another checkpoint.
			lost := func(id string) bool { return preCrash[id] && strings.Contains(states[id], shmFile) }
			if lost(id) {
				_, err := c.Restore(ctx, name, id, 0)
				if err == nil || !strings.Contains(err.Error(), shmFile+", which is not where it was") {
					t.Fatalf("step %d: restore %s (%s) of a process holding %s after the crash: %v, want a failure naming the file", i, s.Label, id, shmFile, err)
				}
				id = ""
				for _, l := range slices.Sorted(maps.Keys(labels)) {
					if !lost(labels[l]) {
						id = labels[l]
						break
					}
				}
				if id == "" {
					// Every checkpoint so far holds the file: the
					// sandbox cannot run again, and the run ends here.
					t.Logf("step %d: every checkpoint holds %s: the run ends at the crash", i, shmFile)
					return
				}
			} else if i != crashAt && forks < 3 && rng.IntN(4) == 0 {
				// A fork of the id instead: its child must start in
				// the state of the id's turn.
				forks++
				res, err := c.Fork(ctx, id, api.ForkRequest{Count: 1, Prefix: fmt.Sprintf("%s-k%d-", name, i)})
				if strings.Contains(states[id], shmFile) {
					// A fork child's /dev/shm starts empty too.
					if err == nil || !strings.Contains(err.Error(), shmFile+", which is not where it was") {
						t.Fatalf("step %d: fork %s (%s) of a process holding %s: %v, want a failure naming the file", i, s.Label, id, shmFile, err)
					}
					continue
				}
				if err != nil {
					t.Fatalf("step %d: fork %s (%s): %v", i, s.Label, id, err)
				}
				kid := res.Sandboxes[0]
				if got := recordIn(kid); got != states[id] {
					t.Fatalf("step %d: fork of %s (%s) starts in another state than its turn's:\n%s", i, s.Label, id, diffLines(states[id], got))
				}
				if err := c.Remove(ctx, kid); err != nil {
					t.Fatal(err)
				}
				continue
			}
			r, err := c.Restore(ctx, name, id, 0)
			if err != nil {
				t.Fatalf("step %d: restore %s (%s, crashed before: %v): %v", i, s.Label, id, crashed, err)
			}
			restores++
			if got := record(); got != states[id] {
				t.Fatalf("step %d: restore of %s (%s, path %s, crashed before: %v) gives another state than its turn's:\n%s",
					i, s.Label, id, r.Path, crashed, diffLines(states[id], got))
			}
			if i == crashAt {
				t.Logf("step %d: restored %s after the crash through %s", i, id, r.Path)
			}
		default:
			t.Fatalf("step %d: op %s not driven by this test", i, s.Op)
		}
	}
	if crash != nil && !crashed {
		t.Fatal("the daemon was not crashed")
	}
	t.Logf("%s: decisions %v over %d ids, %d restores, %d forks", w.Name, decisions, len(states), restores, forks)
}

// diffLines lists the lines of a and b that differ, side by side.
func diffLines(a, b string) string {
	al, bl := strings.Split(a, "\n"), strings.Split(b, "\n")
	var out strings.Builder
	for i := range max(len(al), len(bl)) {
		var x, y string
		if i < len(al) {
			x = al[i]
		}
		if i < len(bl) {
			y = bl[i]
		}
		if x != y {
			fmt.Fprintf(&out, "  want %s\n  got  %s\n", x, y)
		}
	}
	return out.String()
}

// TestConcurrentRandomSessions is TestRealRandomSessions with several
// sandboxes of one daemon driven at once, as a trainer's rollouts or a
// search's parallel workers drive them: each runs its own random session
// (turns, restores, forks) while the others do, sharing the daemon's
// store, probe, tracer and CRIU, on the FUSE path and the kernel path side
// by side, and each id must still stand for its turn's state.
func TestConcurrentRandomSessions(t *testing.T) {
	d := startKernelDaemon(t)
	for i, seed := range []uint64{7, 8, 9} {
		fsKind := []string{"fuse", "kernel"}[i%2]
		t.Run(fmt.Sprintf("%s/seed%d", fsKind, seed), func(t *testing.T) {
			t.Parallel()
			randomSessions(t, d.c, nil, fmt.Sprintf("s%d", seed), fsKind, seed, 60)
		})
	}
}
