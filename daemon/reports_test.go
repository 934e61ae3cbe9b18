package daemon_test

import (
	"context"
	"errors"
	"net"
	"net/http"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

func TestReportsEndpointFake(t *testing.T) {
	c, sock := startFake(t)
	ctx := context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a", Policy: "fake"}); err != nil {
		t.Fatal(err)
	}
	execOut(t, c, "a", "write", "/f", "one")
	t1, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "auto"})
	if err != nil {
		t.Fatal(err)
	}
	t2, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "auto"})
	if err != nil {
		t.Fatal(err)
	}
	p, err := c.Reports(ctx, "a", 0, 0)
	if err != nil {
		t.Fatal(err)
	}
	if len(p.Reports) != 2 || p.Last != 2 || p.Reports[0].Checkpoint != t1.ID || p.Reports[1].Checkpoint != t2.ID ||
		p.Reports[0].Decision != state.ModeFS || p.Reports[1].Decision != state.ModeSkip ||
		p.Reports[0].Report == nil || p.Reports[0].Report.FS.Modified == 0 {
		t.Fatalf("reports: %+v", p)
	}

	// Long poll: the call waits for the next turn.
	got := make(chan error, 1)
	go func() {
		p, err := c.Reports(ctx, "a", 2, time.Minute)
		if err == nil && (len(p.Reports) != 1 || p.Reports[0].Seq != 3) {
			err = errors.New("wrong page after the wait")
		}
		got <- err
	}()
	if _, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full"}); err != nil {
		t.Fatal(err)
	}
	if err := <-got; err != nil {
		t.Fatalf("long poll: %v", err)
	}

	if _, err := c.Reports(ctx, "nope", 0, 0); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}
	hc := &http.Client{Transport: &http.Transport{DialContext: func(ctx context.Context, _, _ string) (net.Conn, error) {
		var d net.Dialer
		return d.DialContext(ctx, "unix", sock)
	}}}
	defer hc.CloseIdleConnections()
	for _, q := range []string{"after=-1", "after=x", "wait_ms=soon", "wait_ms=-1"} {
		resp, err := hc.Get("http://rewind/v1/sandboxes/a/reports?" + q)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		if resp.StatusCode != http.StatusBadRequest {
			t.Errorf("?%s: status %d, want 400", q, resp.StatusCode)
		}
	}
}
