package state_test

import (
	"bytes"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
)

// autoState is what the model says a sandbox holds: its files and its
// process memory (the fake's variables).
type autoState struct {
	files map[string]string
	mem   map[string]string
}

func (s autoState) clone() autoState {
	return autoState{files: maps.Clone(s.files), mem: maps.Clone(s.mem)}
}

func (s autoState) equal(o autoState) bool {
	return maps.Equal(s.files, o.files) && maps.Equal(s.mem, o.mem)
}

// TestAutoTurnsProperty drives random agent turns in auto mode (half of
// them deferred) — seen file writes and deletes, memory changes, writes no
// probe window sees (made between windows), idle turns, requested full
// turns, restores to and forks of any checkpoint handed out — against a
// model of the sandbox's files and memory. The property a skip must keep: whatever id a turn hands out, the
// sandbox held exactly that id's state when it did (a skip hands out an id
// handed out before: its state must equal the current one), and restoring
// or forking an id gives that state back, files and memory.
func TestAutoTurnsProperty(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) { autoProperty(t, seed, 400) })
	}
}

func autoProperty(t *testing.T, seed uint64, steps int) {
	e := newEnv(t, true)
	rng := rand.New(rand.NewPCG(seed, 0x6175746f))
	e.create("a")
	cur := autoState{files: map[string]string{}, mem: map[string]string{}}
	ids := map[string]autoState{} // every id a turn handed out, with its state
	var order []string
	paths := []string{"/p0", "/p1", "/p2", "/d/p3"}
	// read reads path through the sandbox: its content and whether it
	// exists (the fake's cat fails for a missing file).
	read := func(name, path string) (string, bool) {
		var out bytes.Buffer
		code, err := e.m.Exec(e.ctx, name, 0, state.ExecRequest{Argv: []string{"cat", path}, Stdout: &out})
		if err != nil {
			t.Fatalf("cat %s: %v", path, err)
		}
		if code != 0 {
			return "", false
		}
		return string(bytes.TrimSuffix(out.Bytes(), []byte("\n"))), true
	}
	check := func(name, when string, want autoState) {
		t.Helper()
		for _, p := range paths {
			got, ok := read(name, p)
			w, wok := want.files[p]
			if ok != wok || got != w {
				t.Fatalf("%s: %s = %q (exists %v), want %q (exists %v)", when, p, got, ok, w, wok)
			}
		}
		for _, k := range []string{"x", "y"} {
			if got := e.run(name, "get", k); got != want.mem[k] {
				t.Fatalf("%s: variable %s = %q, want %q", when, k, got, want.mem[k])
			}
		}
	}
	turn := func(mode state.Mode) {
		t.Helper()
		// Half the auto turns are deferred (the harness's fast path: the
		// id at once, the decision with the checkpoint).
		defer_ := mode == state.ModeAuto && rng.IntN(2) == 0
		r, err := e.m.Turn(e.ctx, "a", state.TurnRequest{Mode: mode, Wait: true, Defer: defer_})
		if err != nil {
			t.Fatalf("turn %s: %v", mode, err)
		}
		if prev, seen := ids[r.ID]; seen {
			if !prev.equal(cur) {
				t.Fatalf("turn %s (deferred %v): handed out %s again (%s: %s), whose state %v differs from the sandbox's %v", mode, defer_, r.ID, r.Decision, r.Reason, prev, cur)
			}
			return
		}
		ids[r.ID] = cur.clone()
		order = append(order, r.ID)
	}
	turn(state.ModeFull)
	for step := 0; step < steps; step++ {
		switch r := rng.IntN(100); {
		case r < 20:
			p, v := paths[rng.IntN(len(paths))], fmt.Sprintf("v%d", step)
			e.run("a", "write", p, v)
			cur.files[p] = v
		case r < 25:
			p := paths[rng.IntN(len(paths))]
			e.run("a", "rm", p)
			delete(cur.files, p)
		case r < 35:
			k, v := []string{"x", "y"}[rng.IntN(2)], fmt.Sprintf("m%d", step)
			e.run("a", "set", k, v)
			cur.mem[k] = v
		case r < 40:
			p, v := paths[rng.IntN(len(paths))], fmt.Sprintf("u%d", step)
			e.writeUnseen("a", p, v)
			cur.files[p] = v
		case r < 75:
			turn(state.ModeAuto)
		case r < 80:
			// (A requested fs turn keeps the parent's processes by the
			// caller's choice: not part of this property.)
			turn(state.ModeFull)
		case r < 95:
			// A restore discards what the last turn did not take: end the
			// turn first (as a harness does after every tool call).
			turn(state.ModeAuto)
			id := order[rng.IntN(len(order))]
			e.restore("a", id)
			cur = ids[id].clone()
			check("a", fmt.Sprintf("step %d, after restoring %s", step, id), cur)
		case r < 97:
			// A fork child starts in the checkpoint's state.
			id := order[rng.IntN(len(order))]
			kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: id, Count: 1, Prefix: fmt.Sprintf("k%d-", step)})
			if err != nil {
				t.Fatalf("step %d: fork %s: %v", step, id, err)
			}
			check(kids[0].Name, fmt.Sprintf("step %d, fork of %s", step, id), ids[id])
		default:
			check("a", fmt.Sprintf("step %d", step), cur)
		}
	}
	// Every id handed out still restores to its state.
	for _, id := range slices.Sorted(maps.Keys(ids)) {
		e.restore("a", id)
		check("a", "final restore of "+id, ids[id])
	}
}
