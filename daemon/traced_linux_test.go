package daemon_test

import (
	"context"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
)

// tracer is a program a sandbox's agent could run: it seizes the process
// whose pid it is given with ptrace (as `strace -p` does) and holds it.
const tracer = `import ctypes, sys, time
libc = ctypes.CDLL(None, use_errno=True)
if libc.ptrace(0x4206, int(sys.argv[1]), None, None) != 0:
    print("seize failed", ctypes.get_errno(), flush=True)
    sys.exit(1)
print("tracing", flush=True)
time.sleep(1000)
`

// TestRealRestoreWithoutUndoPoint: a process of the sandbox traced by
// another (the agent ran `strace -p $$`) cannot be seized, so the state a
// restore leaves cannot be saved as its undo point. The restore must still
// bring the checkpoint back (it used to fail, and with it every later
// restore and turn, until the tracer went), say that it went on without
// an undo point, and leave the sandbox usable.
func TestRealRestoreWithoutUndoPoint(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "tr"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "tr", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "tr", "sh", `export V=1; echo one > /tmp/f; echo @@done@@`)
	ck, err := c.Turn(ctx, "tr", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil || !ck.Durable {
		t.Fatalf("checkpoint: %+v, %v", ck, err)
	}
	sh(t, c, "tr", "cat > /tmp/tracer.py <<'EOF'\n"+tracer+"EOF")
	send(t, c, "tr", "sh", `export V=2; echo two > /tmp/f; python3 /tmp/tracer.py $$ > /tmp/tracer.out 2>&1 & echo @@done@@`)
	var out string
	for i := 0; i < 100 && !strings.Contains(out, "tracing"); i++ {
		out = sh(t, c, "tr", "sleep 0.05; cat /tmp/tracer.out")
		if strings.Contains(out, "failed") {
			t.Fatalf("tracer: %s", out)
		}
	}
	if !strings.Contains(out, "tracing") {
		t.Fatalf("the tracer did not start: %q", out)
	}
	r, err := c.Restore(ctx, "tr", ck.ID, 0)
	if err != nil {
		t.Fatalf("restore while a process is traced: %v", err)
	}
	if r.Phases.Undo != "none" {
		t.Errorf("restore's undo = %q, want none (the traced state cannot be saved)", r.Phases.Undo)
	}
	if got := send(t, c, "tr", "sh", `echo "$V $(cat /tmp/f)"; echo @@done@@`); got != "1 one" {
		t.Errorf("after the restore: %q, want the checkpoint's \"1 one\"", got)
	}
	if got := sh(t, c, "tr", "pgrep -f tracer[.]py || echo none"); got != "none" {
		t.Errorf("the tracer survived the restore: %s", got)
	}
	// The sandbox goes on: turns and restores work again.
	send(t, c, "tr", "sh", `export V=3; echo @@done@@`)
	if _, err := c.Turn(ctx, "tr", api.TurnRequest{Mode: "full", Wait: true}); err != nil {
		t.Fatalf("turn after the restore: %v", err)
	}
	if _, err := c.Restore(ctx, "tr", ck.ID, 0); err != nil {
		t.Fatalf("second restore: %v", err)
	}
	if got := send(t, c, "tr", "sh", `echo "$V"; echo @@done@@`); got != "1" {
		t.Errorf("after the second restore: %q", got)
	}
}
