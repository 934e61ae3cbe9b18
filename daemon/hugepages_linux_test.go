package daemon_test

import (
	"context"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/daemon"
)

// pyHugeLoop runs each line it reads and ends its answer with @@done@@.
const pyHugeLoop = `
import sys
while True:
    line = sys.stdin.readline()
    if not line:
        break
    try:
        exec(line)
    except Exception as ex:
        print("ERR", ex)
    print("@@done@@", flush=True)
`

// TestRealHugePages: through the daemon, a checkpointed Python process's
// heap ends up in huge pages (it reads its own smaps_rollup), its contents
// unchanged and restorable; with --no-huge-pages it stays in small pages.
func TestRealHugePages(t *testing.T) {
	for _, off := range []bool{false, true} {
		t.Run("no-huge-pages="+strconv.FormatBool(off), func(t *testing.T) {
			d := startRealWith(t, t.TempDir(), func(cfg *daemon.Config) { cfg.NoHugePages = off })
			c, ctx := d.c, context.Background()
			if _, err := c.Create(ctx, api.CreateRequest{Name: "py"}); err != nil {
				t.Fatal(err)
			}
			if _, err := c.StartSession(ctx, "py", api.SessionRequest{ID: "p", Argv: []string{"python3", "-u", "-c", pyHugeLoop}}); err != nil {
				t.Fatal(err)
			}
			send(t, c, "py", "p", "buf = bytearray(b'\\x02') * (64 << 20)")
			huge := func() int64 {
				out := send(t, c, "py", "p", "print([l.split()[1] for l in open('/proc/self/smaps_rollup') if l.startswith('AnonHugePages:')][0])")
				kb, err := strconv.ParseInt(strings.TrimSpace(out), 10, 64)
				if err != nil {
					t.Fatalf("AnonHugePages: %q", out)
				}
				return kb << 10
			}
			const probe = "print(len(buf), sum(buf[::4096]))"
			want := send(t, c, "py", "p", probe)
			res, err := c.Turn(ctx, "py", api.TurnRequest{Mode: "full", Wait: true})
			if err != nil {
				t.Fatal(err)
			}
			got := huge()
			for deadline := time.Now().Add(20 * time.Second); !off && got < 44<<20 && time.Now().Before(deadline); got = huge() {
				time.Sleep(50 * time.Millisecond)
			}
			if off {
				time.Sleep(300 * time.Millisecond)
				if got = huge(); got != 0 {
					t.Fatalf("--no-huge-pages: %d MiB in huge pages", got>>20)
				}
			} else if got < 44<<20 {
				t.Fatalf("%d MiB of the 64 MiB heap in huge pages after a checkpoint, want >= 44", got>>20)
			}
			if out := send(t, c, "py", "p", probe); out != want {
				t.Fatalf("live after the checkpoint: %q, want %q", out, want)
			}
			send(t, c, "py", "p", "buf[0] = 9; buf = buf[:10]")
			if _, err := c.Restore(ctx, "py", res.ID, 0); err != nil {
				t.Fatal(err)
			}
			if out := send(t, c, "py", "p", probe); out != want {
				t.Fatalf("restored: %q, want %q", out, want)
			}
		})
	}
}
