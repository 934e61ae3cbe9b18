package daemon_test

import (
	"context"
	"errors"
	"slices"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// TestRealSessionStop stops a session that would otherwise run until its
// sandbox goes (a server started in the foreground of a python): its
// process and what it started in its process group are killed, the other
// session runs on, and the sandbox still checkpoints and restores.
func TestRealSessionStop(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "ss"}); err != nil {
		t.Fatal(err)
	}
	for _, s := range []api.SessionRequest{
		{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}},
		{ID: "srv", Argv: []string{"sh", "-c", "sleep 1001 & exec python3 -c 'import time\nwhile True: time.sleep(1)'"}},
	} {
		if _, err := c.StartSession(ctx, "ss", s); err != nil {
			t.Fatal(err)
		}
	}
	if ids, err := c.Sessions(ctx, "ss"); err != nil || !slices.Equal(ids, []string{"sh", "srv"}) {
		t.Fatalf("sessions: %q %v", ids, err)
	}
	if got := sh(t, c, "ss", "sleep 0.2; pgrep -c -f 'slee[p] 1001|whil[e] True' || true"); got != "2" {
		t.Fatalf("the server session's processes: %s", got)
	}
	if err := c.StopSession(ctx, "ss", "srv", 0); err != nil {
		t.Fatalf("stop: %v", err)
	}
	if got := sh(t, c, "ss", "sleep 0.2; pgrep -c -f 'slee[p] 1001|whil[e] True' || true"); got != "0" {
		t.Errorf("processes of the stopped session left: %s", got)
	}
	if ids, err := c.Sessions(ctx, "ss"); err != nil || !slices.Equal(ids, []string{"sh"}) {
		t.Errorf("sessions after the stop: %q %v", ids, err)
	}
	if err := c.StopSession(ctx, "ss", "srv", 0); !errors.Is(err, state.ErrNotFound) {
		t.Errorf("second stop: %v, want not found", err)
	}
	send(t, c, "ss", "sh", `export V=7; echo @@done@@`)
	ck, err := c.Turn(ctx, "ss", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	send(t, c, "ss", "sh", `export V=8; echo @@done@@`)
	if _, err := c.Restore(ctx, "ss", ck.ID, 0); err != nil {
		t.Fatal(err)
	}
	if got := send(t, c, "ss", "sh", `echo $V; echo @@done@@`); got != "7" {
		t.Errorf("after the restore: %q", got)
	}
}
