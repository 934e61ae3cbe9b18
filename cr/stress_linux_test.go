//go:build stress

package cr

import (
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/sandbox"
	"golang.org/x/sys/unix"
)

// TestStressRestoreMidStartup checkpoints a python session right after it
// starts, so that the checkpoint may catch it still starting (its dynamic
// loader mapping libraries), and restores it, through the templates and
// through the CRIU image (the templates killed first, as an agent's pkill
// does), many times; the restored python must be alive and end up waiting
// for its input. Not part of the suite (build tag stress): it finds a
// failure only under load, in about one run of 200. Run it so:
//
//	for i in 1 2; do timeout 900 sh -c 'while :; do :; done' & done
//	REWIND_STRESS_N=200 go test -tags stress -run StressRestoreMidStartup -v ./cr/
func TestStressRestoreMidStartup(t *testing.T) {
	n := 50
	if v, err := strconv.Atoi(os.Getenv("REWIND_STRESS_N")); err == nil && v > 0 {
		n = v
	}
	for _, image := range []bool{false, true} {
		t.Run(fmt.Sprintf("image=%v", image), func(t *testing.T) {
			var starting, failed int
			for i := range n {
				t.Run(strconv.Itoa(i), func(t *testing.T) {
					s, ok := restoreMidStartup(t, image)
					if s {
						starting++
					}
					if !ok {
						failed++
					}
				})
			}
			t.Logf("%d of %d checkpoints caught python before it waited for input; %d restores lost it", starting, n, failed)
		})
	}
}

// restoreMidStartup is one round of TestStressRestoreMidStartup. It
// reports whether python was still starting at the checkpoint and whether
// the restore brought it back.
func restoreMidStartup(t *testing.T, image bool) (starting, ok bool) {
	sb := startReal(t)
	ctx := ctxT(t)
	cfg := Config{Warm: true}
	if image {
		needCRIU(t)
		cfg.ImagesDir = t.TempDir()
	}
	e := newEngine(t, cfg)
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "srv", Argv: []string{"python3", "-u", "-c", "import sys\nsys.stdin.read()"}})
	if err != nil {
		t.Fatal(err)
	}
	starting = !shellIdle(ss.PID())
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	if image {
		if err := e.WaitImage(ctx, "c"); err != nil {
			t.Fatal(err)
		}
		waitUntil(ctx, 30*time.Second, func() bool { return e.SparesReady(sb.ID()) })
		for _, pid := range e.TemplatePIDs(sb.ID()) {
			_ = unix.Kill(pid, unix.SIGKILL)
		}
	}
	res, err := e.Restore(ctx, sb, "c", RestoreOptions{Stdio: sessionStdio(ctx, sb, "srv")})
	if err != nil {
		t.Errorf("restore (python starting at the checkpoint: %v): %v\n%s", starting, err, helperStates(e, sb.ID()))
		return starting, false
	}
	if len(res.Procs) != 1 {
		t.Fatalf("restored %+v", res.Procs)
	}
	pid := res.Procs[0].PID
	if !waitUntil(ctx, 10*time.Second, func() bool { return shellIdle(pid) || exiting(pid) }) || exiting(pid) {
		t.Errorf("restored python %d (path %s, starting at the checkpoint: %v) is gone\n%s", pid, res.Path, starting, helperStates(e, sb.ID()))
		return starting, false
	}
	return starting, true
}

// helperStates describes the engine's helper processes of sandbox sb (the
// templates a failed restore left): the system call each is stopped in and
// its descriptors.
func helperStates(e *Engine, sb string) string {
	var b strings.Builder
	for _, pid := range e.TemplatePIDs(sb) {
		dir := fmt.Sprintf("/proc/%d/", pid)
		sc, _ := os.ReadFile(dir + "syscall")
		var regs unix.PtraceRegs
		rerr := e.tracer.Do(func() error { return unix.PtraceGetRegs(pid, &regs) })
		fmt.Fprintf(&b, "helper %d: syscall %q; registers (%v): rax %d orig_rax %d rip %#x\n", pid, strings.TrimSpace(string(sc)), rerr, int64(regs.Rax), int64(regs.Orig_rax), regs.Rip)
		fds, _ := filepath.Glob(dir + "fd/*")
		for _, fd := range fds {
			target, _ := os.Readlink(fd)
			info, _ := os.ReadFile(dir + "fdinfo/" + filepath.Base(fd))
			pos, _, _ := strings.Cut(string(info), "\n")
			fmt.Fprintf(&b, "  fd %s -> %s (%s)\n", filepath.Base(fd), target, pos)
		}
	}
	return b.String()
}
