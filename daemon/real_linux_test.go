package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/state"
)

// realDaemon runs a daemon with the real back ends on a private state dir.
type realDaemon struct {
	t      *testing.T
	dir    string
	sock   string
	cancel context.CancelFunc
	done   chan error
	c      *client.Client
}

func startReal(t *testing.T, dir string) *realDaemon {
	t.Helper()
	return startRealWith(t, dir, nil)
}

// startRealWith is startReal with a hook to change the daemon's config.
func startRealWith(t *testing.T, dir string, edit func(*daemon.Config)) *realDaemon {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.Require(t, err == nil, "/dev/fuse")
	d := &realDaemon{t: t, dir: dir, sock: filepath.Join(dir, "run", "rewind.sock"), done: make(chan error, 1)}
	ctx, cancel := context.WithCancel(context.Background())
	d.cancel = cancel
	ready := make(chan struct{})
	log := slog.New(slog.NewTextHandler(testWriter{t}, &slog.HandlerOptions{Level: slog.LevelWarn}))
	cfg := daemon.Config{
		StateDir: filepath.Join(dir, "state"), Socket: d.sock, Backend: "real", DefaultPolicy: "effects",
		// As `rewind daemon` by default: sandboxes and fork children
		// start on spare inits while there are some.
		SpareInits: 2,
		Logger:     log, Ready: func() { close(ready) },
	}
	if edit != nil {
		edit(&cfg)
	}
	go func() { d.done <- daemon.Run(ctx, cfg) }()
	select {
	case <-ready:
	case err := <-d.done:
		t.Fatalf("daemon: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("daemon did not start")
	}
	d.c = client.New(d.sock)
	t.Cleanup(d.stop)
	return d
}

func (d *realDaemon) stop() {
	if d.cancel == nil {
		return
	}
	d.c.Close()
	d.cancel()
	d.cancel = nil
	select {
	case err := <-d.done:
		if err != nil {
			d.t.Errorf("daemon shutdown: %v", err)
		}
	case <-time.After(60 * time.Second):
		d.t.Error("daemon did not shut down")
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(strings.TrimSpace(string(p)))
	return len(p), nil
}

func sh(t *testing.T, c *client.Client, name, script string) string {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := c.Exec(context.Background(), name, api.ExecRequest{Argv: []string{"sh", "-c", script}}, &out, &errb)
	if err != nil || code != 0 {
		t.Fatalf("exec %q: code %d err %v stdout %q stderr %q", script, code, err, out.String(), errb.String())
	}
	return strings.TrimSpace(out.String())
}

func send(t *testing.T, c *client.Client, name, sess, text string) string {
	t.Helper()
	out, err := c.Send(context.Background(), name, sess, api.SendRequest{Text: text, Until: "@@done@@", TimeoutMS: 30000})
	if err != nil {
		t.Fatalf("send %q: %v (output %q)", text, err, out)
	}
	return strings.TrimSpace(strings.ReplaceAll(out, "@@done@@", ""))
}

func TestRealFilesRestoreAndFork(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); err != nil {
		t.Fatal(err)
	}
	// The host's root is the base, read-only to the host: writes stay inside.
	if got := sh(t, c, "a", "test -x /bin/sh && echo host-root"); got != "host-root" {
		t.Fatalf("base: %q", got)
	}
	sh(t, c, "a", "mkdir -p /work && echo one > /work/f")
	t1, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, c, "a", "echo two > /work/f && echo new > /work/g")
	if _, err := os.Stat("/work/g"); err == nil {
		t.Fatal("a sandbox write reached the host")
	}
	t2, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "fs", Wait: true})
	if err != nil || t2.Decision != state.ModeFS {
		t.Fatalf("fs turn: %+v %v", t2, err)
	}
	r, err := c.Restore(ctx, "a", t1.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if got := sh(t, c, "a", "cat /work/f; test -e /work/g && echo g-exists || echo no-g"); got != "one\nno-g" {
		t.Fatalf("after restore to %s: %q", t1.ID, got)
	}
	if _, err := c.Exec(ctx, "a", api.ExecRequest{Argv: []string{"true"}, Epoch: t1.Epoch}, nil, nil); !errors.Is(err, state.ErrStaleEpoch) {
		t.Fatalf("stale epoch: %v", err)
	}
	if _, err := c.Restore(ctx, "a", t2.ID, r.Epoch); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, c, "a", "cat /work/f /work/g"); got != "two\nnew" {
		t.Fatalf("after restore to %s: %q", t2.ID, got)
	}
	// The daemon's state is not visible inside.
	if got := sh(t, c, "a", "ls -A "+d.dir+"/state 2>/dev/null | wc -l"); got != "0" {
		t.Fatalf("state dir visible inside the sandbox: %s entries", got)
	}
	// Fork isolation (files only: a checkpoint with no processes).
	f, err := c.Fork(ctx, t2.ID, api.ForkRequest{Count: 2, Prefix: "k"})
	if err != nil {
		t.Fatalf("fork: %v", err)
	}
	for i, n := range f.Sandboxes {
		if got := sh(t, c, n, "cat /run/rewind/copy /work/f"); got != string(rune('1'+i))+"\ntwo" {
			t.Fatalf("%s: %q", n, got)
		}
	}
	// A fork child's mount negotiates smaller requests (forkMaxIO) than
	// a sandbox made from its base.
	const rootMaxRead = `awk '$5 == "/" { print $NF }' /proc/self/mountinfo | tr , '\n' | grep '^max_read='`
	if got := sh(t, c, "a", rootMaxRead); got != "max_read=1048576" {
		t.Errorf("a's root: %q", got)
	}
	if got := sh(t, c, "k1", rootMaxRead); got != "max_read=262144" {
		t.Errorf("fork child k1's root: %q", got)
	}
	sh(t, c, "k1", "echo mine > /work/f")
	if got := sh(t, c, "k2", "cat /work/f"); got != "two" {
		t.Fatalf("k2 sees k1's write: %q", got)
	}
	if got := sh(t, c, "a", "cat /work/f"); got != "two" {
		t.Fatalf("a sees k1's write: %q", got)
	}
}

func TestRealPersistentBash(t *testing.T) {
	for _, tc := range []struct {
		name, setup, undo, check, want string
	}{
		{"template", `mkdir -p /proj && cd /proj && export V=42 && greet() { echo "hi $1"; }; echo @@done@@`,
			`cd / && V=0 && unset -f greet; echo @@done@@`, `echo "$PWD $V"; greet you; echo @@done@@`, "/proj 42\nhi you"},
		{"criu with a background job", `mkdir -p /proj && cd /proj && export V=42 && greet() { echo "hi $1"; }; sleep 1000 & echo @@done@@`,
			`cd / && V=0 && unset -f greet && kill %1; wait; echo @@done@@`, `echo "$PWD $V"; greet you; jobs | grep -c sleep; echo @@done@@`, "/proj 42\nhi you\n1"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			persistentBash(t, tc.setup, tc.undo, tc.check, tc.want)
		})
	}
}

func persistentBash(t *testing.T, setup, undo, check, want string) {
	dir := t.TempDir()
	if k := os.Getenv("REWIND_KEEP_TEST_STATE"); k != "" {
		dir = k
	}
	d := startReal(t, dir)
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "b"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "b", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "b", "sh", setup)
	t1, err := c.Turn(ctx, "b", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	if !t1.Durable {
		t.Fatalf("checkpoint not durable: %+v", t1)
	}
	send(t, c, "b", "sh", undo)
	if got := send(t, c, "b", "sh", `echo "$PWD $V"; echo @@done@@`); got != "/ 0" {
		t.Fatalf("before restore: %q", got)
	}
	r, err := c.Restore(ctx, "b", t1.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("restore path %s in %d µs", r.Path, r.ElapsedUS)
	got := send(t, c, "b", "sh", check)
	if got != want {
		t.Fatalf("bash after restore: %q", got)
	}
}

func TestRealPythonHeapAndFork(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "py"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "py", api.SessionRequest{ID: "repl", Argv: []string{"python3", "-i", "-q"}}); err != nil {
		t.Fatal(err)
	}
	py := func(sb, line string) string {
		t.Helper()
		out, err := c.Send(ctx, sb, "repl", api.SendRequest{Text: line + "; print('@@done@@')", Until: "@@done@@", TimeoutMS: 30000})
		if err != nil {
			t.Fatalf("%s: send %q: %v (%q)", sb, line, err, out)
		}
		out = strings.ReplaceAll(out, ">>> ", "")
		return strings.TrimSpace(strings.ReplaceAll(out, "@@done@@", ""))
	}
	if got := py("py", "import random; heap = {i: str(i) * 100 for i in range(20000)}; heap['who'] = 'original'; print(len(heap))"); got != "20001" {
		t.Fatalf("python setup: %q", got)
	}
	ck, err := c.Turn(ctx, "py", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	py("py", "heap.clear(); heap['who'] = 'changed'")
	// The checkpoint's template keeps the heap the live interpreter has
	// now freed: its pages are the template's own, and the usage says so.
	u, err := c.Usage(ctx, "py")
	if err != nil {
		t.Fatal(err)
	}
	if u.Checkpoints != 1 || u.Templates < 1 || u.TemplateBytes < 1<<20 || u.ProcBytes < 1<<20 {
		t.Fatalf("usage after the heap changed: %+v (want a template of at least 1 MiB of its own, and the image)", u)
	}
	t.Logf("usage: %+v", u)
	r, err := c.Restore(ctx, "py", ck.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if ckr, err := c.GetCheckpoint(ctx, ck.ID); err == nil && ckr.Proc != nil {
		t.Logf("restored via %s; checkpoint: %d processes, mode %s, template %v, image %v", r.Path, ckr.Proc.Processes, ckr.Proc.Data["mode"], ckr.Proc.TemplateReady, ckr.Proc.ImageReady)
	}
	if got := py("py", "print(len(heap), heap['who'], heap[19999][:5])"); got != "20001 original 19999" {
		t.Fatalf("python heap after restore: %q", got)
	}
	// Fork: each rollout has its own copy of the interpreter.
	f, err := c.Fork(ctx, ck.ID, api.ForkRequest{Count: 2, Prefix: "roll"})
	if err != nil {
		if ckr, gerr := c.GetCheckpoint(ctx, ck.ID); gerr == nil {
			b, _ := os.ReadFile(filepath.Join(d.dir, "state", "layers", "meta", "checkpoints", ckr.FS+".json"))
			t.Logf("fs checkpoint %s: %s", ckr.FS, b)
			ents, _ := os.ReadDir(filepath.Join(d.dir, "state", "layers", "meta", "checkpoints"))
			for _, e := range ents {
				b, _ := os.ReadFile(filepath.Join(d.dir, "state", "layers", "meta", "checkpoints", e.Name()))
				t.Logf("  %s", b)
			}
			b, _ = os.ReadFile(filepath.Join(d.dir, "state", "layers", "meta", "mounts", "journal"))
			t.Logf("mount journal: %s", b)
			ents, _ = os.ReadDir(filepath.Join(d.dir, "state", "layers", "meta", "mounts"))
			for _, e := range ents {
				b, _ := os.ReadFile(filepath.Join(d.dir, "state", "layers", "meta", "mounts", e.Name()))
				t.Logf("  mount %s: %s", e.Name(), b)
			}
		}
		t.Fatalf("fork: %v", err)
	}
	for i, n := range f.Sandboxes {
		py(n, "heap['who'] = open('/run/rewind/copy').read().strip()")
		if got := py(n, "print(heap['who'], len(heap))"); got != string(rune('1'+i))+" 20001" {
			t.Fatalf("%s: %q", n, got)
		}
	}
	if got := py("py", "print(heap['who'])"); got != "original" {
		t.Fatalf("source after its rollouts changed their copies: %q", got)
	}
}

// TestRealRacingRestores: two restores carrying the same epoch race; one
// wins, the other is rejected as stale, and the sandbox is consistent.
func TestRealRacingRestores(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "r"}); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for _, v := range []string{"a", "b"} {
		sh(t, c, "r", "echo "+v+" > /f")
		ck, err := c.Turn(ctx, "r", api.TurnRequest{Mode: "full", Wait: true})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ck.ID)
	}
	sb, _ := c.Get(ctx, "r")
	errs := make(chan error, 2)
	for _, id := range ids {
		go func() { _, err := c.Restore(ctx, "r", id, sb.Epoch); errs <- err }()
	}
	var stale, ok int
	for range 2 {
		err := <-errs
		switch {
		case err == nil:
			ok++
		case errors.Is(err, state.ErrStaleEpoch):
			stale++
		default:
			t.Fatalf("racing restore: %v", err)
		}
	}
	if ok != 1 || stale != 1 {
		t.Fatalf("racing restores: %d succeeded, %d stale", ok, stale)
	}
	after, _ := c.Get(ctx, "r")
	want := map[string]string{ids[0]: "a", ids[1]: "b"}[after.Head]
	if got := sh(t, c, "r", "cat /f"); got != want || after.Epoch != sb.Epoch+1 {
		t.Fatalf("after the race: head %s epoch %d, /f = %q (want %q)", after.Head, after.Epoch, got, want)
	}
}

// TestRealGC: GC through the API frees exactly the unreachable branch,
// restores of what it kept still work, and freed ids are clear errors.
func TestRealGC(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "g"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "g", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc"}}); err != nil {
		t.Fatal(err)
	}
	var ids []string
	for i, v := range []string{"root", "keep", "drop1", "drop2"} {
		sh(t, c, "g", "echo "+v+" > /f")
		mode := "full"
		if i%2 == 1 {
			mode = "fs"
		}
		ck, err := c.Turn(ctx, "g", api.TurnRequest{Mode: mode, Wait: true})
		if err != nil {
			t.Fatal(err)
		}
		ids = append(ids, ck.ID)
	}
	if _, err := c.Pin(ctx, []string{ids[1]}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.Restore(ctx, "g", ids[0], 0); err != nil {
		t.Fatal(err)
	}
	res, err := c.GC(ctx, false)
	if err != nil || len(res.Errors) > 0 {
		t.Fatalf("gc: %+v %v", res, err)
	}
	freed := map[string]bool{}
	for _, id := range res.Freed {
		freed[id] = true
	}
	if len(freed) != 2 || !freed[ids[2]] || !freed[ids[3]] {
		t.Fatalf("gc freed %v, want %v", res.Freed, ids[2:])
	}
	if _, err := c.Restore(ctx, "g", ids[3], 0); !errors.Is(err, state.ErrNotFound) {
		t.Fatalf("restore of a freed checkpoint: %v", err)
	}
	if _, err := c.Restore(ctx, "g", ids[1], 0); err != nil {
		t.Fatalf("restore of the pinned checkpoint: %v", err)
	}
	if got := sh(t, c, "g", "cat /f"); got != "keep" {
		t.Fatalf("/f = %q", got)
	}
	m, err := c.Metrics(ctx)
	if err != nil || !strings.Contains(m, "rewind_gc_freed_checkpoints_total 2") || !strings.Contains(m, "rewind_template_pool_templates") {
		t.Fatalf("metrics after gc: %v", err)
	}
}

// TestRealKernelPathChoice: --fs kernel either works (patched kernel) or
// is refused with a clear error and leaves nothing behind.
func TestRealKernelPathChoice(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	_, err := c.Create(ctx, api.CreateRequest{Name: "k", FS: "kernel"})
	if err != nil {
		if !strings.Contains(err.Error(), "--fs fuse") {
			t.Fatalf("kernel path refused without a clear reason: %v", err)
		}
		if _, gerr := c.Get(ctx, "k"); !errors.Is(gerr, state.ErrNotFound) {
			t.Fatalf("a refused create left a sandbox: %v", gerr)
		}
		t.Logf("kernel path refused here: %v", err)
		return
	}
	sh(t, c, "k", "echo x > /f")
	ck, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, c, "k", "echo y > /f")
	if _, err := c.Restore(ctx, "k", ck.ID, 0); err != nil {
		t.Fatal(err)
	}
	if got := sh(t, c, "k", "cat /f"); got != "x" {
		t.Fatalf("kernel path restore: %q", got)
	}
}

// A file the shell holds open off the sandbox's root mount (here on its
// /dev/shm tmpfs) is read on from the checkpoint's offset after a restore,
// whatever the shell read after the checkpoint: the restored shell does not
// share the killed original's file description.
func TestRealRestoreKeepsOffsetsOffTheRootMount(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "b"}); err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "b", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
		t.Fatal(err)
	}
	if got := send(t, c, "b", "sh", `printf 0123456789abcdefghij > /dev/shm/f && exec 3< /dev/shm/f && read -r -n 5 x <&3; echo "$x"; echo @@done@@`); got != "01234" {
		t.Fatalf("first read %q", got)
	}
	if mnt := sh(t, c, "b", `stat -c %m /dev/shm/f`); mnt == "/" {
		t.Fatalf("/dev/shm is on the root mount here: the test needs another mount")
	}
	t1, err := c.Turn(ctx, "b", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	const next = `read -r -n 5 x <&3; echo "$x"; echo @@done@@`
	if got := send(t, c, "b", "sh", next); got != "56789" {
		t.Fatalf("live read after the checkpoint %q", got)
	}
	for i := range 2 {
		r, err := c.Restore(ctx, "b", t1.ID, 0)
		if err != nil {
			t.Fatal(err)
		}
		if got := send(t, c, "b", "sh", next); got != "56789" {
			t.Fatalf("restore %d (path %s) reads %q, want 56789 (the checkpoint's offset)", i, r.Path, got)
		}
		if got := send(t, c, "b", "sh", next); got != "abcde" {
			t.Fatalf("restore %d (path %s) then reads %q, want abcde", i, r.Path, got)
		}
	}
}

// TestRealRestoreReopensFilesInTheRestoredView: a shell holding descriptors
// on files of the sandbox's root view, one appending and one reading, is
// restored twice. After each restore the descriptors must be on the
// checkpoint's files: what the shell appends through its descriptor lands
// in the view's file, and what it reads is the checkpoint's content at the
// checkpoint's offset, though the file was rewritten after the checkpoint,
// and the descriptors name the view's files (not "(deleted)" ones: template
// copies used to reopen these files before the view switched back, on
// files the switch then removed from the view).
func TestRealRestoreReopensFilesInTheRestoredView(t *testing.T) {
	for _, fsKind := range []string{"fuse", "kernel"} {
		t.Run(fsKind, func(t *testing.T) {
			var d *realDaemon
			if fsKind == "kernel" {
				d = startKernelDaemon(t)
			} else {
				d = startReal(t, t.TempDir())
			}
			c, ctx := d.c, context.Background()
			if _, err := c.Create(ctx, api.CreateRequest{Name: "b"}); err != nil {
				t.Fatal(err)
			}
			if _, err := c.StartSession(ctx, "b", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
				t.Fatal(err)
			}
			setup := `mkdir -p /w && printf 0123456789 > /w/r && exec 3< /w/r && read -r -n 2 x <&3 && exec 4>> /w/log && echo a >&4; echo "$x"; echo @@done@@`
			if got := send(t, c, "b", "sh", setup); got != "01" {
				t.Fatalf("set-up read %q", got)
			}
			t1, err := c.Turn(ctx, "b", api.TurnRequest{Mode: "full", Wait: true})
			if err != nil {
				t.Fatal(err)
			}
			// After the checkpoint: append through the descriptor, replace
			// the read file's content (a new file in the view), and set a
			// variable (so the restore does not keep the live shell).
			if got := send(t, c, "b", "sh", `echo b >&4; y=after; printf XXXXXXXXXX > /w/r.new && mv /w/r.new /w/r; cat /w/log; echo @@done@@`); got != "a\nb" {
				t.Fatalf("live log %q", got)
			}
			for i := range 2 {
				r, err := c.Restore(ctx, "b", t1.ID, 0)
				if err != nil {
					t.Fatal(err)
				}
				const next = `read -r -n 3 x <&3; echo "$x"; echo c$i >&4; cat /w/log; readlink /proc/$BASHPID/fd/3 /proc/$BASHPID/fd/4; echo @@done@@`
				want := fmt.Sprintf("234\na\nc%d\n/w/r\n/w/log", i)
				if got := send(t, c, "b", "sh", strings.ReplaceAll(next, "$i", fmt.Sprint(i))); got != want {
					t.Fatalf("restore %d (path %s): the shell reads and appends %q, want %q", i, r.Path, got, want)
				}
				if got := sh(t, c, "b", "cat /w/log"); got != fmt.Sprintf("a\nc%d", i) {
					t.Fatalf("restore %d (path %s): /w/log holds %q, want what the shell appended", i, r.Path, got)
				}
				t.Logf("restore %d: path %s", i, r.Path)
			}
		})
	}
}

// A harness that forks right after its turn, without waiting for the
// checkpoint to be durable (a trainer's checkpoint-then-fan-out), gets its
// children: the fork waits for the process image they are restored from
// (it used to fail "has no image yet" in 4 forks of 5).
func TestRealForkRightAfterTurn(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	bashSandbox(t, c, api.CreateRequest{Name: "x"})
	for i := range 3 {
		send(t, c, "x", "b", fmt.Sprintf("v=%d; echo @@done@@", i))
		r, err := c.Turn(ctx, "x", api.TurnRequest{Mode: "full"})
		if err != nil {
			t.Fatal(err)
		}
		res, err := c.Fork(ctx, r.ID, api.ForkRequest{Count: 2, Prefix: fmt.Sprintf("k%d-", i)})
		if err != nil {
			t.Fatalf("fork %d right after its turn: %v", i, err)
		}
		for _, k := range res.Sandboxes {
			if got := send(t, c, k, "b", "echo v=$v; echo @@done@@"); got != fmt.Sprintf("v=%d", i) {
				t.Errorf("fork %d: child %s says %q", i, k, got)
			}
			if err := c.Remove(ctx, k); err != nil {
				t.Fatal(err)
			}
		}
	}
}

// TestRealForkChildPidsAboveImage: in a fork child, the processes started
// after the restore get pids above every pid the checkpoint's image
// recreated, so a later restore of that image into the child never finds
// one of its pids taken by them. The image's pids come from the upper half
// of the pid range (cr's dump copy); CRIU recreates them without moving
// the namespace's counter, so the child's init moves it there at its setup
// (sandbox.Config.PIDCounterMin), or cr starts a shell in the namespace to
// do it. Without either, the child's next process got pid 132.
func TestRealForkChildPidsAboveImage(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	pidMax, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	bashSandbox(t, c, api.CreateRequest{Name: "x"})
	send(t, c, "x", "b", "cd /tmp; echo @@done@@")
	r, err := c.Turn(ctx, "x", api.TurnRequest{Mode: "full"})
	if err != nil {
		t.Fatal(err)
	}
	res, err := c.Fork(ctx, r.ID, api.ForkRequest{Count: 2, Prefix: "k-"})
	if err != nil {
		t.Fatal(err)
	}
	for _, k := range res.Sandboxes {
		out := strings.Fields(execOut(t, c, k, "sh", "-c", `echo $$; for p in /proc/[0-9]*; do echo "${p#/proc/}"; done`))
		if len(out) < 3 {
			t.Fatalf("child %s: %q, want its shell's pid and the pids of its init, bash and itself", k, out)
		}
		self, _ := strconv.Atoi(out[0])
		restored := 0
		for _, f := range out[1:] {
			if p, _ := strconv.Atoi(f); p != self && p != 1 {
				restored = max(restored, p)
			}
		}
		if self <= restored || self < pidMax/2 {
			t.Errorf("child %s: a new process got pid %d (the child's processes: %v): want it above the restored ones and the image's, in the upper half of 1..%d", k, self, out[1:], pidMax)
		}
	}
}
