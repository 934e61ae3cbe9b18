package daemon_test

import (
	"context"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/state"
)

// TestRealByteBudget: checkpoints report the bytes they hold (their fs
// layer and process image), and a byte budget makes GC free the branch a
// restore abandoned — automatically, and never what is still reachable.
func TestRealByteBudget(t *testing.T) {
	const mib = 1 << 20
	d := startRealWith(t, t.TempDir(), func(c *daemon.Config) { c.Budget = state.Budget{MaxBytes: 6 * mib} })
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "b"}); err != nil {
		t.Fatal(err)
	}
	turn := func(script, mode string) string {
		t.Helper()
		sh(t, c, "b", script)
		r, err := c.Turn(ctx, "b", api.TurnRequest{Mode: mode, Wait: true})
		if err != nil {
			t.Fatal(err)
		}
		return r.ID
	}
	a := turn("mkdir -p /w && head -c 2M /dev/urandom > /w/a", "full")
	ck, err := c.GetCheckpoint(ctx, a)
	if err != nil {
		t.Fatal(err)
	}
	if ck.FSBytes < 2*mib {
		t.Fatalf("checkpoint a holds %d fs bytes, want >= 2 MiB", ck.FSBytes)
	}
	b := turn("head -c 2M /dev/urandom > /w/b", "fs")
	cc := turn("head -c 2M /dev/urandom > /w/c", "fs")
	// Abandon b and c: back to a, then a new branch.
	r, err := c.Restore(ctx, "b", a, 0)
	if err != nil {
		t.Fatal(err)
	}
	_ = r
	dd := turn("echo small > /w/d", "fs")
	gone := func(id string) bool {
		_, err := c.GetCheckpoint(ctx, id)
		return err != nil
	}
	deadline := time.Now().Add(30 * time.Second)
	for !(gone(b) && gone(cc)) {
		if time.Now().After(deadline) {
			t.Fatalf("over the byte budget, the abandoned branch was not collected (b gone %v, c gone %v)", gone(b), gone(cc))
		}
		time.Sleep(100 * time.Millisecond)
	}
	for _, id := range []string{a, dd} {
		if gone(id) {
			t.Fatalf("reachable checkpoint %s was collected", id)
		}
	}
	if _, err := c.Restore(ctx, "b", a, 0); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, c, "b", "ls /w | tr '\\n' ' '"); got != "a" {
		t.Fatalf("after restoring a: /w has %q, want a", got)
	}
}

// TestRealTemplateBound: with room for one checkpoint's templates, an
// older checkpoint's templates are evicted once its image exists, and it
// restores from the CRIU image with the shell's state intact.
func TestRealTemplateBound(t *testing.T) {
	d := startRealWith(t, t.TempDir(), func(c *daemon.Config) { c.MaxTemplates = 1 })
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "p"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "p", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "p", "sh", "export V=one; echo @@done@@")
	first, err := c.Turn(ctx, "p", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	send(t, c, "p", "sh", "export V=two; echo @@done@@")
	if _, err := c.Turn(ctx, "p", api.TurnRequest{Mode: "full", Wait: true}); err != nil {
		t.Fatal(err)
	}
	r, err := c.Restore(ctx, "p", first.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if r.Path == "template" {
		t.Fatalf("restore of the older checkpoint used a template; with --max-templates 1 it should have been evicted")
	}
	if got := send(t, c, "p", "sh", "echo V=$V; echo @@done@@"); got != "V=one" {
		t.Fatalf("after restore (path %s): %q, want V=one", r.Path, got)
	}
}
