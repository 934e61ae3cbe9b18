package cr

import (
	"errors"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/sandbox"
)

// A TTY session (bash on a pseudo-terminal of the sandbox's devpts)
// restores from its template (with pipes as stdio, like any copy), gets no
// CRIU image, which CRIU could not restore, and says so: the checkpoint's
// image part names the terminal, and a restore without the template fails
// with that reason instead of a CRIU error.
func TestTTYSessionHasNoImage(t *testing.T) {
	needCRIU(t)
	sb := startReal(t)
	ctx := ctxT(t)
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/", TTY: true}); err != nil {
		t.Fatal(err)
	}
	send := func(cmd string) string {
		t.Helper()
		out, err := sb.Session("main").Send(ctx, cmd, sandbox.SendOptions{})
		if err != nil {
			t.Fatalf("send %q: %v", cmd, err)
		}
		return strings.TrimSpace(out)
	}
	send("export V=tty")
	ck, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c"})
	if err != nil || ck.Mode != ModeTemplate {
		t.Fatalf("checkpoint %+v %v", ck, err)
	}
	if err := e.WaitImage(ctx, "c"); !errors.Is(err, errTerminal) {
		t.Fatalf("image of a TTY session: %v, want %v", err, errTerminal)
	}
	if parts, _ := e.Parts("c"); parts.Image || !parts.Template || !errors.Is(parts.ImageErr, errTerminal) {
		t.Fatalf("parts %+v", parts)
	}
	res, err := e.Restore(ctx, sb, "c", RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")})
	if err != nil || res.Path != "template" {
		t.Fatalf("restore %+v %v", res, err)
	}
	// Readline still echoes the line and prompts, now on the pipes.
	if got := send("echo $V"); !strings.Contains(got, "\rtty\n") && got != "tty" {
		t.Fatalf("restored V=%q", got)
	}
	if err := e.Evict("c"); err != nil {
		t.Fatal(err)
	}
	_, err = e.Restore(ctx, sb, "c", RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")})
	if !errors.Is(err, ErrUnknown) || !strings.Contains(err.Error(), "terminal") {
		t.Fatalf("restore without template or image: %v", err)
	}
}

// A TTY session that needs the CRIU path (a process tree) cannot be
// checkpointed: the checkpoint fails at once, saying why, and the session
// runs on untouched.
func TestTTYTreeCheckpointFails(t *testing.T) {
	needCRIU(t)
	sb := startReal(t)
	ctx := ctxT(t)
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/", TTY: true}); err != nil {
		t.Fatal(err)
	}
	send := func(cmd string) string {
		t.Helper()
		out, err := sb.Session("main").Send(ctx, cmd, sandbox.SendOptions{})
		if err != nil {
			t.Fatalf("send %q: %v", cmd, err)
		}
		return out
	}
	send("sleep 1000 &")
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c"}); !errors.Is(err, errTerminal) {
		t.Fatalf("checkpoint of a TTY process tree: %v, want %v", err, errTerminal)
	}
	if got := send("echo alive-$((6*7))"); !strings.Contains(got, "alive-42") {
		t.Fatalf("session after the failed checkpoint: %q", got)
	}
}
