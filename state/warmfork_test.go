package state_test

import (
	"context"
	"errors"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

func newWarmEnv(t *testing.T, warm int) *env {
	t.Helper()
	e := &env{t: t, dir: t.TempDir(), b: statefake.New(nil), ctx: context.Background()}
	m, err := state.Open(e.ctx, state.Config{Dir: e.dir, FS: e.b.FS, Proc: e.b.Proc, BootID: "boot-1", NoSync: true, WarmForks: warm})
	if err != nil {
		t.Fatal(err)
	}
	e.m = m
	t.Cleanup(func() { e.m.Close(context.Background()) })
	return e
}

// waitWarm waits until at least n children of ckpt are prepared.
func (e *env) waitWarm(ckpt string, n int) {
	e.t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for e.m.WarmForks()[ckpt] < n {
		if time.Now().After(deadline) {
			e.t.Fatalf("prepared children of %s: %d, want %d", ckpt, e.m.WarmForks()[ckpt], n)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func TestForkPrepared(t *testing.T) {
	e := newWarmEnv(t, 4)
	e.create("src")
	e.run("src", "write", "/data", "shared")
	e.run("src", "set", "seed", "42")
	c := e.turn("src", state.ModeFull, true)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 3, Prefix: "a"}); err != nil {
		t.Fatal(err)
	}
	e.waitWarm(c.ID, 3)
	// Each prepared child read its processes' mapped files ahead, the
	// children forked on demand did not (that would delay the fork).
	if n := e.b.Proc.Prefetches.Load(); n != 3 {
		t.Fatalf("%d mapped-file prefetches with 3 children prepared, want 3", n)
	}
	// Prepared children are not sandboxes yet.
	if n := len(e.m.List()); n != 4 {
		t.Fatalf("%d sandboxes listed with 3 children prepared, want 4", n)
	}
	// Starting a sandbox fails now: the next fork must use the prepared ones.
	e.b.Faults.FailStart.Store(true)
	kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 3, Prefix: "b"})
	e.b.Faults.FailStart.Store(false)
	if err != nil {
		t.Fatalf("fork from prepared children: %v", err)
	}
	for i, k := range kids {
		if k.Name != "b"+strconv.Itoa(i+1) || k.Copy != i+1 || k.Warm || k.Origin != c.ID || k.Head != c.ID {
			t.Errorf("child %d: %+v", i, k)
		}
		if got := strings.TrimSpace(e.run(k.Name, "cat", "/run/rewind/copy")); got != strconv.Itoa(i+1) {
			t.Errorf("%s copy number = %q", k.Name, got)
		}
		if got := strings.TrimSpace(e.run(k.Name, "cat", "/run/rewind/sandbox")); got != k.Name {
			t.Errorf("%s sandbox name = %q", k.Name, got)
		}
		if got := e.run(k.Name, "cat", "/data"); got != "shared" {
			t.Errorf("%s /data = %q", k.Name, got)
		}
		if got := e.run(k.Name, "get", "seed"); got != "42" {
			t.Errorf("%s process state = %q", k.Name, got)
		}
	}
	// Isolation.
	e.run("b1", "write", "/data", "b1-only")
	for _, n := range []string{"b2", "b3", "a1", "src"} {
		if got := e.run(n, "cat", "/data"); got != "shared" {
			t.Fatalf("%s sees b1's write: %q", n, got)
		}
	}
	// All or nothing: 3 prepared, the 4th child cannot start.
	e.waitWarm(c.ID, 3)
	e.b.Faults.FailStart.Store(true)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 4, Prefix: "bad"}); err == nil {
		t.Fatal("fork with a failing start succeeded")
	}
	e.b.Faults.FailStart.Store(false)
	for _, sb := range e.m.List() {
		if strings.HasPrefix(sb.Name, "bad") {
			t.Fatalf("a failed fork left %s behind", sb.Name)
		}
	}
	// A checkpoint GC frees takes its prepared children along.
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "c"}); err != nil {
		t.Fatal(err)
	}
	e.waitWarm(c.ID, 2)
	for _, sb := range e.m.List() {
		if err := e.m.Remove(e.ctx, sb.Name); err != nil {
			t.Fatal(err)
		}
	}
	res, err := e.m.GC(e.ctx, false)
	if err != nil {
		t.Fatal(err)
	}
	freed := false
	for _, id := range res.Freed {
		freed = freed || id == c.ID
	}
	if !freed {
		t.Fatalf("gc kept %s: %+v", c.ID, res)
	}
	if n := e.m.WarmForks()[c.ID]; n != 0 {
		t.Fatalf("%d prepared children of a freed checkpoint remain", n)
	}
}

func TestForkPreparedGoneAfterClose(t *testing.T) {
	e := newWarmEnv(t, 2)
	e.create("src")
	c := e.turn("src", state.ModeFull, true)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "a"}); err != nil {
		t.Fatal(err)
	}
	e.waitWarm(c.ID, 2)
	if err := e.m.Close(e.ctx); err != nil {
		t.Fatal(err)
	}
	e.open(false, "boot-1")
	var names []string
	for _, sb := range e.m.List() {
		names = append(names, sb.Name)
	}
	if strings.Join(names, ",") != "a1,a2,src" {
		t.Fatalf("sandboxes after a restart: %v", names)
	}
	if n := e.m.WarmForks()[c.ID]; n != 0 {
		t.Fatalf("prepared children after a restart without WarmForks: %d", n)
	}
}

func TestPrepareFork(t *testing.T) {
	cases := []struct {
		name  string
		warm  int
		ckpt  string // "" means the real one
		count int
		want  int
		err   error
	}{
		{"prepares", 4, "", 3, 3, nil},
		{"bounded by WarmForks", 2, "", 8, 2, nil},
		{"unknown checkpoint", 4, "ck-nope", 2, 0, state.ErrNotFound},
		{"bad count", 4, "", 0, 0, state.ErrBadRequest},
		{"no warm forks", 0, "", 2, 0, state.ErrBadRequest},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			e := newWarmEnv(t, tc.warm)
			e.create("src")
			e.run("src", "set", "seed", "7")
			c := e.turn("src", state.ModeFull, true)
			id := c.ID
			if tc.ckpt != "" {
				id = tc.ckpt
			}
			n, err := e.m.PrepareFork(e.ctx, id, tc.count)
			if !errors.Is(err, tc.err) || (tc.err == nil && err != nil) {
				t.Fatalf("PrepareFork: %v, want %v", err, tc.err)
			}
			if n != tc.want {
				t.Fatalf("PrepareFork = %d, want %d", n, tc.want)
			}
			if err != nil {
				return
			}
			e.waitWarm(c.ID, n)
			// The first fork of the checkpoint needs no new sandbox.
			e.b.Faults.FailStart.Store(true)
			kids, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: n, Prefix: "r"})
			e.b.Faults.FailStart.Store(false)
			if err != nil {
				t.Fatalf("first fork after PrepareFork: %v", err)
			}
			for i, k := range kids {
				if got := strings.TrimSpace(e.run(k.Name, "cat", "/run/rewind/copy")); got != strconv.Itoa(i+1) {
					t.Errorf("%s copy number = %q", k.Name, got)
				}
				if got := e.run(k.Name, "get", "seed"); got != "7" {
					t.Errorf("%s process state = %q", k.Name, got)
				}
			}
		})
	}
}

// After a fork, the children run first: no child is prepared until each
// has finished a first request, or the wait (warmDefer) ran out.
func TestForkPreparesAfterChildrenServed(t *testing.T) {
	e := newWarmEnv(t, 2)
	e.m.SetWarmDeferForTest(time.Hour)
	e.create("src")
	c := e.turn("src", state.ModeFull, true)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "a"}); err != nil {
		t.Fatal(err)
	}
	if n := e.m.AwaitingForTest(); n != 2 {
		t.Fatalf("%d children awaited after a fork of 2", n)
	}
	e.run("a1", "cat", "/run/rewind/copy")
	if n := e.m.AwaitingForTest(); n != 1 {
		t.Fatalf("%d children awaited after a1's first command, want 1", n)
	}
	// (Nothing may be prepared while a2 has not run: the pool stays
	// empty however long this takes.)
	time.Sleep(100 * time.Millisecond)
	if n := e.m.WarmForks()[c.ID]; n != 0 {
		t.Fatalf("%d children prepared while a2 had not run yet", n)
	}
	e.run("a2", "cat", "/run/rewind/copy")
	if n := e.m.AwaitingForTest(); n != 0 {
		t.Fatalf("%d children awaited after both ran", n)
	}
	e.waitWarm(c.ID, 2)

	// Children that never run hold preparations back only until the
	// wait runs out.
	e.m.SetWarmDeferForTest(20 * time.Millisecond)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 2, Prefix: "b"}); err != nil {
		t.Fatal(err)
	}
	e.waitWarm(c.ID, 2)
	if n := e.m.AwaitingForTest(); n != 0 {
		t.Fatalf("%d children still awaited once the wait ran out", n)
	}
	// A removed child no longer holds them back either.
	e.m.SetWarmDeferForTest(time.Hour)
	if _, err := e.m.Fork(e.ctx, state.ForkRequest{Checkpoint: c.ID, Count: 1, Prefix: "c"}); err != nil {
		t.Fatal(err)
	}
	if err := e.m.Remove(e.ctx, "c1"); err != nil {
		t.Fatal(err)
	}
	if n := e.m.AwaitingForTest(); n != 0 {
		t.Fatalf("%d children awaited after the only one was removed", n)
	}
	e.waitWarm(c.ID, 1)
}

// A preparation that fails is retried: one failure among a refill's
// restores leaves it short only until the retry; a checkpoint whose
// preparations keep failing is given up after a few (warmMaxFailures),
// until it is prepared or forked again.
func TestPrepareForkRetriesFailures(t *testing.T) {
	for _, tc := range []struct {
		name     string
		failures int32
		want     int // prepared children once the refill settles
	}{
		{"one failure", 1, 3},
		{"two failures", 2, 3},
		{"failing for good", 1000, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			e := newWarmEnv(t, 4)
			e.create("src")
			e.run("src", "set", "seed", "7")
			c := e.turn("src", state.ModeFull, true)
			e.b.Faults.FailStarts.Store(tc.failures)
			if _, err := e.m.PrepareFork(e.ctx, c.ID, 3); err != nil {
				t.Fatal(err)
			}
			if tc.want > 0 {
				e.waitWarm(c.ID, tc.want)
				return
			}
			// Given up: the failures stop (a few attempts, not one per
			// loop of the refill for ever).
			deadline := time.Now().Add(5 * time.Second)
			for {
				left := e.b.Faults.FailStarts.Load()
				time.Sleep(200 * time.Millisecond)
				if e.b.Faults.FailStarts.Load() == left {
					if tried := tc.failures - left; tried > 8 {
						t.Fatalf("%d preparations tried", tried)
					}
					break
				}
				if time.Now().After(deadline) {
					t.Fatalf("still preparing after 5 s (%d tried)", tc.failures-e.b.Faults.FailStarts.Load())
				}
			}
			if n := e.m.WarmForks()[c.ID]; n != 0 {
				t.Fatalf("%d prepared", n)
			}
			// Asked again, it is tried again.
			e.b.Faults.FailStarts.Store(0)
			if _, err := e.m.PrepareFork(e.ctx, c.ID, 3); err != nil {
				t.Fatal(err)
			}
			e.waitWarm(c.ID, 3)
		})
	}
}
