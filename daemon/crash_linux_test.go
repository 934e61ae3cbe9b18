package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/state"
	"golang.org/x/sys/unix"
)

// spawnDaemon starts this test binary as a daemon process.
func spawnDaemon(t testing.TB, stateDir, sock, backend string) (*exec.Cmd, *client.Client) {
	t.Helper()
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "REWIND_TEST_DAEMON_STATE="+stateDir, "REWIND_TEST_DAEMON_SOCKET="+sock, "REWIND_TEST_DAEMON_BACKEND="+backend)
	var logb bytes.Buffer
	cmd.Stdout, cmd.Stderr = &logb, &logb
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan struct{})
	go func() { cmd.Wait(); close(exited) }()
	t.Cleanup(func() {
		cmd.Process.Signal(syscall.SIGTERM)
		select {
		case <-exited:
		case <-time.After(60 * time.Second):
			cmd.Process.Kill()
		}
		if t.Failed() {
			t.Logf("daemon log:\n%s", logb.String())
		}
	})
	c := client.New(sock)
	deadline := time.Now().Add(60 * time.Second)
	for {
		ctx, cancel := context.WithTimeout(context.Background(), time.Second)
		_, err := c.Version(ctx)
		cancel()
		if err == nil {
			return cmd, c
		}
		select {
		case <-exited:
			t.Fatalf("daemon exited: %s", logb.String())
		default:
		}
		if time.Now().After(deadline) {
			t.Fatalf("daemon did not come up: %v\n%s", err, logb.String())
		}
		time.Sleep(50 * time.Millisecond)
	}
}

func killDaemon(t *testing.T, cmd *exec.Cmd) {
	t.Helper()
	cmd.Process.Signal(syscall.SIGKILL)
	deadline := time.Now().Add(30 * time.Second)
	for syscall.Kill(cmd.Process.Pid, 0) == nil && time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
	}
}

// TestCrashRecovery kills the daemon with SIGKILL in the middle of a run
// (with a checkpoint in flight), starts a new one on the same state and
// restores a durable checkpoint.
func TestCrashRecovery(t *testing.T) {
	// The fake back ends live in memory: only the real ones survive a
	// process crash (the state manager's recovery is tested with fakes in
	// package state).
	// "kernel" is the real back ends with the sandbox on the native
	// overlayfs path, the state dir on a loop XFS.
	for _, run := range []string{"real", "kernel"} {
		t.Run(run, func(t *testing.T) {
			backend, fsKind := run, ""
			testenv.RequireRoot(t)
			_, err := os.Stat("/dev/fuse")
			testenv.Require(t, err == nil, "/dev/fuse")
			dir := t.TempDir()
			stateDir, sock := filepath.Join(dir, "state"), filepath.Join(dir, "run", "rewind.sock")
			if run == "kernel" {
				backend, fsKind = "real", "kernel"
				_, err := exec.LookPath("mkfs.xfs")
				testenv.Require(t, err == nil, "mkfs.xfs (xfsprogs)")
				if _, err := kernelpath.InitStore(kernelpath.StoreImage{Image: filepath.Join(dir, "store.img"), FS: "xfs", Size: kernelpath.MinImageSize, StateDir: stateDir}); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { unmountTree(stateDir) })
			}
			cmd, c := spawnDaemon(t, stateDir, sock, backend)
			ctx := context.Background()
			if _, err := c.Create(ctx, api.CreateRequest{Name: "a", FS: fsKind}); err != nil {
				t.Fatal(err)
			}
			write := func(v string) {
				argv := []string{"sh", "-c", "mkdir -p /work && echo " + v + " > /work/f"}
				if backend == "fake" {
					argv = []string{"write", "/work/f", v}
				}
				if code, err := c.Exec(ctx, "a", api.ExecRequest{Argv: argv}, nil, nil); err != nil || code != 0 {
					t.Fatalf("exec: %d %v", code, err)
				}
			}
			write("durable")
			if _, err := c.StartSession(ctx, "a", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc", "--noprofile"}}); err != nil {
				t.Fatal(err)
			}
			send(t, c, "a", "sh", "cd /work && export V=kept; echo @@done@@")
			durable, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true})
			if err != nil || !durable.Durable {
				t.Fatalf("durable checkpoint: %+v %v", durable, err)
			}
			write("later")
			if _, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "fs"}); err != nil { // maybe in flight
				t.Fatal(err)
			}
			killDaemon(t, cmd)

			_, c2 := spawnDaemon(t, stateDir, sock, backend)
			sb, err := c2.Get(ctx, "a")
			if err != nil {
				t.Fatal(err)
			}
			if sb.Status != state.StatusStopped || !strings.Contains(sb.Note, "restarted") {
				t.Fatalf("after the crash: %+v", sb)
			}
			if _, err := c2.Exec(ctx, "a", api.ExecRequest{Argv: []string{"true"}}, nil, nil); !errors.Is(err, state.ErrConflict) {
				t.Fatalf("exec in a stopped sandbox: %v", err)
			}
			r, err := c2.Restore(ctx, "a", durable.ID, 0)
			if err != nil {
				t.Fatalf("restore after the crash: %v", err)
			}
			if r.Epoch <= durable.Epoch {
				t.Fatalf("epoch after crash+restore: %d (was %d)", r.Epoch, durable.Epoch)
			}
			argv := []string{"cat", "/work/f"}
			var out bytes.Buffer
			if code, err := c2.Exec(ctx, "a", api.ExecRequest{Argv: argv}, &out, &out); err != nil || code != 0 {
				t.Fatalf("cat: %d %v %s", code, err, out.String())
			}
			if got := strings.TrimSpace(out.String()); got != "durable" {
				t.Fatalf("/work/f after restore = %q", got)
			}
			t.Logf("restored after the crash via %s in %d µs", r.Path, r.ElapsedUS)
			if got := send(t, c2, "a", "sh", `echo "$PWD $V"; echo @@done@@`); got != "/work kept" {
				t.Fatalf("shell after crash + restore (path %s): %q", r.Path, got)
			}
			// Work goes on.
			write("after")
			if _, err := c2.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true}); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// unmountTree lazily unmounts dir and every mount below it (what a killed
// daemon left on its state dir), deepest first.
func unmountTree(dir string) {
	b, _ := os.ReadFile("/proc/self/mountinfo")
	var mps []string
	for _, line := range strings.Split(string(b), "\n") {
		if f := strings.Fields(line); len(f) > 4 && (f[4] == dir || strings.HasPrefix(f[4], dir+"/")) {
			mps = append(mps, f[4])
		}
	}
	for i := len(mps) - 1; i >= 0; i-- {
		syscall.Unmount(mps[i], syscall.MNT_DETACH)
	}
}

// A FUSE connection of a killed daemon that something else still holds
// (the daemon's own child, forked to exec a helper in a sandbox's
// namespaces and blocked in that exec on the sandbox's root, was seen
// holding it, with every other descriptor the daemon had) keeps whoever
// waits on it blocked for ever, SIGKILL or not. The next daemon on the
// state dir aborts the connections of the mounts the dead one left, so the
// waiter gets an error and goes. Here the test holds a duplicate of the
// daemon's /dev/fuse descriptor (pidfd_getfd) and a process waits on the
// mount while the daemon is stopped and then killed. The waiter holds the
// state dir's lock too, as that child did (and as a daemon does that was
// killed while one of its own threads waited on its own mount, which then
// cannot finish dying): the next daemon sees that the lock's taker is dead,
// aborts the connections first, and gets the lock once they let go of it.
func TestCrashAbortsStaleFUSEConnections(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.Require(t, err == nil, "/dev/fuse")
	dir := t.TempDir()
	stateDir, sock := filepath.Join(dir, "state"), filepath.Join(dir, "run", "rewind.sock")
	cmd, c := spawnDaemon(t, stateDir, sock, "real")
	ctx := context.Background()
	sb, err := c.Create(ctx, api.CreateRequest{Name: "a", FS: "fuse"})
	if err != nil {
		t.Fatal(err)
	}
	mnt := filepath.Join(stateDir, "mnt", sb.ID)
	// Hold the daemon's connections: duplicates of its /dev/fuse fds.
	pid := cmd.Process.Pid
	pfd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(pfd)
	ents, err := os.ReadDir(fmt.Sprintf("/proc/%d/fd", pid))
	if err != nil {
		t.Fatal(err)
	}
	held := 0
	var lockFile *os.File
	for _, e := range ents {
		l, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%s", pid, e.Name()))
		if l != "/dev/fuse" && l != filepath.Join(stateDir, "daemon.lock") {
			continue
		}
		n, _ := strconv.Atoi(e.Name())
		fd, err := unix.PidfdGetfd(pfd, n, 0)
		if err != nil {
			t.Fatal(err)
		}
		if l == "/dev/fuse" {
			defer unix.Close(fd)
			held++
			continue
		}
		lockFile = os.NewFile(uintptr(fd), l)
	}
	if held == 0 || lockFile == nil {
		t.Fatalf("the daemon holds %d /dev/fuse descriptors and its lock %v", held, lockFile != nil)
	}
	// A request nobody will answer: the server is stopped, then killed.
	if err := cmd.Process.Signal(syscall.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	// The waiter also holds the state dir's lock (the daemon's open file
	// description of it), as the daemon's own child or its own stuck
	// thread would: the next daemon must see that its taker is dead and
	// abort the connections that keep it held.
	waiter := exec.Command("stat", filepath.Join(mnt, fmt.Sprintf("nothing-%d", time.Now().UnixNano())))
	waiter.ExtraFiles = []*os.File{lockFile}
	if err := waiter.Start(); err != nil {
		t.Fatal(err)
	}
	lockFile.Close()
	waited := make(chan error, 1)
	go func() { waited <- waiter.Wait() }()
	time.Sleep(200 * time.Millisecond)
	killDaemon(t, cmd)
	select {
	case err := <-waited:
		t.Fatalf("the waiter returned while its connection was still held open: %v", err)
	case <-time.After(500 * time.Millisecond):
	}
	_, c2 := spawnDaemon(t, stateDir, sock, "real")
	select {
	case <-waited: // the connection was aborted: stat failed and exited
	case <-time.After(20 * time.Second):
		waiter.Process.Kill()
		t.Fatal("the new daemon left the dead one's FUSE connection alive: its waiter is still blocked")
	}
	if _, err := c2.List(ctx); err != nil {
		t.Fatal(err)
	}
}
