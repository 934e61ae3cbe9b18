package daemon_test

import (
	"context"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// TestRealSendEnded: a send's answer says what ended its read: the
// --until match, quiet output, the timeout (the command still running; its
// later output comes with the next send), or the session's exit with its
// status. A timeout answered like a complete one before.
func TestRealSendEnded(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "s"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "s", api.SessionRequest{ID: "sh", Argv: []string{"sh"}}); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		req    api.SendRequest
		output string
		ended  string
		exit   int // -1: none
	}{
		{api.SendRequest{Text: "echo a; sleep 3; echo b", Until: "zzz", TimeoutMS: 1000}, "a\n", state.EndedTimeout, -1},
		{api.SendRequest{Text: "echo c", Until: `c\n`, TimeoutMS: 30000}, "b\nc\n", state.EndedUntil, -1},
		{api.SendRequest{Text: "echo d", IdleMS: 200, TimeoutMS: 30000}, "d\n", state.EndedIdle, -1},
		{api.SendRequest{Text: "echo bye; exit 3", TimeoutMS: 30000}, "bye\n", state.EndedExit, 3},
	} {
		res, err := c.Step(ctx, "s", "sh", tc.req)
		if err != nil {
			t.Fatalf("send %q: %v", tc.req.Text, err)
		}
		exit := -1
		if res.Exit != nil {
			exit = *res.Exit
		}
		if res.Output != tc.output || res.Ended != tc.ended || exit != tc.exit {
			t.Fatalf("send %q: output %q, ended %q, exit %d; want %q, %q, %d", tc.req.Text, res.Output, res.Ended, exit, tc.output, tc.ended, tc.exit)
		}
	}
}
