package daemon_test

import (
	"context"
	"fmt"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
)

// TestRealForkChildFirstTurnSkips: a fork child that did nothing yet is
// exactly its fork point, so its first auto turn is a skip. Each child's
// shell, released into a fresh mount, first waits for its program's pages
// through FUSE; the restore took that wait (state D) for settled, and the
// shell ran on once the probe window was open: 1 to 6 of 16 children's
// first turns were full checkpoints ("memory written: 1 pages").
func TestRealForkChildFirstTurnSkips(t *testing.T) {
	d := startRealWith(t, t.TempDir(), nil)
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "src"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "src", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "src", "sh", "cd /tmp && X=1; echo @@done@@")
	ck, err := c.Checkpoint(ctx, "src", true, 0)
	if err != nil {
		t.Fatal(err)
	}
	const n = 8
	res, err := c.Fork(ctx, ck.ID, api.ForkRequest{Count: n, Prefix: "k-"})
	if err != nil {
		t.Fatal(err)
	}
	var full []string
	for _, name := range res.Sandboxes {
		tr, err := c.Turn(ctx, name, api.TurnRequest{Mode: "auto"})
		if err != nil {
			t.Fatal(err)
		}
		if tr.Decision != "skip" {
			full = append(full, fmt.Sprintf("%s: %s (%s)", name, tr.Decision, tr.Reason))
		}
	}
	if len(full) > 0 {
		t.Fatalf("%d of %d fork children's first turns were not skips: %v", len(full), n, full)
	}
}
