package cr

import (
	"fmt"
	"os"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

const bashMarker = "__END__"

func bashChat(t testing.TB, s session, cmd string) string {
	t.Helper()
	return chat(t, s.in, s.out, cmd+"; echo "+bashMarker, bashMarker)
}

func TestTemplateBash(t *testing.T) {
	for _, warm := range []bool{false, true} {
		t.Run(fmt.Sprintf("warm=%v", warm), func(t *testing.T) {
			sb := startSandbox(t, "bash", "--norc", "--noprofile")
			live := session{in: sb.in, out: sb.out}
			dir := t.TempDir()
			x := filepath.Join(dir, "x")
			if err := os.Mkdir(x, 0o755); err != nil {
				t.Fatal(err)
			}
			bashChat(t, live, fmt.Sprintf("cd %s; export V=1; f() { echo fun-$1; }", x))
			e := newEngine(t, Config{Warm: warm, Logger: testLogger()})
			barrier := 0
			ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c1", Barrier: func() error { barrier++; return nil }})
			if err != nil {
				t.Fatal(err)
			}
			if ck.Mode != ModeTemplate || barrier != 1 || len(ck.Procs) != 1 {
				t.Fatalf("checkpoint %+v, barrier ran %d times", ck, barrier)
			}
			// The live shell runs on and changes all three.
			if got := bashChat(t, live, `cd /; export V=2; f() { echo other; }; echo "$PWD $V $(f x)"`); got != "/ 2 other" {
				t.Fatalf("live shell after checkpoint: %q", got)
			}
			stdio, sessions := freshStdio(t, sb)
			switched := false
			res, err := e.Restore(ctxT(t), sb, "c1", RestoreOptions{SwitchFS: func() error { switched = true; return nil }, Stdio: stdio})
			if err != nil {
				t.Fatal(err)
			}
			if !switched || res.Path != "template" || len(res.Procs) != 1 {
				t.Fatalf("restore result %+v switched=%v", res, switched)
			}
			if !dying(ck.Procs[0].PID) {
				st, _ := procState(ck.Procs[0].PID)
				t.Fatalf("old shell %d still alive (state %c)", ck.Procs[0].PID, st)
			}
			s := <-sessions
			want := fmt.Sprintf("%s 1 fun-x", x)
			if got := bashChat(t, s, `echo "$PWD $V $(f x)"`); got != want {
				t.Fatalf("restored shell: %q, want %q", got, want)
			}
			// A second restore gives another independent shell.
			res2, err := e.Restore(ctxT(t), sb, "c1", RestoreOptions{Stdio: stdio})
			if err != nil {
				t.Fatal(err)
			}
			s2 := <-sessions
			if got := bashChat(t, s2, `echo "$PWD $V $(f x)"`); got != want {
				t.Fatalf("second restore: %q, want %q", got, want)
			}
			if res2.Procs[0].PID == res.Procs[0].PID {
				t.Fatal("same pid twice")
			}
			live2, err := e.Processes(sb)
			if err != nil || len(live2) != 1 || live2[0].PID != res2.Procs[0].PID {
				t.Fatalf("live processes after second restore: %+v %v", live2, err)
			}
		})
	}
}

const pyLoop = `
import sys
while True:
    line = sys.stdin.readline()
    if not line:
        break
    try:
        exec(line)
    except Exception as ex:
        print("ERR", ex)
    print("__END__", flush=True)
`

func pyChat(t testing.TB, s session, cmd string) string {
	t.Helper()
	return chat(t, s.in, s.out, cmd, bashMarker)
}

func TestTemplatePython200MB(t *testing.T) {
	sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
	live := session{in: sb.in, out: sb.out}
	pyChat(t, live, "a = [i * 7 for i in range(5_600_000)]; d = {str(i): i * i for i in range(100_000)}")
	const probe = "print(sum(a), len(a), a[123456], len(d), d['777'], d.get('x'))"
	want := pyChat(t, live, probe)
	if want != "109759980400000 5600000 864192 100000 603729 None" {
		t.Fatalf("unexpected baseline %q", want)
	}
	e := newEngine(t, Config{})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "py"}); err != nil {
		t.Fatal(err)
	}
	pyChat(t, live, "a[123456] = -1; del a[100:]; d['x'] = 1; d['777'] = 0")
	if got := pyChat(t, live, probe); got == want {
		t.Fatal("live change not visible")
	}
	stdio, sessions := freshStdio(t, sb)
	if _, err := e.Restore(ctxT(t), sb, "py", RestoreOptions{Stdio: stdio}); err != nil {
		t.Fatal(err)
	}
	if got := pyChat(t, <-sessions, probe); got != want {
		t.Fatalf("restored python: %q, want %q", got, want)
	}
}

// TestTemplateFileOffsets: a file the process reads with its own offset
// (os.read on a descriptor) is read on from the checkpoint's offset after
// every restore, although the live process read on after the checkpoint
// and copies read on after earlier restores; with and without warm spares.
func TestTemplateFileOffsets(t *testing.T) {
	for _, tc := range []struct {
		// otherMount puts the file on a mount that is not the process's
		// root (as a bind-mounted /usr holds the libraries a starting
		// process's dynamic loader opens).
		warm, image, otherMount bool
	}{{false, false, false}, {true, false, false}, {false, true, false}, {true, false, true}, {false, true, true}} {
		warm := tc.warm
		t.Run(fmt.Sprintf("warm=%v/image=%v/other_mount=%v", tc.warm, tc.image, tc.otherMount), func(t *testing.T) {
			dir := t.TempDir()
			if tc.otherMount {
				if err := unix.Mount("tmpfs", dir, "tmpfs", 0, "size=1m"); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { _ = unix.Unmount(dir, unix.MNT_DETACH) })
			}
			data := filepath.Join(dir, "data")
			if err := os.WriteFile(data, []byte("0123456789abcdefghijklmnopqrstuvwxyz"), 0o644); err != nil {
				t.Fatal(err)
			}
			sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
			live := session{in: sb.in, out: sb.out}
			pyChat(t, live, fmt.Sprintf("import os; fd = os.open(%q, os.O_RDONLY); os.read(fd, 5)", data))
			cfg := Config{Warm: warm}
			if tc.image {
				cfg.ImagesDir = t.TempDir()
			}
			e := newEngine(t, cfg)
			// The image is dumped only after the original has moved its
			// offset (the dump runs in the background, any time after
			// the checkpoint).
			moved := make(chan struct{})
			e.beforeDump = func() { <-moved }
			if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c"}); err != nil {
				t.Fatal(err)
			}
			const next = "print(os.read(fd, 5).decode())"
			got := pyChat(t, live, next)
			close(moved)
			if got != "56789" {
				t.Fatalf("live read %q", got)
			}
			if tc.image {
				if err := e.WaitImage(ctxT(t), "c"); err != nil {
					t.Fatal(err)
				}
			}
			for i := range 3 {
				if tc.image {
					// Each restore reads the image: no template is left
					// from the checkpoint or the restore before.
					if err := e.Evict("c"); err != nil {
						t.Fatal(err)
					}
				}
				if warm && !waitUntil(ctxT(t), 30*time.Second, func() bool { return e.SparesReady(sb.ID()) }) {
					t.Fatal("no warm spare")
				}
				stdio, sessions := freshStdio(t, sb)
				if _, err := e.Restore(ctxT(t), sb, "c", RestoreOptions{Stdio: stdio}); err != nil {
					t.Fatal(err)
				}
				s := <-sessions
				if got := pyChat(t, s, next); got != "56789" {
					t.Fatalf("restore %d reads %q after the checkpoint's offset, want 56789", i, got)
				}
				if got := pyChat(t, s, next); got != "abcde" {
					t.Fatalf("restore %d then reads %q, want abcde", i, got)
				}
			}
		})
	}
}
