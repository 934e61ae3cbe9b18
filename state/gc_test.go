package state_test

import (
	"errors"
	"fmt"
	"math/rand/v2"
	"sort"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
)

// model is the test's own view of the tree, independent of the manager.
type model struct {
	parent  map[string]string // checkpoint -> parent
	owner   map[string]string // checkpoint -> sandbox name
	file    map[string]string // checkpoint -> content of /f
	mem     map[string]string // checkpoint -> process variable v
	head    map[string]string // sandbox -> head checkpoint
	pins    map[string]bool
	freed   map[string]bool
	alive   map[string]bool // sandbox names
	cur     map[string][2]string
	memDirt map[string]bool // sandbox: v changed since its head
}

func (md *model) reachable() map[string]bool {
	r := map[string]bool{}
	mark := func(id string) {
		for id != "" && !r[id] {
			r[id] = true
			id = md.parent[id]
		}
	}
	for id := range md.pins {
		mark(id)
	}
	for sb := range md.alive {
		mark(md.head[sb])
	}
	return r
}

// TestGCTreeSearchSimulation drives a random tree search over thousands
// of checkpoints (branching restores, forks, pins, unpins, removals, GC)
// and checks after every collection that nothing reachable from a pin or
// a live sandbox was freed and that everything freed was unreachable;
// restores of reachable nodes must give back their exact content.
func TestGCTreeSearchSimulation(t *testing.T) {
	steps := 9000
	if testing.Short() {
		steps = 2000
	}
	for _, seed := range []uint64{1, 2} {
		t.Run(fmt.Sprint("seed", seed), func(t *testing.T) { simulate(t, seed, steps) })
	}
}

func simulate(t *testing.T, seed uint64, steps int) {
	e := newEnv(t, false)
	rng := rand.New(rand.NewPCG(seed, seed*7919))
	md := &model{
		parent: map[string]string{}, owner: map[string]string{}, file: map[string]string{}, mem: map[string]string{},
		head: map[string]string{}, pins: map[string]bool{}, freed: map[string]bool{}, alive: map[string]bool{},
		cur: map[string][2]string{}, memDirt: map[string]bool{},
	}
	nsb := 0
	newSandbox := func() string {
		nsb++
		name := fmt.Sprintf("s%d", nsb)
		e.create(name)
		e.run(name, "write", "/f")
		md.alive[name] = true
		md.cur[name] = [2]string{"", ""}
		return name
	}
	pick := func(m map[string]bool) string {
		if len(m) == 0 {
			return ""
		}
		keys := make([]string, 0, len(m))
		for k := range m {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		return keys[rng.IntN(len(keys))]
	}
	checkGC := func(res *state.GCResult) {
		t.Helper()
		reach := md.reachable()
		for _, id := range res.Freed {
			if reach[id] {
				t.Fatalf("GC freed reachable checkpoint %s", id)
			}
			md.freed[id] = true
		}
		for id := range reach {
			c, err := e.m.GetCheckpoint(id)
			if err != nil {
				t.Fatalf("reachable checkpoint %s is gone: %v", id, err)
			}
			if !e.b.Disk.HasLayer(c.FS) {
				t.Fatalf("reachable checkpoint %s lost its fs layer %s", id, c.FS)
			}
			pf, err := e.m.GetCheckpoint(c.ProcFrom)
			if err != nil || !pf.Proc.Restorable() {
				t.Fatalf("reachable checkpoint %s lost its process part %s: %v", id, c.ProcFrom, err)
			}
			for _, tpl := range pf.Proc.Templates {
				if e.b.Disk.WasReleased(tpl) {
					t.Fatalf("reachable checkpoint %s: template %s released", id, tpl)
				}
			}
		}
		// Everything unreachable that existed before is gone now.
		for id := range md.parent {
			if !reach[id] && !md.freed[id] {
				if _, err := e.m.GetCheckpoint(id); err == nil {
					t.Fatalf("unreachable checkpoint %s survived GC", id)
				}
				md.freed[id] = true
			}
		}
	}

	newSandbox()
	nodes := 0
	for step := 0; step < steps; step++ {
		sb := pick(md.alive)
		if sb == "" {
			sb = newSandbox()
		}
		switch r := rng.IntN(100); {
		case r < 35: // the agent acts
			v := fmt.Sprintf("%s-step%d", sb, step)
			cur := md.cur[sb]
			if rng.IntN(3) == 0 {
				e.run(sb, "set", "v", v)
				cur[1] = v
				md.memDirt[sb] = true
			} else {
				e.run(sb, "write", "/f", v)
				cur[0] = v
			}
			md.cur[sb] = cur
		case r < 65: // turn
			mode := []state.Mode{state.ModeSkip, state.ModeFS, state.ModeFull}[rng.IntN(3)]
			head := md.head[sb]
			cur := md.cur[sb]
			if head != "" && mode == state.ModeSkip && (md.file[head] != cur[0] || md.mem[head] != cur[1]) {
				mode = state.ModeFS
			}
			if mode == state.ModeFS && md.memDirt[sb] {
				mode = state.ModeFull
			}
			res := e.turn(sb, mode, false)
			if mode == state.ModeSkip && head != "" {
				if res.ID != head {
					t.Fatalf("skip returned %s, want head %s", res.ID, head)
				}
				continue
			}
			nodes++
			md.parent[res.ID] = head
			md.owner[res.ID] = sb
			md.file[res.ID], md.mem[res.ID] = cur[0], cur[1]
			md.head[sb] = res.ID
			md.memDirt[sb] = false
		case r < 78: // the search goes back to a node it may return to
			reach := md.reachable()
			var mine []string
			for id := range reach {
				if md.owner[id] == sb {
					mine = append(mine, id)
				}
			}
			if len(mine) == 0 {
				continue
			}
			sort.Strings(mine)
			id := mine[rng.IntN(len(mine))]
			e.restore(sb, id)
			md.head[sb] = id
			md.cur[sb] = [2]string{md.file[id], md.mem[id]}
			md.memDirt[sb] = false
			if got := e.run(sb, "cat", "/f"); got != md.file[id] {
				t.Fatalf("step %d: restore %s: /f = %q, want %q", step, id, got, md.file[id])
			}
			if got := e.run(sb, "get", "v"); got != md.mem[id] {
				t.Fatalf("step %d: restore %s: v = %q, want %q", step, id, got, md.mem[id])
			}
		case r < 86: // expand: pin a node of the frontier
			if id := md.head[sb]; id != "" {
				if err := e.m.Pin([]string{id}); err != nil {
					t.Fatal(err)
				}
				md.pins[id] = true
			}
		case r < 91: // prune
			if id := pick(md.pins); id != "" {
				if err := e.m.Unpin([]string{id}); err != nil {
					t.Fatal(err)
				}
				delete(md.pins, id)
			}
		case r < 94: // collect
			settle(t, e, md)
			res, err := e.m.GC(e.ctx, false)
			if err != nil {
				t.Fatal(err)
			}
			checkGC(res)
		case r < 96: // fork a rollout from a pinned node
			id := pick(md.pins)
			if id == "" || len(md.alive) > 6 {
				continue
			}
			nsb++
			prefix := fmt.Sprintf("f%d-", nsb)
			kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: id, Count: 1, Prefix: prefix})
			if err != nil {
				t.Fatalf("fork %s: %v", id, err)
			}
			name := kids[0].Name
			md.alive[name] = true
			md.head[name] = id
			md.cur[name] = [2]string{md.file[id], md.mem[id]}
		case r < 97: // a rollout ends
			if len(md.alive) > 1 {
				if err := e.m.Remove(e.ctx, sb); err != nil {
					t.Fatal(err)
				}
				delete(md.alive, sb)
			}
		default: // a dry run frees nothing
			before := len(md.parent)
			res, err := e.m.GC(e.ctx, true)
			if err != nil {
				t.Fatal(err)
			}
			reach := md.reachable()
			for _, id := range res.Freed {
				if reach[id] {
					t.Fatalf("dry-run GC would free reachable %s", id)
				}
			}
			_ = before
		}
	}
	settle(t, e, md)
	res, err := e.m.GC(e.ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	checkGC(res)
	if nodes < 1000 && steps >= 9000 {
		t.Fatalf("simulation made only %d checkpoints", nodes)
	}
	// Every pinned node of a live sandbox still restores exactly.
	for id := range md.pins {
		sb := md.owner[id]
		if !md.alive[sb] {
			continue
		}
		e.restore(sb, id)
		if got := e.run(sb, "cat", "/f"); got != md.file[id] {
			t.Fatalf("final restore %s: /f = %q, want %q", id, got, md.file[id])
		}
	}
	// Freed ids are clear errors.
	for id := range md.freed {
		if _, err := e.m.Restore(e.ctx, md.owner[id], id, 0); err == nil || !(errors.Is(err, state.ErrNotFound)) {
			if md.alive[md.owner[id]] {
				t.Fatalf("restore of freed %s: %v", id, err)
			}
		}
		break
	}
	t.Logf("seed: %d checkpoints made, %d freed, %d pinned", nodes, len(md.freed), len(md.pins))
}

// settle waits until every checkpoint made so far is done (in-flight ones
// are GC roots, so a collection keeps them).
func settle(t *testing.T, e *env, md *model) {
	t.Helper()
	for id := range md.parent {
		if !md.freed[id] {
			if _, err := e.m.Wait(e.ctx, id); err != nil {
				t.Fatalf("wait %s: %v", id, err)
			}
		}
	}
}

func TestUsage(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.create("b")
	if _, err := e.m.Usage("nope"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("usage of an unknown sandbox: %v", err)
	}
	u, err := e.m.Usage("a")
	if err != nil || u != (state.Usage{}) {
		t.Fatalf("a new sandbox holds nothing: %+v %v", u, err)
	}
	e.run("a", "write", "/f", "0123456789")
	e.run("a", "set", "X", "1")
	e.run("a", "set", "Y", "2")
	full := e.turn("a", state.ModeFull, true)
	e.run("a", "write", "/g", "abc")
	fsOnly := e.turn("a", state.ModeFS, true)
	e.run("b", "write", "/h", "other sandbox")
	e.turn("b", state.ModeFull, true)

	var fsBytes int64
	for _, id := range []string{full.ID, fsOnly.ID} {
		c, err := e.m.GetCheckpoint(id)
		if err != nil {
			t.Fatal(err)
		}
		fsBytes += c.FSBytes
	}
	c, err := e.m.GetCheckpoint(full.ID)
	if err != nil {
		t.Fatal(err)
	}
	want := state.Usage{Checkpoints: 2, FSBytes: fsBytes, ProcBytes: c.Proc.Bytes, Templates: 1, TemplateBytes: 2 * 64}
	if u, err = e.m.Usage("a"); err != nil || u != want || u.FSBytes == 0 || u.ProcBytes == 0 {
		t.Fatalf("usage of a: got %+v (%v), want %+v with fs and image bytes", u, err, want)
	}
	// Removed and collected, the checkpoints hold nothing; b's stay.
	if err := e.m.Remove(e.ctx, "a"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.m.GC(e.ctx, false); err != nil {
		t.Fatal(err)
	}
	if u, err := e.m.Usage("b"); err != nil || u.Checkpoints != 1 || u.Templates != 1 {
		t.Fatalf("usage of b after a's collection: %+v %v", u, err)
	}
}

// TestGCFreedNothingIsEmpty: a collection that frees nothing answers an
// empty list, dry run or not (the API's "freed": [], never null).
func TestGCFreedNothingIsEmpty(t *testing.T) {
	e := newEnv(t, false)
	e.create("a")
	e.turn("a", state.ModeFull, true)
	for _, dry := range []bool{true, false} {
		res, err := e.m.GC(e.ctx, dry)
		if err != nil {
			t.Fatal(err)
		}
		if res.Freed == nil || len(res.Freed) != 0 {
			t.Errorf("dry run %v: freed %#v, want an empty list", dry, res.Freed)
		}
	}
}
