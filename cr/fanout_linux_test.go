package cr

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/cr/criu"
)

func TestFork16Independent(t *testing.T) {
	sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
	live := session{in: sb.in, out: sb.out}
	pyChat(t, live, "a = list(range(1_000_000)); tag = 'base'")
	e := newEngine(t, Config{})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "f"}); err != nil {
		t.Fatal(err)
	}
	stdio, sessions := freshStdio(t, sb)
	copies, err := e.Fork(ctxT(t), sb, "f", 16, RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if len(copies) != 16 {
		t.Fatalf("%d copies", len(copies))
	}
	var ss []session
	pids := map[int]bool{}
	for i := range copies {
		ss = append(ss, <-sessions)
		pids[copies[i][0].PID] = true
	}
	if len(pids) != 16 {
		t.Fatalf("copies share pids: %v", pids)
	}
	// Each copy writes its own value; none sees another's.
	for i, s := range ss {
		pyChat(t, s, fmt.Sprintf("a[0] = %d; tag = 'copy%d'", i+100, i))
	}
	pyChat(t, live, "a[0] = -1; tag = 'live'")
	for i, s := range ss {
		want := fmt.Sprintf("%d copy%d %d", i+100, i, 499999500000+i+100)
		if got := pyChat(t, s, "print(a[0], tag, sum(a))"); got != want {
			t.Fatalf("copy %d: %q, want %q", i, got, want)
		}
	}
	if got := pyChat(t, live, "print(a[0], tag)"); got != "-1 live" {
		t.Fatalf("live: %q", got)
	}
	procs, err := e.Processes(sb)
	if err != nil || len(procs) != 17 {
		t.Fatalf("%d live processes (want 17): %v", len(procs), err)
	}
}

func TestMultiThreadedTakesCRIUPath(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "python3", "-u", "-c", "import threading, time\nthreading.Thread(target=lambda: time.sleep(100000), daemon=True).start()\n"+pyLoop)
	live := session{in: sb.in, out: sb.out}
	pyChat(t, live, "x = 42")
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "mt"})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Mode != ModeCRIU || ck.Reason == "" {
		t.Fatalf("checkpoint %+v", ck)
	}
	pyChat(t, live, "x = 7")
	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, "mt", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" {
		t.Fatalf("path %s", res.Path)
	}
	if got := pyChat(t, <-sessions, "import threading; print(x, threading.active_count())"); got != "42 2" {
		t.Fatalf("restored: %q", got)
	}
}

// TestCRIURestoreRetriesWhilePidTaken: a pid of the image that the
// engine's check cannot see taken (here a process of the sandbox's PID
// namespace entered from outside, not below its init, as the kernel's
// release of a reaped pid can lag its exit from /proc) fails CRIU's
// clone ("Can't fork for N: File exists"); the restore tries again until
// the pid is free and succeeds.
func TestCRIURestoreRetriesWhilePidTaken(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "python3", "-u", "-c", "import threading, time\nthreading.Thread(target=lambda: time.sleep(100000), daemon=True).start()\n"+pyLoop)
	live := session{in: sb.in, out: sb.out}
	pyChat(t, live, "x = 42")
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "mt"}); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	dir := e.ckpts["mt"].images[0].dir
	e.mu.Unlock()
	need, err := imagePids(dir)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := e.killLive(ctxT(t), sb, nil); err != nil {
		t.Fatal(err)
	}
	if err := waitPidsFree(ctxT(t), sb.InitPID(), need, nil); err != nil {
		t.Fatal(err)
	}
	// Squat the image's first pid for 3 s: set the namespace's last
	// pid just below it and fork. The pid may not be free for the
	// kernel yet (its release lags the exit), so a squatter that got
	// another pid is replaced, a few times.
	took := false
	for try := 0; try < 5 && !took; try++ {
		squat := exec.Command("nsenter", "-t", fmt.Sprint(sb.InitPID()), "-p", "--", "sh", "-c",
			fmt.Sprintf("echo %d > /proc/sys/kernel/ns_last_pid && sleep 3; true", need[0]-1))
		squat.SysProcAttr = &unix.SysProcAttr{Setpgid: true}
		if err := squat.Start(); err != nil {
			t.Fatal(err)
		}
		took = waitUntil(ctxT(t), 2*time.Second, func() bool {
			ps, _ := descendants(squat.Process.Pid, nil)
			for _, p := range ps {
				if ids, err := readNSIDs(p.PID); err == nil && ids.pid == need[0] {
					return true
				}
			}
			return false
		})
		if took {
			t.Cleanup(func() { _ = squat.Process.Kill(); _ = squat.Wait() })
		} else {
			_ = unix.Kill(-squat.Process.Pid, unix.SIGKILL) // its sh and sleep too
			_ = squat.Wait()
		}
	}
	if !took {
		t.Fatalf("no process took pid %d", need[0])
	}
	if hs, err := pidHolders(sb.InitPID(), need, nil); err != nil || len(hs) != 0 {
		t.Fatalf("the check sees the squatter: %v %v", hs, err)
	}
	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, "mt", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" {
		t.Fatalf("path %s", res.Path)
	}
	if _, err := os.Stat(filepath.Join(dir, criu.RestoreLog+".1")); err != nil {
		t.Fatalf("no failed attempt kept: %v", err)
	}
	if got := pyChat(t, <-sessions, "import threading; print(x, threading.active_count())"); got != "42 2" {
		t.Fatalf("restored: %q", got)
	}
}

func TestCheckpointWithoutCRIUForTreeFails(t *testing.T) {
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	bashChat(t, session{in: sb.in, out: sb.out}, "sleep 1000 & true")
	e := newEngine(t, Config{})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "t"}); err == nil {
		t.Fatal("tree checkpoint without ImagesDir succeeded")
	}
	// The live processes are running (not left stopped).
	procs, _ := e.Processes(sb)
	for _, p := range procs {
		if st, _ := procState(p.PID); st == 'T' || st == 't' {
			t.Fatalf("process %d left stopped", p.PID)
		}
	}
}

func TestTemplateKilledFromOutside(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	bashChat(t, live, "export V=kept")
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "k"}); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitImage(ctxT(t), "k"); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	tpid := e.ckpts["k"].templates[0].proc.Pid()
	e.mu.Unlock()
	if err := unix.Kill(tpid, unix.SIGKILL); err != nil {
		t.Fatal(err)
	}
	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, "k", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" {
		t.Fatalf("path %q", res.Path)
	}
	if got := bashChat(t, <-sessions, "echo $V"); got != "kept" {
		t.Fatalf("restored: %q", got)
	}
}

func TestDropSandboxLeavesNoStoppedProcess(t *testing.T) {
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	e := newEngine(t, Config{Warm: true})
	for i := 0; i < 3; i++ {
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: fmt.Sprint(i)}); err != nil {
			t.Fatal(err)
		}
	}
	all, _ := descendants(sb.InitPID(), nil)
	if len(all) < 4 {
		t.Fatalf("expected templates, got %+v", all)
	}
	e.DropSandbox(sb.ID())
	ok := waitUntil(ctxT(t), 10*time.Second, func() bool {
		all, _ = descendants(sb.InitPID(), nil)
		return len(all) == 1 && all[0].Comm == "bash"
	})
	if !ok {
		t.Fatalf("after DropSandbox: %+v", all)
	}
	if _, err := e.Restore(ctxT(t), sb, "0", RestoreOptions{}); !errors.Is(err, ErrUnknown) {
		t.Fatalf("restore of dropped checkpoint: %v", err)
	}
	_ = os.Getpid()
}

func TestCheckpointWhileProcessesComeAndGo(t *testing.T) {
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	e := newEngine(t, Config{})
	// Short-lived children appear and vanish while checkpoints are taken
	// (a process tree, and no ImagesDir for the CRIU path): every
	// checkpoint must fail cleanly or succeed; the shell keeps working and
	// nothing stays stopped.
	bashChat(t, live, "(for i in $(seq 300); do /bin/true; done) & true")
	ok := 0
	for i := 0; i < 20; i++ {
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: fmt.Sprint(i)}); err == nil {
			ok++
		}
	}
	bashChat(t, live, "wait")
	if got := bashChat(t, live, "echo alive"); got != "alive" {
		t.Fatalf("shell: %q", got)
	}
	procs, _ := e.Processes(sb)
	for _, p := range procs {
		if st, _ := procState(p.PID); st == 'T' || st == 't' {
			t.Fatalf("process %d (%s) left stopped", p.PID, p.Comm)
		}
	}
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "final"}); err != nil {
		t.Fatalf("checkpoint of the quiet shell: %v", err)
	}
	t.Logf("%d of 20 checkpoints during churn succeeded", ok)
}
