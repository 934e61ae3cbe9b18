package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/state"
)

// startFake runs a daemon with in-memory back ends and returns a client.
func startFake(t testing.TB) (*client.Client, string) {
	t.Helper()
	dir := t.TempDir()
	sock := filepath.Join(dir, "run", "rewind.sock")
	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	done := make(chan error, 1)
	go func() {
		done <- daemon.Run(ctx, daemon.Config{
			StateDir: filepath.Join(dir, "state"), Socket: sock, Backend: "fake",
			Logger: slog.New(slog.DiscardHandler), Ready: func() { close(ready) },
		})
	}()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("daemon: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("daemon did not start")
	}
	c := client.New(sock)
	t.Cleanup(func() {
		c.Close()
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("daemon shutdown: %v", err)
			}
		case <-time.After(30 * time.Second):
			t.Error("daemon did not shut down")
		}
	})
	return c, sock
}

func execOut(t *testing.T, c *client.Client, name string, argv ...string) string {
	t.Helper()
	var out bytes.Buffer
	code, err := c.Exec(context.Background(), name, api.ExecRequest{Argv: argv}, &out, &out)
	if err != nil || code != 0 {
		t.Fatalf("exec %v: code %d err %v out %q", argv, code, err, out.String())
	}
	return strings.TrimSpace(out.String())
}

func TestAPIEndToEndFake(t *testing.T) {
	c, sock := startFake(t)
	ctx := context.Background()

	st, err := os.Stat(sock)
	if err != nil || st.Mode().Perm() != 0o600 {
		t.Fatalf("socket mode: %v %v", st.Mode(), err)
	}
	// The state dir is recorded beside the socket, for a client that
	// finds no daemon there later (cmd/rewind's autostart).
	if b, err := os.ReadFile(api.StateRecord(sock)); err != nil || strings.TrimSpace(string(b)) != filepath.Join(filepath.Dir(filepath.Dir(sock)), "state") {
		t.Fatalf("state record beside the socket: %q %v", b, err)
	}
	if dst, _ := os.Stat(filepath.Dir(sock)); dst.Mode().Perm() != 0o700 {
		t.Fatalf("socket dir mode %v", dst.Mode())
	}
	v, err := c.Version(ctx)
	if err != nil || v.API != "v1" || v.Backends["fs"] != "fake" {
		t.Fatalf("version: %+v %v", v, err)
	}
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); !errors.Is(err, state.ErrExists) {
		t.Fatalf("duplicate create: %v", err)
	}
	execOut(t, c, "a", "write", "/f", "one")
	var out bytes.Buffer
	code, err := c.Exec(ctx, "a", api.ExecRequest{Argv: []string{"exit", "3"}}, &out, &out)
	if err != nil || code != 3 {
		t.Fatalf("exit code: %d %v", code, err)
	}
	t1, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil || t1.Decision != state.ModeFull || t1.ID == "" || t1.ElapsedUS <= 0 || !t1.Durable {
		t.Fatalf("turn: %+v %v", t1, err)
	}
	t2, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "skip"})
	if err != nil || t2.ID != t1.ID {
		t.Fatalf("skip: %+v %v", t2, err)
	}
	execOut(t, c, "a", "write", "/f", "two")
	t3, err := c.Checkpoint(ctx, "a", false, 0)
	if err != nil || t3.Decision != state.ModeFull {
		t.Fatalf("checkpoint: %+v %v", t3, err)
	}
	r, err := c.Restore(ctx, "a", t1.ID, 0)
	if err != nil || r.Path != "template" || r.Epoch != t1.Epoch+1 {
		t.Fatalf("restore: %+v %v", r, err)
	}
	if got := execOut(t, c, "a", "cat", "/f"); got != "one" {
		t.Fatalf("after restore /f = %q", got)
	}
	// Stale epoch over the API.
	if _, err := c.Exec(ctx, "a", api.ExecRequest{Argv: []string{"echo"}, Epoch: t1.Epoch}, nil, nil); !errors.Is(err, state.ErrStaleEpoch) {
		t.Fatalf("stale exec: %v", err)
	}
	if _, err := c.Restore(ctx, "a", t3.ID, t1.Epoch); !errors.Is(err, state.ErrStaleEpoch) {
		t.Fatalf("stale restore: %v", err)
	}
	// Sessions.
	if id, err := c.StartSession(ctx, "a", api.SessionRequest{ID: "sh", Argv: []string{"bash"}}); err != nil || id != "sh" {
		t.Fatalf("session: %q %v", id, err)
	}
	if o, err := c.Send(ctx, "a", "sh", api.SendRequest{Text: "echo hi"}); err != nil || o != "hi\n" {
		t.Fatalf("send: %q %v", o, err)
	}
	if _, err := c.StartSession(ctx, "a", api.SessionRequest{ID: "py", Argv: []string{"python3"}}); err != nil {
		t.Fatal(err)
	}
	if ids, err := c.Sessions(ctx, "a"); err != nil || !slices.Equal(ids, []string{"py", "sh"}) {
		t.Fatalf("sessions: %q %v", ids, err)
	}
	if err := c.StopSession(ctx, "a", "py", t1.Epoch); !errors.Is(err, state.ErrStaleEpoch) {
		t.Fatalf("stop a session with a stale epoch: %v", err)
	}
	if err := c.StopSession(ctx, "a", "nope", 0); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("stop an unknown session: %v", err)
	}
	if err := c.StopSession(ctx, "a", "py", 0); err != nil {
		t.Fatalf("stop session: %v", err)
	}
	if ids, err := c.Sessions(ctx, "a"); err != nil || !slices.Equal(ids, []string{"sh"}) {
		t.Fatalf("sessions after a stop: %q %v", ids, err)
	}
	if _, err := c.Send(ctx, "a", "py", api.SendRequest{Text: "1"}); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("send to a stopped session: %v", err)
	}
	// Log.
	l, err := c.Log(ctx, "a")
	if err != nil || len(l.Checkpoints) != 2 || l.Sandbox.Head != t1.ID {
		t.Fatalf("log: %+v %v", l, err)
	}
	// Fork.
	f, err := c.Fork(ctx, t1.ID, api.ForkRequest{Count: 3, Prefix: "r"})
	if err != nil || len(f.Sandboxes) != 3 {
		t.Fatalf("fork: %+v %v", f, err)
	}
	for i, n := range f.Sandboxes {
		if got := execOut(t, c, n, "cat", "/run/rewind/copy"); got != string(rune('1'+i)) {
			t.Fatalf("%s copy = %q", n, got)
		}
	}
	// Pins and GC: t3 is unreachable once a is back on t1 and not pinned.
	if pins, err := c.Pin(ctx, []string{t1.ID}); err != nil || len(pins) != 1 {
		t.Fatalf("pin: %v %v", pins, err)
	}
	dry, err := c.GC(ctx, true)
	if err != nil || len(dry.Freed) != 1 || dry.Freed[0] != t3.ID {
		t.Fatalf("gc dry run: %+v %v", dry, err)
	}
	if _, err := c.GetCheckpoint(ctx, t3.ID); err != nil {
		t.Fatalf("dry run freed something: %v", err)
	}
	g, err := c.GC(ctx, false)
	if err != nil || len(g.Freed) != 1 {
		t.Fatalf("gc: %+v %v", g, err)
	}
	if _, err := c.GetCheckpoint(ctx, t3.ID); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("freed checkpoint still there: %v", err)
	}
	if pins, err := c.Unpin(ctx, []string{t1.ID}); err != nil || len(pins) != 0 {
		t.Fatalf("unpin: %v %v", pins, err)
	}
	// Metrics.
	m, err := c.Metrics(ctx)
	if err != nil {
		t.Fatal(err)
	}
	for _, want := range []string{
		`rewind_checkpoint_seconds_bucket{kind="full"`, `rewind_restore_seconds_count{path="template"} 1`,
		"rewind_gc_freed_checkpoints_total 1", `rewind_turn_call_seconds_count{decision="skip"} 1`,
		"rewind_checkpoint_frozen_seconds", "rewind_sandboxes 4", "rewind_fork_seconds_count 1",
	} {
		if !strings.Contains(m, want) {
			t.Errorf("metrics lack %q", want)
		}
	}
	// Removal and errors.
	if err := c.Remove(ctx, "r2"); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Get(ctx, "r2"); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("get removed: %v", err)
	}
	if _, err := c.Turn(ctx, "nope", api.TurnRequest{}); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("unknown sandbox: %v", err)
	}
	if _, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "weird"}); !errors.Is(err, state.ErrBadRequest) {
		t.Fatalf("bad mode: %v", err)
	}
}

func TestNoDaemon(t *testing.T) {
	c := client.New(filepath.Join(t.TempDir(), "none.sock"))
	if _, err := c.Version(context.Background()); !errors.Is(err, client.ErrNoDaemon) {
		t.Fatalf("no daemon: %v", err)
	}
}

func TestSecondDaemonRefused(t *testing.T) {
	_, sock := startFake(t)
	err := daemon.Run(context.Background(), daemon.Config{StateDir: t.TempDir(), Socket: sock, Backend: "fake", Logger: slog.New(slog.DiscardHandler)})
	if err == nil || !strings.Contains(err.Error(), "already listens") {
		t.Fatalf("second daemon on the same socket: %v", err)
	}
}
