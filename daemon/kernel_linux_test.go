package daemon_test

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/state"
)

// startKernelDaemon starts a real daemon whose state dir is a loop XFS
// with reflink (as `rewind init-store` makes it), where the kernel path
// freezes layers by reflink.
func startKernelDaemon(t *testing.T) *realDaemon {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := exec.LookPath("mkfs.xfs")
	testenv.Require(t, err == nil, "mkfs.xfs (xfsprogs)")
	dir := t.TempDir()
	st := filepath.Join(dir, "state")
	if _, err := kernelpath.InitStore(kernelpath.StoreImage{Image: filepath.Join(dir, "store.img"), FS: "xfs", Size: kernelpath.MinImageSize, StateDir: st}); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { unix.Unmount(st, unix.MNT_DETACH) })
	return startReal(t, dir)
}

// TestRealKernelPathStockSwitch drives a sandbox on native overlayfs with a
// stock kernel (no layer-switch ioctl): checkpoints freeze by reflink,
// restores replace the root of the sandbox's mount namespace, and the
// processes restored on it (template copies, CRIU trees) see the restored
// files, keep their memory, working directory and open files, exactly as
// on the FUSE path.
func TestRealKernelPathStockSwitch(t *testing.T) {
	d := startKernelDaemon(t)
	c, ctx := d.c, context.Background()
	sb, err := c.Create(ctx, api.CreateRequest{Name: "k", FS: "kernel"})
	if err != nil {
		t.Fatal(err)
	}
	if sb.FSKind != "kernel" {
		t.Fatalf("sandbox fs %q, want kernel", sb.FSKind)
	}
	if _, err := c.StartSession(ctx, "k", api.SessionRequest{ID: "b", Argv: []string{"bash", "--noprofile", "--norc"}, Env: []string{"PS1="}}); err != nil {
		t.Fatal(err)
	}
	run := func(cmd string) string { return send(t, c, "k", "b", cmd+"\necho @@done@@") }
	// State in the shell: a variable, a working directory below the root,
	// and a file it holds open for appending.
	run("mkdir -p /work/sub && cd /work/sub && echo one > /work/f && X=1 && exec 3>>/work/log && echo a >&3")
	t1, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	run("echo two > /work/f && echo new > /work/g && X=2 && cd / && echo b >&3")
	t2, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	check := func(when, wantF, wantG, wantX, wantCwd, wantLog string) {
		t.Helper()
		got := run(`echo "$(cat /work/f) $(cat /work/g 2>/dev/null || echo no-g) X=$X cwd=$(pwd) log=$(tr -d '\n' </work/log)"`)
		want := wantF + " " + wantG + " X=" + wantX + " cwd=" + wantCwd + " log=" + wantLog
		if got != want {
			t.Fatalf("%s: shell sees %q, want %q", when, got, want)
		}
		if got := sh(t, c, "k", "cat /work/f"); got != wantF {
			t.Fatalf("%s: exec sees /work/f = %q, want %q", when, got, wantF)
		}
	}
	check("before restore", "two", "new", "2", "/", "ab")

	// Template restore: the copy of the shell is back in /work/sub with
	// X=1, on the restored files; its fd 3 is /work/log of the new view.
	r, err := c.Restore(ctx, "k", t1.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if r.Path != "template" {
		t.Fatalf("restore path %q, want template", r.Path)
	}
	check("after restore to t1", "one", "no-g", "1", "/work/sub", "a")
	run("echo c >&3")
	check("after a write to the reopened fd", "one", "no-g", "1", "/work/sub", "ac")
	// The restored shell's executable and mappings are the old view's: its
	// checkpoint's image declares them external (criu.Externals), so the
	// checkpoint is durable and forks (restored from the image) work.
	t1b, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil || !t1b.Durable {
		t.Fatalf("checkpoint after a template restore: %+v %v", t1b, err)
	}

	// A restore with nothing changed since the head: on FUSE only the fs
	// switches; here the processes are re-created on the new view too.
	if _, err := c.Restore(ctx, "k", t2.ID, 0); err != nil {
		t.Fatal(err)
	}
	check("after restore to t2", "two", "new", "2", "/", "ab")
	if _, err := c.Restore(ctx, "k", t2.ID, 0); err != nil {
		t.Fatal(err)
	}
	check("after restoring the head again", "two", "new", "2", "/", "ab")
	// Restores of one checkpoint in a row: each recreates its templates
	// from the image, which needs the pids of the templates the previous
	// one recreated.
	for i := range 8 {
		run("X=9 && echo nine > /work/f")
		if _, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true}); err != nil {
			t.Fatal(err)
		}
		if _, err := c.Restore(ctx, "k", t2.ID, 0); err != nil {
			t.Fatalf("restore %d of t2 in a row: %v", i+2, err)
		}
	}
	check("after restoring t2 again and again", "two", "new", "2", "/", "ab")

	// An fs-only checkpoint restores the processes of the last full one.
	sh(t, c, "k", "echo three > /work/f")
	t3, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "fs", Wait: true})
	if err != nil || t3.Decision != state.ModeFS {
		t.Fatalf("fs turn: %+v %v", t3, err)
	}
	sh(t, c, "k", "echo four > /work/f")
	if _, err := c.Restore(ctx, "k", t3.ID, 0); err != nil {
		t.Fatal(err)
	}
	check("after restore to fs-only t3", "three", "new", "2", "/", "ab")

	// A process tree takes the CRIU path.
	run("(sleep 1000 & wait) & echo $! > /work/tree")
	t4, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	tree := sh(t, c, "k", "cat /work/tree")
	sh(t, c, "k", "echo five > /work/f; rm /work/tree")
	r, err = c.Restore(ctx, "k", t4.ID, 0)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.HasPrefix(r.Path, "criu") {
		t.Fatalf("restore of a tree took path %q, want criu", r.Path)
	}
	check("after CRIU restore to t4", "three", "new", "2", "/", "ab")
	if got := sh(t, c, "k", "cat /work/tree; test -d /proc/"+tree+" && echo alive"); got != tree+"\nalive" {
		t.Fatalf("after CRIU restore: tree %q", got)
	}

	// Fork: new sandboxes on the checkpoint's view.
	fr, err := c.Fork(ctx, t1b.ID, api.ForkRequest{Count: 2, Prefix: "kf"})
	if err != nil {
		t.Fatal(err)
	}
	if len(fr.Sandboxes) != 2 {
		t.Fatalf("fork: %v", fr.Sandboxes)
	}
	for _, name := range fr.Sandboxes {
		got, err := c.Get(ctx, name)
		if err != nil || got.FSKind != "kernel" {
			t.Fatalf("fork %s: %+v %v", name, got, err)
		}
		if out := send(t, c, name, "b", `echo "$(cat /work/f) X=$X cwd=$(pwd) $(echo d >&3 && tr -d '\n' </work/log)"`+"\necho @@done@@"); out != "one X=1 cwd=/work/sub acd" {
			t.Fatalf("fork %s sees %q", name, out)
		}
		sh(t, c, name, "echo forked > /work/f")
	}
	check("parent after its forks wrote", "three", "new", "2", "/", "ab")
}

// TestRealIdleTurnsSkip: on either fs path an idle auto turn skips after
// a checkpoint and after a restore (the writable layer then equals the
// checkpoint's: state's unseen-write guard must not fire), and a turn that
// ran a command does not.
func TestRealIdleTurnsSkip(t *testing.T) {
	for _, fsKind := range []string{"fuse", "kernel"} {
		t.Run(fsKind, func(t *testing.T) {
			var d *realDaemon
			if fsKind == "kernel" {
				d = startKernelDaemon(t)
			} else {
				d = startReal(t, t.TempDir())
			}
			idleTurnsSkip(t, d, fsKind)
		})
	}
}

func idleTurnsSkip(t *testing.T, d *realDaemon, fsKind string) {
	c, ctx := d.c, context.Background()
	bashSandbox(t, c, api.CreateRequest{Name: "k", FS: fsKind, Policy: "effects"})
	run := func(cmd string) string { return send(t, c, "k", "b", cmd+"\necho @@done@@") }
	turn := func(when string, want state.Mode) *api.TurnResult {
		t.Helper()
		r, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "auto", Wait: true})
		if err != nil {
			t.Fatal(err)
		}
		if state.Mode(r.Decision) != want {
			t.Fatalf("%s: decision %s (%s), want %s", when, r.Decision, r.Reason, want)
		}
		return r
	}
	run("mkdir -p /work && echo one > /work/f")
	t1, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	turn("idle turn after a checkpoint", state.ModeSkip)
	run("echo two > /work/f")
	turn("a turn that wrote a file (the shell ran: memory written)", state.ModeFull)
	turn("idle turn after that", state.ModeSkip)
	if _, err := c.Restore(ctx, "k", t1.ID, 0); err != nil {
		t.Fatal(err)
	}
	turn("idle turn after a restore", state.ModeSkip)
	if got := run("cat /work/f"); got != "one" {
		t.Fatalf("/work/f after the restore: %q", got)
	}
}

// On a stock kernel a restore replaces the root of the sandbox's mount
// namespace, and a checkpoint's CRIU image is dumped in the background in
// that namespace: a full turn followed at once by a restore must still end
// durable (its image written). Before the dump and the root's replacement
// were kept apart, 6 images of 40 failed ("Can't read link of
// fd", "Can't lookup mount"), and such a checkpoint could not be forked or
// recovered after a crash.
func TestRealKernelImageDuringReroot(t *testing.T) {
	d := startKernelDaemon(t)
	c, ctx := d.c, context.Background()
	bashSandbox(t, c, api.CreateRequest{Name: "k", FS: "kernel"})
	send(t, c, "k", "b", "mkdir -p /w; cd /w; echo @@done@@")
	r0, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	const n = 40
	var lost []string
	for i := range n {
		send(t, c, "k", "b", fmt.Sprintf("v=%d; echo @@done@@", i))
		r, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full"})
		if err != nil {
			t.Fatal(err)
		}
		if _, err := c.Restore(ctx, "k", r0.ID, 0); err != nil {
			t.Fatal(err)
		}
		ck, err := c.Wait(ctx, r.ID)
		if err != nil {
			t.Fatal(err)
		}
		if !ck.Durable {
			lost = append(lost, r.ID)
		}
	}
	if len(lost) > 0 {
		t.Errorf("%d of %d checkpoints restored away from at once got no image: %v (the daemon's log says why)", len(lost), n, lost)
	}
}

// TestRealKernelRestoreOverStaleMount: a daemon that died while it
// mounted a stopped kernel-path sandbox's overlay (the first restore after
// a restart) left a mount on the sandbox's mount point whose record was
// gone, and every later daemon refused to mount there ("already a mount
// point"): the sandbox could never be restored again. The next daemon,
// which holds the state dir's lock, detaches what it finds there.
func TestRealKernelRestoreOverStaleMount(t *testing.T) {
	d := startKernelDaemon(t)
	c, ctx := d.c, context.Background()
	sb, err := c.Create(ctx, api.CreateRequest{Name: "k", FS: "kernel"})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, c, "k", "echo kept > /root/f")
	ck, err := c.Turn(ctx, "k", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil || !ck.Durable {
		t.Fatalf("checkpoint: %+v %v", ck, err)
	}
	// Two restarts: the second daemon finds the sandbox stopped, so the
	// third's recovery leaves its mount point alone, as after a crash in
	// the middle of the first restore.
	d.stop()
	startReal(t, d.dir).stop()
	mp := filepath.Join(d.dir, "state", "mnt", sb.ID)
	if err := os.MkdirAll(mp, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("tmpfs", mp, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatalf("leave a mount on %s: %v", mp, err)
	}
	t.Cleanup(func() { unix.Unmount(mp, unix.MNT_DETACH) })
	d2 := startReal(t, d.dir)
	if _, err := d2.c.Restore(ctx, "k", ck.ID, 0); err != nil {
		t.Fatalf("restore over a stale mount: %v", err)
	}
	if got := sh(t, d2.c, "k", "cat /root/f"); got != "kept" {
		t.Errorf("after the restore: %q", got)
	}
}

// TestRealStoreImageHidden: the image file a state dir is mounted from
// (rewind init-store) holds every checkpoint's data; sandboxes of both
// backends see it masked, while other host files stay readable.
func TestRealStoreImageHidden(t *testing.T) {
	d := startKernelDaemon(t)
	c, ctx := d.c, context.Background()
	img := filepath.Join(d.dir, "store.img")
	for _, fsKind := range []string{"fuse", "kernel"} {
		name := "img-" + fsKind
		if _, err := c.Create(ctx, api.CreateRequest{Name: name, FS: fsKind}); err != nil {
			t.Fatal(err)
		}
		if got := sh(t, c, name, "wc -c < "+img); got != "0" {
			t.Errorf("%s: the store image reads %s bytes inside a sandbox, want it masked", fsKind, got)
		}
		if got := sh(t, c, name, "test -s /etc/passwd && echo ok"); got != "ok" {
			t.Errorf("%s: host files: %q", fsKind, got)
		}
	}
}
