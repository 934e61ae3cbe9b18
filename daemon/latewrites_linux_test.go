package daemon_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
)

// TestRealRestoreDropsLateWrites: processes started after a checkpoint that
// write as fast as they can when the restore kills them — appends through
// write(2) from a shell loop, a multi-threaded writer, and stores into a
// shared file mapping (whose dirty pages the kernel writes back while the
// process exits) — leave nothing in the restored view, neither at once nor
// a moment later. The checkpoint has a shell session, so the restores take
// the template path (with and without a warm spare: they follow each other
// quickly).
func TestRealRestoreDropsLateWrites(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "w"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "w", api.SessionRequest{ID: "sh", Argv: []string{"/bin/bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "w", "sh", "mkdir -p /w && echo base > /w/f && printf AAAAAAAA > /w/m && printf AAAAAAAA > /w/t; echo @@done@@")
	ck, err := c.Turn(ctx, "w", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	const mmapWriter = "import mmap\nf = open('/w/m', 'r+b')\nm = mmap.mmap(f.fileno(), 8)\nwhile True:\n    m[0:8] = b'BBBBBBBB'\n"
	const threadWriter = "import os, threading\ndef w(i):\n    fd = os.open('/w/t', os.O_WRONLY)\n    while True:\n        os.pwrite(fd, b'CCCCCCCC', 0)\nfor i in range(3):\n    threading.Thread(target=w, args=(i,), daemon=True).start()\nw(3)\n"
	epoch := ck.Epoch
	for round := 0; round < 6; round++ {
		send(t, c, "w", "sh", "(while :; do echo late >> /w/f; done) >/dev/null 2>&1 &\n"+
			"/usr/bin/python3 -c \""+mmapWriter+"\" >/dev/null 2>&1 &\n"+
			"/usr/bin/python3 -c \""+threadWriter+"\" >/dev/null 2>&1 &\n"+
			"until grep -q late /w/f && grep -q B /w/m && grep -q C /w/t; do sleep 0.01; done; echo @@done@@")
		r, err := c.Restore(ctx, "w", ck.ID, 0)
		if err != nil {
			t.Fatalf("round %d: restore: %v", round, err)
		}
		if r.Epoch <= epoch {
			t.Fatalf("round %d: epoch %d after %d", round, r.Epoch, epoch)
		}
		epoch = r.Epoch
		check := func(when string) {
			t.Helper()
			got := sh(t, c, "w", "cat /w/f; echo; cat /w/m; echo; cat /w/t")
			if want := "base\n\nAAAAAAAA\nAAAAAAAA"; got != want {
				t.Fatalf("round %d (path %s), %s: restored view %q, want %q", round, r.Path, when, got, want)
			}
		}
		check("at once")
		time.Sleep(300 * time.Millisecond)
		check("300 ms later")
		if got := sh(t, c, "w", "ps -eo comm= 2>/dev/null | grep -c python3 || true"); strings.TrimSpace(got) != "0" {
			t.Fatalf("round %d: %s writers survived the restore", round, got)
		}
	}
}
