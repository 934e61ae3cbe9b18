package daemon_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
)

// warmForks reads the daemon's prepared fork children of checkpoint id.
func warmForks(t *testing.T, c *client.Client, id string) int {
	t.Helper()
	text, err := c.Metrics(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(text, "\n") {
		if v, ok := strings.CutPrefix(l, `rewind_warm_forks{checkpoint="`+id+`"} `); ok {
			n, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
			return int(n)
		}
	}
	return 0
}

// A repeated fork of a persistent bash hands out children prepared in the
// background: each has the checkpoint's shell state, its own copy number
// and its own files.
func TestRealForkPrepared(t *testing.T) {
	d := startRealWith(t, t.TempDir(), func(c *daemon.Config) { c.WarmForks = 3 })
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "src"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "src", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "src", "sh", `mkdir -p /proj && cd /proj && export V=42 && echo shared > f; echo @@done@@`)
	ck, err := c.Turn(ctx, "src", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.Fork(ctx, ck.ID, api.ForkRequest{Count: 3, Prefix: "a"}); err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(2 * time.Minute)
	for warmForks(t, c, ck.ID) < 3 {
		if time.Now().After(deadline) {
			t.Fatalf("only %d children of %s prepared", warmForks(t, c, ck.ID), ck.ID)
		}
		time.Sleep(50 * time.Millisecond)
	}
	f, err := c.Fork(ctx, ck.ID, api.ForkRequest{Count: 3, Prefix: "b"})
	if err != nil {
		t.Fatal(err)
	}
	for i, n := range f.Sandboxes {
		// (CRIU's cache, put in for the restore, is gone again.)
		want := "/proj 42 " + strconv.Itoa(i+1) + " " + n + " shared no-kdat"
		if got := send(t, c, n, "sh", `echo "$PWD $V $(cat /run/rewind/copy) $(cat /run/rewind/sandbox) $(cat f) $(test -e /run/criu.kdat && echo kdat || echo no-kdat)"; echo @@done@@`); got != want {
			t.Fatalf("%s: %q, want %q", n, got, want)
		}
	}
	// A prepare request makes no sandbox and is bounded by --warm-forks.
	p, err := c.Fork(ctx, ck.ID, api.ForkRequest{Count: 8, Prepare: true})
	if err != nil || p.Prepared != 3 || len(p.Sandboxes) != 0 {
		t.Fatalf("prepare: %+v %v", p, err)
	}
	send(t, c, "b1", "sh", `echo mine > f; echo @@done@@`)
	for _, n := range []string{"b2", "b3", "a1", "src"} {
		if got := sh(t, c, n, "cat /proj/f"); got != "shared" {
			t.Fatalf("%s sees b1's write: %q", n, got)
		}
	}
	// Each child sees only its own processes: one init, one shell.
	if got := sh(t, c, "b2", `grep -lx bash /proc/[0-9]*/comm | wc -l; grep -lx rewind-init /proc/[0-9]*/comm`); got != "1\n/proc/1/comm" {
		t.Fatalf("b2 sees processes %q", got)
	}
}
