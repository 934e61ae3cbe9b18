package daemon_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// TestSendStep: a send with restore and turn is one tree-search step, and
// each of its steps fails the way its own call would.
func TestSendStep(t *testing.T) {
	c, _ := startFake(t)
	ctx := context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "a", api.SessionRequest{ID: "sh", Argv: []string{"bash"}}); err != nil {
		t.Fatal(err)
	}
	execOut(t, c, "a", "write", "/f", "one")
	root, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	execOut(t, c, "a", "write", "/f", "two")

	// The whole step: back to root, run, end the turn.
	res, err := c.Step(ctx, "a", "sh", api.SendRequest{Restore: root.ID, Text: "echo step", Turn: &api.TurnRequest{Mode: "full", Wait: true}})
	if err != nil {
		t.Fatal(err)
	}
	if res.Output != "step\n" || res.ElapsedUS <= 0 {
		t.Fatalf("output %q in %d us", res.Output, res.ElapsedUS)
	}
	if res.Restore == nil || res.Restore.Epoch != root.Epoch+1 || res.Restore.ElapsedUS <= 0 {
		t.Fatalf("restore part: %+v", res.Restore)
	}
	if res.Turn == nil || res.Turn.Decision != state.ModeFull || res.Turn.ID == root.ID || res.Turn.Epoch != res.Restore.Epoch || !res.Turn.Durable {
		t.Fatalf("turn part: %+v", res.Turn)
	}
	if got := execOut(t, c, "a", "cat", "/f"); got != "one" {
		t.Fatalf("after the step's restore /f = %q", got)
	}
	l, err := c.Log(ctx, "a")
	if err != nil || l.Sandbox.Head != res.Turn.ID {
		t.Fatalf("head after the step: %+v %v", l, err)
	}
	// A plain send answers neither part.
	if res, err := c.Step(ctx, "a", "sh", api.SendRequest{Text: "echo plain"}); err != nil || res.Output != "plain\n" || res.Restore != nil || res.Turn != nil {
		t.Fatalf("plain send: %+v %v", res, err)
	}

	epoch := res.Restore.Epoch
	for _, tc := range []struct {
		name    string
		req     api.SendRequest
		want    error
		msg     string
		epochTo uint64 // the sandbox's epoch after the call
	}{
		{"unknown checkpoint: nothing runs", api.SendRequest{Restore: "ck-none", Text: "echo no", Turn: &api.TurnRequest{}}, state.ErrNotFound, "ck-none", epoch},
		{"stale epoch: the restore refuses", api.SendRequest{Restore: root.ID, Epoch: epoch - 1, Text: "echo no"}, state.ErrStaleEpoch, "", epoch},
		{"turn with its own epoch", api.SendRequest{Text: "echo no", Turn: &api.TurnRequest{Epoch: epoch}}, state.ErrBadRequest, "turn.epoch", epoch},
		{"bad turn mode: refused before the restore", api.SendRequest{Restore: root.ID, Text: "echo no", Turn: &api.TurnRequest{Mode: "weird"}}, state.ErrBadRequest, "turn", epoch},
		{"unknown session after the restore", api.SendRequest{Restore: root.ID, Text: "echo no"}, state.ErrNotFound, "after the restore", epoch + 1},
	} {
		t.Run(tc.name, func(t *testing.T) {
			session := "sh"
			if strings.Contains(tc.name, "unknown session") {
				session = "nope"
			}
			_, err := c.Step(ctx, "a", session, tc.req)
			if !errors.Is(err, tc.want) || !strings.Contains(err.Error(), tc.msg) {
				t.Fatalf("got %v, want %v with %q", err, tc.want, tc.msg)
			}
			sb, err := c.Get(ctx, "a")
			if err != nil || sb.Epoch != tc.epochTo {
				t.Fatalf("epoch after the call: %+v %v, want %d", sb, err, tc.epochTo)
			}
		})
	}
	// Nothing of the refused calls reached the session.
	if res, err := c.Step(ctx, "a", "sh", api.SendRequest{Text: "echo last"}); err != nil || res.Output != "last\n" {
		t.Fatalf("session after the errors: %+v %v", res, err)
	}
}
