package daemon_test

import (
	"context"
	"errors"
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
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/state"
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
				randomSessions(t, d.c, "a", sessionOpts{fs: tc.fs, seed: seed, n: 90})
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
			randomSessions(t, c, "a", sessionOpts{seed: seed, n: 90, crash: crash})
		})
	}
}

// sessionOpts say what randomSessions runs.
type sessionOpts struct {
	fs   string // the sandbox's file-system kind ("" for the daemon's choice)
	seed uint64 // GenerateProcess's seed
	n    int    // and step count
	// crash, if set, kills the daemon and starts it again (see
	// TestCrashRandomSessions), returning the new daemon's client.
	crash func() *client.Client
	// gc pins every checkpoint id handed out and, now and then, unpins
	// some (the run never restores them again) and collects garbage
	// (see TestGCRandomSessions).
	gc bool
}

func randomSessions(t *testing.T, c *client.Client, name string, o sessionOpts) {
	ctx := context.Background()
	crash, seed := o.crash, o.seed
	if _, err := c.Create(ctx, api.CreateRequest{Name: name, Policy: "effects", FS: o.fs}); err != nil {
		t.Fatal(err)
	}
	w := conformance.GenerateProcess(seed, o.n)
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
	paths := map[string]int{} // restores by path
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
	// With o.gc: every label's id is pinned when it is handed out; now and
	// then one label (and every label sharing its id) is dropped: its id
	// unpinned and never restored again, and garbage collected. GC must
	// free no id still pinned or the head, a freed id must be refused as
	// not found without touching the sandbox, and every later restore of
	// a pinned one must still give back its turn's state (through CRIU
	// images once the daemon's few templates are evicted).
	dropped := map[string]bool{}
	collected, gcRuns := 0, 0
	collect := func(i int, newest string) {
		t.Helper()
		id := labels[newest]
		if _, err := c.Pin(ctx, []string{id}); err != nil {
			t.Fatalf("step %d: pin %s: %v", i, id, err)
		}
		var live []string
		for _, l := range slices.Sorted(maps.Keys(labels)) {
			if !dropped[l] && labels[l] != id {
				live = append(live, l)
			}
		}
		if len(live) < 2 || rng.IntN(2) != 0 {
			return
		}
		drop := labels[live[rng.IntN(len(live))]]
		for l, x := range labels {
			if x == drop {
				dropped[l] = true
			}
		}
		if _, err := c.Unpin(ctx, []string{drop}); err != nil {
			t.Fatalf("step %d: unpin %s: %v", i, drop, err)
		}
		res, err := c.GC(ctx, false)
		if err != nil {
			t.Fatalf("step %d: gc: %v", i, err)
		}
		if len(res.Errors) > 0 {
			t.Fatalf("step %d: gc errors: %v", i, res.Errors)
		}
		sb, err := c.Get(ctx, name)
		if err != nil {
			t.Fatal(err)
		}
		for _, f := range res.Freed {
			for l, x := range labels {
				if x == f && !dropped[l] {
					t.Fatalf("step %d: gc freed %s, the id of pinned label %s", i, f, l)
				}
			}
			if f == sb.Head {
				t.Fatalf("step %d: gc freed the head %s", i, f)
			}
		}
		collected += len(res.Freed)
		gcRuns++
		t.Logf("step %d: unpinned %s; gc freed %d, kept %d", i, drop, len(res.Freed), res.Kept)
		if len(res.Freed) == 0 {
			return
		}
		before := record()
		f := res.Freed[rng.IntN(len(res.Freed))]
		if _, err := c.Restore(ctx, name, f, 0); !errors.Is(err, state.ErrNotFound) {
			t.Fatalf("step %d: restore of %s, freed by gc: %v, want not found", i, f, err)
		}
		if now := record(); now != before {
			t.Fatalf("step %d: a refused restore changed the state:\n%s", i, diffLines(before, now))
		}
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
			if o.gc {
				collect(i, s.Label)
			}
		case "restore":
			id := labels[s.Label]
			if dropped[s.Label] {
				// Unpinned and perhaps collected: restore the first
				// label still pinned instead.
				for _, l := range slices.Sorted(maps.Keys(labels)) {
					if !dropped[l] {
						id = labels[l]
						break
					}
				}
			}
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
			paths[r.Path]++
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
	t.Logf("%s: decisions %v over %d ids, %d restores (paths %v), %d forks, %d ids collected in %d gc runs", w.Name, decisions, len(states), restores, paths, forks, collected, gcRuns)
	if o.gc && gcRuns == 0 {
		t.Errorf("%s: gc never ran", w.Name)
	}
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

// TestGCRandomSessions is TestRealRandomSessions under garbage collection,
// as a tree search that drops the nodes it will not revisit runs it: every
// checkpoint the workload labels is pinned, and now and then a label is
// unpinned, never to be restored again, and GC runs. GC must free none of
// the ids still pinned, a freed id must be refused without touching the
// sandbox, and every restore of a pinned id must give back its turn's
// state. The daemon keeps only two checkpoints' templates and merges layers
// two deep, so restores also go through CRIU images and merged layers.
func TestGCRandomSessions(t *testing.T) {
	d := startRealWith(t, t.TempDir(), func(c *daemon.Config) {
		c.MaxTemplates, c.CompactDepth = 2, 2
	})
	for _, seed := range []uint64{10, 11} {
		t.Run(fmt.Sprintf("seed%d", seed), func(t *testing.T) {
			randomSessions(t, d.c, fmt.Sprintf("g%d", seed), sessionOpts{seed: seed, n: 90, gc: true})
		})
	}
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
			randomSessions(t, d.c, fmt.Sprintf("s%d", seed), sessionOpts{fs: fsKind, seed: seed, n: 60})
		})
	}
}
