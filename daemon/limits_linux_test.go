package daemon_test

import (
	"context"
	"errors"
	"strconv"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/state"
)

// TestRealSandboxLimits runs a daemon with --memory-max 64M and
// --pids-max 32: a sandbox's allocation past the limit is killed inside
// the sandbox (the daemon and the next command are fine), and a fork
// bomb stops at the task limit.
func TestRealSandboxLimits(t *testing.T) {
	d := startRealWith(t, t.TempDir(), func(c *daemon.Config) { c.MemoryMax = 64 << 20; c.PidsMax = 32 })
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "lim"}); err != nil {
		t.Fatal(err)
	}
	code, err := c.Exec(ctx, "lim", api.ExecRequest{Argv: []string{"python3", "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); print(len(b))"}}, nil, nil)
	if err != nil || code == 0 {
		t.Fatalf("256 MiB in a sandbox limited to 64 MiB: exit %d, %v; want it killed", code, err)
	}
	if got := sh(t, c, "lim", "echo ok"); got != "ok" {
		t.Fatalf("after the kill: %q", got)
	}
	const bomb = `import os, signal
kids = []
try:
    for i in range(100):
        pid = os.fork()
        if pid == 0:
            signal.pause()
            os._exit(0)
        kids.append(pid)
except OSError:
    pass
print(len(kids))
for k in kids:
    os.kill(k, signal.SIGKILL)
`
	got := sh(t, c, "lim", "python3 -c '"+bomb+"'")
	n, err := strconv.Atoi(got)
	if err != nil || n >= 100 || n < 20 {
		t.Errorf("processes a python could fork under --pids-max 32: %q", got)
	}
}

// TestRealBadCommandIsBadRequest: a command the sandbox cannot start as
// given (a program or working directory it does not have) is the caller's
// mistake, 400, not a failure of the daemon, 500; the sandbox goes on.
func TestRealBadCommandIsBadRequest(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "bc"}); err != nil {
		t.Fatal(err)
	}
	for _, req := range []api.ExecRequest{
		{Argv: []string{"/nonexistent-binary"}},
		{Argv: []string{"no-such-program-anywhere"}},
		{Argv: []string{"true"}, Dir: "/nonexistent"},
		{Argv: []string{"true"}, Dir: "/etc/passwd"},
		{Argv: []string{"/etc"}},
	} {
		if _, err := c.Exec(ctx, "bc", req, nil, nil); !errors.Is(err, state.ErrBadRequest) {
			t.Errorf("exec %v in %q: %v, want a bad request", req.Argv, req.Dir, err)
		}
	}
	if _, err := c.StartSession(ctx, "bc", api.SessionRequest{ID: "s", Argv: []string{"/nonexistent"}}); !errors.Is(err, state.ErrBadRequest) {
		t.Errorf("session of a missing program: %v, want a bad request", err)
	}
	if got := sh(t, c, "bc", "echo ok"); got != "ok" {
		t.Errorf("after the refusals: %q", got)
	}
}
