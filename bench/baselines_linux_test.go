package bench

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestBaselines replays a short trace with every baseline and checks each
// really saves and restores the repository: the digest after the replay
// must equal the one of a fresh replay of the same branch without
// rollbacks... simpler and stronger: every crash check compares file
// hashes, so a baseline that restored the wrong files would score below
// the shell-state losses alone. Here we assert the file part directly.
func TestBaselines(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := exec.LookPath("fuse-overlayfs")
	testenv.Require(t, err == nil, "fuse-overlayfs (make deps)")
	tr := mustGenerate(t, 11, GenOptions{Expansions: 12, ZeroLLM: true})
	ctx := context.Background()
	for _, name := range []string{"cp-a", "tarball", "overlay-remount", "fuse-overlayfs-copy", "cp-reflink", "criu-cp-a"} {
		t.Run(name, func(t *testing.T) {
			xfs := ""
			m, cleanup, err := newSystem(name, nil, t.TempDir(), &xfs)
			if err != nil {
				t.Fatal(err)
			}
			defer cleanup()
			defer func() { removeScratchXFS(xfs) }()
			res, err := Replay(ctx, tr, m, ReplayOptions{CrashChecks: 4})
			if err != nil {
				t.Fatalf("replay: %v", err)
			}
			if res.Checkpoint.N != 12 || res.Restore.N != tr.Rollbacks() || res.StateMS <= 0 || res.ExecMS <= 0 {
				t.Errorf("result %+v", res)
			}
			if res.CrashChecks != 4 {
				t.Errorf("%d crash checks, want 4", res.CrashChecks)
			}
			if res.Usage.DiskBytes <= 0 {
				t.Errorf("no disk usage reported")
			}
			// The CRIU baseline keeps the shell's processes: it must
			// recover every crash exactly, as rewind does.
			if name == "criu-cp-a" && res.CrashCorrect != res.CrashChecks {
				t.Errorf("criu-cp-a recovered %d of %d crashes exactly (%s)", res.CrashCorrect, res.CrashChecks, res.Error)
			}
		})
	}
}

// TestCRIUBaselineKeepsShell: after a rollback the CRIU baseline's shell
// has its old cwd, variable and background job, and the old files.
func TestCRIUBaselineKeepsShell(t *testing.T) {
	testenv.RequireRoot(t)
	ctx := context.Background()
	m := NewCRIUBaseline(t.TempDir())
	if err := m.Start(ctx, []string{"mkdir -p $R/sub && echo one > $R/f"}); err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := m.Run(ctx, "cd $R/sub && export AGENT_STEP=7 && sleep 1000 &"); err != nil {
		t.Fatal(err)
	}
	if err := m.Run(ctx, "cd $R/sub; export AGENT_STEP=7"); err != nil {
		t.Fatal(err)
	}
	want, err := m.Digest(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(want, "jobs=1 cwd=/sub step=7") {
		t.Fatalf("digest before checkpoint %q", want)
	}
	id, _, err := m.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Run(ctx, "kill %1; wait; echo two > $R/f; cd $R; export AGENT_STEP=8"); err != nil {
		t.Fatal(err)
	}
	for i := range 2 { // restoring twice: a restored tree dumps and restores again
		if _, err := m.Restore(ctx, id); err != nil {
			t.Fatalf("restore %d: %v", i, err)
		}
		got, err := m.Digest(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if got != want {
			t.Fatalf("restore %d: digest %q, want %q", i, got, want)
		}
		if i == 0 {
			if _, _, err := m.Checkpoint(ctx); err != nil {
				t.Fatalf("re-dump of a restored shell: %v", err)
			}
		}
	}
}

// TestBaselineRestoresFiles checks file state after a rollback directly.
func TestBaselineRestoresFiles(t *testing.T) {
	testenv.RequireRoot(t)
	ctx := context.Background()
	for _, name := range []string{"cp-a", "tarball", "overlay-remount"} {
		t.Run(name, func(t *testing.T) {
			xfs := ""
			m, _, err := newSystem(name, nil, t.TempDir(), &xfs)
			defer func() { removeScratchXFS(xfs) }()
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Start(ctx, []string{"mkdir -p $R && echo one > $R/f"}); err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			id, _, err := m.Checkpoint(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if err := m.Run(ctx, "echo two > $R/f; echo new > $R/g"); err != nil {
				t.Fatal(err)
			}
			before, _ := m.Digest(ctx)
			if _, _, err := m.Checkpoint(ctx); err != nil {
				t.Fatal(err)
			}
			if _, err := m.Restore(ctx, id); err != nil {
				t.Fatal(err)
			}
			after, err := m.Digest(ctx)
			if err != nil {
				t.Fatal(err)
			}
			if before == after {
				t.Fatalf("digest unchanged by a rollback: %q", after)
			}
			var d *dirBase
			switch b := m.(type) {
			case *copyBaseline:
				d = &b.dirBase
			case *overlayBaseline:
				d = &b.dirBase
			}
			got, err := os.ReadFile(d.repo + "/f")
			if err != nil || strings.TrimSpace(string(got)) != "one" {
				t.Fatalf("after rollback f = %q, %v; want one", got, err)
			}
			if _, err := os.Stat(d.repo + "/g"); !os.IsNotExist(err) {
				t.Fatalf("after rollback g exists (err %v)", err)
			}
		})
	}
}

// TestCRIUBaselineIgnoresLongMountLines: CRIU 4.1.1 reads mountinfo in
// 4 KiB lines and fails a dump on a longer one ("Bad format in mountinfo"),
// and the overlays of a sandbox with many layers (a concurrent test, or the
// rewind daemon on the same host) have such lines. The baseline's processes
// live in a mount namespace of their own, as in a container, so such a
// mount, whether it was there before the baseline started or appears
// later, never fails its dumps. The mounts here are made in a private
// mount namespace of this test's thread, so that no other test sees them.
func TestCRIUBaselineIgnoresLongMountLines(t *testing.T) {
	testenv.RequireRoot(t)
	ctx := context.Background()
	runtime.LockOSThread() // never unlocked: the thread dies with the test's goroutine
	if err := unix.Unshare(unix.CLONE_NEWNS | unix.CLONE_FS); err != nil {
		t.Fatal(err)
	}
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_SLAVE, ""); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	longMount := func(name string) {
		p := filepath.Join(dir, name)
		if err := os.Mkdir(p, 0o755); err != nil {
			t.Fatal(err)
		}
		// The source is printed in mountinfo: 4000 bytes of it make the
		// line longer than CRIU's buffer.
		if err := unix.Mount(strings.Repeat("x", 4000), p, "tmpfs", 0, "size=1m"); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(p, unix.MNT_DETACH) })
		b, err := os.ReadFile("/proc/thread-self/mountinfo")
		if err != nil || !strings.Contains(string(b), strings.Repeat("x", 4000)) {
			t.Fatalf("long mount not in mountinfo (%v)", err)
		}
	}
	longMount("before")
	m := NewCRIUBaseline(t.TempDir())
	if err := m.Start(ctx, []string{"echo one > $R/f"}); err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	longMount("after")
	id, _, err := m.Checkpoint(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := m.Run(ctx, "echo two > $R/f"); err != nil {
		t.Fatal(err)
	}
	if _, err := m.Restore(ctx, id); err != nil {
		t.Fatal(err)
	}
	if _, _, err := m.Checkpoint(ctx); err != nil {
		t.Fatalf("dump of the restored shell: %v", err)
	}
}
