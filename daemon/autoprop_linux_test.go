package daemon_test

import (
	"context"
	"fmt"
	"maps"
	"math/rand/v2"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
)

// shellState is what the model says a real sandbox holds: files of /w,
// the persistent shell's variable X and its working directory.
type shellState struct {
	files map[string]string
	x     string
	cwd   string
}

func (s shellState) clone() shellState {
	return shellState{files: maps.Clone(s.files), x: s.x, cwd: s.cwd}
}

// render is what probeScript prints for s.
func (s shellState) render(paths []string) string {
	var b strings.Builder
	for _, p := range paths {
		v, ok := s.files[p]
		if !ok {
			v = "MISSING"
		}
		fmt.Fprintf(&b, "%s=%s;", p, v)
	}
	fmt.Fprintf(&b, "X=%s;cwd=%s", s.x, s.cwd)
	return b.String()
}

// probeScript prints the state render shows, from inside the shell.
func probeScript(paths []string) string {
	var b strings.Builder
	b.WriteString("printf '")
	for _, p := range paths {
		b.WriteString(p + "=%s;")
	}
	b.WriteString("X=%s;cwd=%s\\n'")
	for _, p := range paths {
		fmt.Fprintf(&b, ` "$(cat %s 2>/dev/null || echo MISSING)"`, p)
	}
	b.WriteString(` "$X" "$(pwd)"`)
	return b.String()
}

// TestRealAutoTurnsProperty drives a real sandbox (FUSE or the kernel path,
// the eBPF probe, the effects policy) with random agent actions in a persistent bash — file
// writes and deletes, a variable, cd, read-only commands — and auto turns
// (half deferred), restores to and forks of any checkpoint handed out,
// against a model of its files, variable and working directory. Whatever
// the policy decides, every id a turn hands out must give back the state
// the sandbox had at that turn.
func TestRealAutoTurnsProperty(t *testing.T) {
	for _, tc := range []struct {
		fs    string
		seeds []uint64
	}{
		{"fuse", []uint64{7, 8, 9}},
		{"kernel", []uint64{10, 11}},
	} {
		for _, seed := range tc.seeds {
			t.Run(fmt.Sprintf("%s/seed%d", tc.fs, seed), func(t *testing.T) {
				var d *realDaemon
				if tc.fs == "kernel" {
					d = startKernelDaemon(t)
				} else {
					d = startReal(t, t.TempDir())
				}
				realAutoProperty(t, d, tc.fs, seed)
			})
		}
	}
}

func realAutoProperty(t *testing.T, d *realDaemon, fsKind string, seed uint64) {
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a", Policy: "effects", FS: fsKind}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "a", api.SessionRequest{ID: "b", Argv: []string{"bash", "--noprofile", "--norc"}, Env: []string{"PS1="}}); err != nil {
		t.Fatal(err)
	}
	paths := []string{"/w/p0", "/w/p1", "/w/d/p2"}
	dirs := []string{"/", "/w", "/w/d"}
	run := func(name, cmd string) string { return send(t, c, name, "b", cmd+"\necho @@done@@") }
	run("a", "mkdir -p /w/d && cd /")
	cur := shellState{files: map[string]string{}, cwd: "/"}
	rng := rand.New(rand.NewPCG(seed, 0x7265616c))
	ids := map[string]shellState{}
	var order []string
	decisions := map[string]int{}
	turn := func(mode string) {
		t.Helper()
		def := mode == "auto" && rng.IntN(2) == 0
		r, err := c.Turn(ctx, "a", api.TurnRequest{Mode: mode, Wait: true, Defer: def})
		if err != nil {
			t.Fatal(err)
		}
		decisions[string(r.Decision)]++
		if prev, seen := ids[r.ID]; seen {
			if prev.render(paths) != cur.render(paths) {
				t.Fatalf("turn %s (deferred %v) handed out %s again (%s: %s): its state %s, the sandbox's %s", mode, def, r.ID, r.Decision, r.Reason, prev.render(paths), cur.render(paths))
			}
			return
		}
		ids[r.ID] = cur.clone()
		order = append(order, r.ID)
	}
	check := func(name, when string, want shellState) {
		t.Helper()
		if got := run(name, probeScript(paths)); got != want.render(paths) {
			t.Fatalf("%s: the shell sees %s, want %s", when, got, want.render(paths))
		}
	}
	turn("full")
	steps := 60
	if testing.Short() {
		steps = 25
	}
	forks := 0
	for step := 0; step < steps; step++ {
		switch r := rng.IntN(100); {
		case r < 20:
			p, v := paths[rng.IntN(len(paths))], fmt.Sprintf("v%d", step)
			run("a", fmt.Sprintf("echo %s > %s", v, p))
			cur.files[p] = v
		case r < 25:
			p := paths[rng.IntN(len(paths))]
			run("a", "rm -f "+p)
			delete(cur.files, p)
		case r < 35:
			v := fmt.Sprintf("x%d", step)
			run("a", "X="+v)
			cur.x = v
		case r < 40:
			dir := dirs[rng.IntN(len(dirs))]
			run("a", "cd "+dir)
			cur.cwd = dir
		case r < 50:
			run("a", "cat /w/p0 >/dev/null 2>&1; ls /w >/dev/null")
		case r < 75:
			turn("auto")
		case r < 92:
			turn("auto")
			id := order[rng.IntN(len(order))]
			if _, err := c.Restore(ctx, "a", id, 0); err != nil {
				t.Fatalf("restore %s: %v", id, err)
			}
			cur = ids[id].clone()
			check("a", fmt.Sprintf("step %d, after restoring %s", step, id), cur)
		default:
			if forks >= 2 {
				check("a", fmt.Sprintf("step %d", step), cur)
				continue
			}
			forks++
			id := order[rng.IntN(len(order))]
			res, err := c.Fork(ctx, id, api.ForkRequest{Count: 1, Prefix: fmt.Sprintf("k%d-", step)})
			if err != nil {
				t.Fatalf("fork %s: %v", id, err)
			}
			kid := res.Sandboxes[0]
			check(kid, fmt.Sprintf("step %d, fork of %s", step, id), ids[id])
			if err := c.Remove(ctx, kid); err != nil {
				t.Fatal(err)
			}
		}
	}
	t.Logf("decisions %v over %d ids, %d forks", decisions, len(order), forks)
}
