package cr

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// checkSessions asserts that every process of sb leads its own session or
// belongs to a session whose leader lives in sb, and that every cr helper
// leads its own session and group: no process keeps a pid of the namespace
// allocated as a group or session id once that pid's process is gone, and
// CRIU can dump any of them (it refuses a session leader outside the
// namespace).
func checkSessions(t *testing.T, sb *testSandbox, e *Engine) {
	t.Helper()
	procs, err := nsProcesses(sb.InitPID())
	if err != nil {
		t.Fatal(err)
	}
	// A killed process may still be exiting when a restore returns (the
	// kill waits for PF_EXITING, not for the exit), or not even have
	// begun to (a quiet one, stopped and then killed as the restore
	// returned: SIGKILL pending): it never runs again, and is no leader of
	// anything live.
	gone := func(p nsIDs) bool { return p.zombie || exiting(p.host) || killPending(p.host) }
	alive := map[int]bool{1: true}
	for _, p := range procs {
		if !gone(p) {
			alive[p.pid] = true
		}
	}
	helpers := e.templatePids(sb.ID())
	for _, p := range procs {
		if gone(p) {
			continue
		}
		if helpers[p.host] && (p.sid != p.pid || p.pgid != p.pid) {
			t.Errorf("helper %d (ns pid %d) is in group %d, session %d: want its own", p.host, p.pid, p.pgid, p.sid)
		}
		if !alive[p.sid] || !alive[p.pgid] {
			t.Errorf("process %d (ns pid %d) is in group %d, session %d, whose leader is gone", p.host, p.pid, p.pgid, p.sid)
		}
	}
}

// killPending reports whether process pid has SIGKILL pending (status's
// ShdPnd, the signals pending for the whole process).
func killPending(pid int) bool {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "ShdPnd:"); ok {
			m, err := strconv.ParseUint(strings.TrimSpace(v), 16, 64)
			return err == nil && m&(1<<(unix.SIGKILL-1)) != 0
		}
	}
	return false
}

// TestCRIURestoreAfterTemplateCheckpoints is the "Can't fork for PID: File
// exists" case: a shell is checkpointed through templates, then with a
// background job (CRIU path: exact pids), the job ends, and the shell is
// checkpointed through templates again (as the daemon's undo point before
// every restore does). Restoring the CRIU checkpoint needs the shell's pid
// back while templates of that very shell exist; then the restored shell is
// checkpointed and restored again on both paths (a CRIU-restored process
// must be dumpable).
func TestCRIURestoreAfterTemplateCheckpoints(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	e := newEngine(t, Config{ImagesDir: t.TempDir(), Warm: true})
	ctx := ctxT(t)
	steps := []struct {
		cmd  string // run in the current shell before the checkpoint
		id   string
		mode Mode
	}{
		{"cd /tmp; V=a", "a", ModeTemplate},
		{"sleep 1000 & V=b", "b", ModeCRIU},
		{"kill %1; wait; V=c", "c", ModeTemplate},
	}
	for _, s := range steps {
		bashChat(t, live, s.cmd)
		ck, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: s.id})
		if err != nil {
			t.Fatalf("checkpoint %s: %v", s.id, err)
		}
		if ck.Mode != s.mode {
			t.Fatalf("checkpoint %s: mode %s (%s), want %s", s.id, ck.Mode, ck.Reason, s.mode)
		}
		if ck.Mode == ModeTemplate {
			if err := e.WaitImage(ctx, s.id); err != nil {
				t.Fatalf("image of %s: %v", s.id, err)
			}
		}
		checkSessions(t, sb, e)
	}
	restore := func(id, wantPath, want string) {
		t.Helper()
		live = restoreAsk(t, e, sb, id, wantPath, `echo "$PWD $V $(jobs -r | wc -l)"`, want)
	}
	restore("b", "criu", "/tmp b 1")
	restore("a", "template", "/tmp a 0")
	// The restored copy starts a job and goes through CRIU; then the
	// template checkpoint of a CRIU-restored shell restores from its image.
	bashChat(t, live, "sleep 1000 & V=d")
	if ck, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "d"}); err != nil || ck.Mode != ModeCRIU {
		t.Fatalf("checkpoint d of a restored copy: %+v %v", ck, err)
	}
	restore("d", "criu", "/tmp d 1")
	bashChat(t, live, "kill %1; wait; V=e")
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "e"}); err != nil {
		t.Fatalf("checkpoint e of a CRIU-restored shell: %v", err)
	}
	if err := e.WaitImage(ctx, "e"); err != nil {
		t.Fatalf("image of e (a CRIU-restored shell): %v", err)
	}
	if err := e.Evict("e"); err != nil {
		t.Fatal(err)
	}
	restore("e", "criu", "/tmp e 0")
	restore("b", "criu", "/tmp b 1")
}

func TestImagePids(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	bashChat(t, live, "sleep 1000 & sleep 1001 & true")
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "tree"})
	if err != nil || ck.Mode != ModeCRIU {
		t.Fatalf("checkpoint: %+v %v", ck, err)
	}
	var want []int
	for _, p := range ck.Procs {
		want = append(want, p.NSPID)
	}
	slices.Sort(want)
	got, err := imagePids(e.imageDir(e.ckpts["tree"], 0))
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got, want) || len(got) != 3 {
		t.Fatalf("image pids %v, want %v", got, want)
	}
	if _, err := imagePids(t.TempDir()); err == nil {
		t.Fatal("no error for a directory without an image")
	}
}

// TestPidHolders runs in the test's own PID namespace: the test process
// plays init, and the pids it needs are held in each way a pid can be.
func TestPidHolders(t *testing.T) {
	start := func(t *testing.T, sys *syscall.SysProcAttr, argv ...string) *exec.Cmd {
		t.Helper()
		c := exec.Command(argv[0], argv[1:]...)
		c.SysProcAttr = sys
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = c.Process.Kill(); _ = c.Wait() })
		return c
	}
	for _, tc := range []struct {
		name string
		// run starts the processes and returns the pid needed and how it
		// must be reported held ("" for free).
		run func(t *testing.T) (int, string)
	}{
		{"own pid", func(t *testing.T) (int, string) {
			c := start(t, nil, "sleep", "100")
			return c.Process.Pid, "pid"
		}},
		{"group of a dead leader", func(t *testing.T) (int, string) {
			// sh leads a new group, starts sleep in it and exits: the
			// group id stays allocated while sleep lives.
			c := start(t, &syscall.SysProcAttr{Setpgid: true}, "sh", "-c", "sleep 100 & echo $! >/dev/null")
			pid := c.Process.Pid
			_ = c.Wait()
			return pid, "group"
		}},
		{"session of a dead leader", func(t *testing.T) (int, string) {
			// python leaves sh's group but stays in its session.
			c := start(t, &syscall.SysProcAttr{Setsid: true}, "sh", "-c", `python3 -c "import os, time; os.setpgid(0, 0); time.sleep(100)" &`)
			pid := c.Process.Pid
			_ = c.Wait()
			return pid, "session"
		}},
		{"free", func(t *testing.T) (int, string) {
			c := start(t, nil, "true")
			pid := c.Process.Pid
			_ = c.Wait()
			return pid, ""
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			need, how := tc.run(t)
			var hs []pidHolder
			var got []string
			// Orphans are reparented to the test's ancestors, not to the
			// test: look at every process of the host.
			deadline := time.Now().Add(10 * time.Second)
			for {
				var err error
				hs, err = pidHolders(1, []int{need}, nil)
				if err != nil {
					t.Fatal(err)
				}
				got = got[:0]
				for _, h := range hs {
					if !h.zombie {
						got = append(got, h.how)
					}
				}
				if how == "" || slices.Contains(got, how) || time.Now().After(deadline) {
					break
				}
				time.Sleep(10 * time.Millisecond)
			}
			t.Cleanup(func() {
				for _, h := range hs {
					if h.host != os.Getpid() {
						_ = syscall.Kill(h.host, syscall.SIGKILL)
					}
				}
			})
			switch {
			case how == "" && len(got) > 0:
				t.Fatalf("pid %d reported held: %v", need, hs)
			case how != "" && !slices.Contains(got, how):
				t.Fatalf("pid %d: holders %v, want one as %s", need, hs, how)
			}
			if how != "" && !strings.Contains(fmt.Sprint(hs), fmt.Sprintf("pid %d is the %s", need, how)) {
				t.Fatalf("holder text %v", hs)
			}
		})
	}
}

// A thread of the sandbox's init holds its id for good: pidHolders reports
// it, and waitPidsFree fails at once, naming the init. (The test process
// plays init; its Go runtime threads are the init's threads.)
func TestPidHoldersInitThread(t *testing.T) {
	ents, err := os.ReadDir("/proc/self/task")
	if err != nil {
		t.Fatal(err)
	}
	tid := 0
	for _, e := range ents {
		if n, _ := strconv.Atoi(e.Name()); n != os.Getpid() {
			tid = n
		}
	}
	if tid == 0 {
		t.Fatal("the test process has one thread")
	}
	hs, err := pidHolders(os.Getpid(), []int{tid}, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(hs) != 1 || !hs[0].init || hs[0].how != "thread" {
		t.Fatalf("holders of thread %d: %+v, want the init's thread", tid, hs)
	}
	err = waitPidsFree(context.Background(), os.Getpid(), []int{tid}, nil)
	if err == nil || !strings.Contains(err.Error(), fmt.Sprintf("pid %d is the thread of the sandbox's init", tid)) {
		t.Fatalf("waitPidsFree: %v", err)
	}
}

// imageOnly runs cmd in the shell, takes checkpoint id of sb, waits for
// its image and evicts its templates, so that it restores from the image;
// it returns the pid the image recreates (the shell's dump copy's).
func imageOnly(t *testing.T, e *Engine, sb *testSandbox, live session, id, cmd string) []int {
	t.Helper()
	ctx := ctxT(t)
	bashChat(t, live, cmd)
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: id}); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitImage(ctx, id); err != nil {
		t.Fatal(err)
	}
	if err := e.Evict(id); err != nil {
		t.Fatal(err)
	}
	need, err := e.imagePidsOf(id, sb.ID())
	if err != nil || len(need) != 1 {
		t.Fatalf("%s's image pids %v, %v", id, need, err)
	}
	return need
}

// restoreAsk restores checkpoint id into sb, checks the path the restore
// took and the restored shell's answer to cmd, and the sessions
// (checkSessions); it returns the restored shell's session.
func restoreAsk(t *testing.T, e *Engine, sb *testSandbox, id, wantPath, cmd, want string) session {
	t.Helper()
	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, id, RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatalf("restore %s: %v", id, err)
	}
	if res.Path != wantPath {
		t.Fatalf("restore %s: path %s, want %s", id, res.Path, wantPath)
	}
	live := <-sessions
	if got := bashChat(t, live, cmd); got != want {
		t.Fatalf("after restore %s: %q, want %q", id, got, want)
	}
	checkSessions(t, sb, e)
	return live
}

// setLastPID sets the last pid handed out in init's PID namespace, so that
// the namespace's next fork gets pid v+1.
func setLastPID(t *testing.T, init, v int) {
	t.Helper()
	out, err := exec.Command("nsenter", "-t", strconv.Itoa(init), "-p", "--",
		"/bin/sh", "-c", fmt.Sprintf("echo %d >/proc/sys/kernel/ns_last_pid", v)).CombinedOutput()
	if err != nil {
		t.Fatalf("set ns_last_pid: %v: %s", err, out)
	}
}

// TestRestoreImageFreesHelperPids: an image's pids come from the upper half
// of the pid range, which a long run goes round, so a helper of another
// checkpoint (a template restored from its own image after a restart, or
// that template's warm spare) can hold a pid the image needs. A restore
// gets it back where nothing is lost: a spare is killed, and the templates
// of a checkpoint whose image is written are dropped (that checkpoint then
// restores from its image). Each case puts a helper of checkpoint a on the
// pid b's image needs, with ns_last_pid, before restoring b.
func TestRestoreImageFreesHelperPids(t *testing.T) {
	needCRIU(t)
	cases := []struct {
		name  string
		warm  bool
		holds string // which helper of a takes b's pid: "template" or "spare"
		// wantA is the path a's restore takes afterwards.
		wantA string
	}{
		{"template", false, "template", "criu"},
		{"template with spare", true, "template", "criu"},
		{"spare", true, "spare", "template"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sb := startSandbox(t, "bash", "--norc", "--noprofile")
			live := session{in: sb.in, out: sb.out}
			e := newEngine(t, Config{ImagesDir: t.TempDir(), Warm: tc.warm})
			ctx := ctxT(t)
			need := imageOnly(t, e, sb, live, "b", "cd /tmp; V=b")
			bashChat(t, live, "V=a")
			release := func() {}
			if tc.holds == "spare" {
				// a's template takes the pid before b's, its spare b's
				// own; a's image dump (which forks a copy) waits until
				// the spare is made, and until the end.
				hold := make(chan struct{})
				release = sync.OnceFunc(func() { close(hold) })
				t.Cleanup(release)
				e.beforeDump = func() { <-hold }
				setLastPID(t, sb.InitPID(), need[0]-2)
			} else {
				setLastPID(t, sb.InitPID(), need[0]-1)
			}
			if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "a"}); err != nil {
				t.Fatal(err)
			}
			if tc.warm && !waitUntil(ctx, 30*time.Second, func() bool { return e.SparesReady(sb.ID()) }) {
				t.Fatal("no spare for a's template")
			}
			if tc.holds != "spare" {
				if err := e.WaitImage(ctx, "a"); err != nil {
					t.Fatal(err)
				}
			}
			e.mu.Lock()
			tm := e.ckpts["a"].templates[0]
			holder := tm.proc.Pid()
			if tc.holds == "spare" {
				holder = tm.spare.Pid()
			}
			e.mu.Unlock()
			if p, err := readProc(holder); err != nil || p.NSPID != need[0] {
				t.Fatalf("a's %s is pid %d in the sandbox (%v), want %d, the pid b's image needs", tc.holds, p.NSPID, err, need[0])
			}
			restoreAsk(t, e, sb, "b", "criu", `echo "$PWD $V"`, "/tmp b")
			release()
			if err := e.WaitImage(ctx, "a"); err != nil {
				t.Fatal(err)
			}
			restoreAsk(t, e, sb, "a", tc.wantA, `echo "$PWD $V"`, "/tmp a")
		})
	}
}

// TestMakeRoomForImage: a restore's undo point is taken before the
// restore, as templates (Ephemeral) that hold their pids until the restore
// is done and have no image, so nothing can take those pids back. After a
// restart the sandbox's pid counter can sit just below the pids of the
// image to restore: MakeRoomForImage, called before the undo point, moves
// it past them.
func TestMakeRoomForImage(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	e := newEngine(t, Config{ImagesDir: t.TempDir()})
	ctx := ctxT(t)
	need := imageOnly(t, e, sb, live, "b", "cd /tmp; V=b")
	// A process of the sandbox holds a pid above b's (an orphan, now
	// init's child), and the counter is where the undo point's first
	// template would take b's pid: a CRIU restore leaves the counter at
	// the last pid it recreated, below pids held since.
	setLastPID(t, sb.InitPID(), need[0]+9)
	bashChat(t, live, "(sleep 1000 &); V=u")
	setLastPID(t, sb.InitPID(), need[0]-1)
	if err := e.MakeRoomForImage(sb, "b"); err != nil {
		t.Fatal(err)
	}
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "u", Ephemeral: true}); err != nil {
		t.Fatal(err)
	}
	e.mu.Lock()
	var tpids []int
	for _, tm := range e.ckpts["u"].templates {
		tpids = append(tpids, tm.proc.Pid())
	}
	e.mu.Unlock()
	if len(tpids) != 2 {
		t.Fatalf("the undo point has %d templates, want 2 (bash and the orphan sleep)", len(tpids))
	}
	for _, tpid := range tpids {
		if p, err := readProc(tpid); err != nil || p.NSPID <= need[0] {
			t.Fatalf("an undo point's template is pid %d in the sandbox (%v), want one above %d, the pid b's image needs", p.NSPID, err, need[0])
		}
	}
	live = restoreAsk(t, e, sb, "b", "criu", `echo "$PWD $V"`, "/tmp b")
	// Without the move the same steps fail: the template takes the pid.
	bashChat(t, live, "V=b2")
	e.Drop("u")
	if err := e.Evict("b"); err != nil {
		t.Fatal(err)
	}
	setLastPID(t, sb.InitPID(), need[0]-1)
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "u2", Ephemeral: true}); err != nil {
		t.Fatal(err)
	}
	stdio, _ := freshStdio(t, sb)
	if _, err := e.Restore(ctx, sb, "b", RestoreOptions{Stdio: stdio}); err == nil || !strings.Contains(err.Error(), "template of u2, no image") {
		t.Fatalf("restore b with u2's template on its pid: %v, want it refused naming u2's template", err)
	}
}

// TestPIDNSTranslatesThreads: the ids of every thread of a sandbox's
// processes (the init's and a python's with ten threads) come out the same
// through the namespace's ioctl as through each thread's status, and are
// the namespace's ids, not the host's.
func TestPIDNSTranslatesThreads(t *testing.T) {
	sb := startSandbox(t, "python3", "-c", "import threading, time\nfor _ in range(10): threading.Thread(target=time.sleep, args=(100,), daemon=True).start()\ntime.sleep(100)")
	ns := openPIDNS(sb.InitPID())
	defer ns.close()
	if ns.fd < 0 {
		t.Fatal("cannot open the sandbox's PID namespace")
	}
	// The python's threads start after it does.
	var py int
	if !waitUntil(context.Background(), 10*time.Second, func() bool {
		kids, _ := children(sb.InitPID())
		if len(kids) == 0 {
			return false
		}
		py = kids[0]
		ents, _ := os.ReadDir(fmt.Sprintf("/proc/%d/task", py))
		return len(ents) == 11
	}) {
		t.Fatal("python did not start its ten threads")
	}
	for _, pid := range []int{sb.InitPID(), py} {
		viaIoctl, err := ns.read(pid)
		if err != nil {
			t.Fatal(err)
		}
		if _, ok, _ := ns.tid(pid); !ok {
			t.Fatal("the kernel cannot translate ids (NS_GET_PID_IN_PIDNS, Linux 6.10): this test checks that path")
		}
		viaStatus, err := readNSIDs(pid)
		if err != nil {
			t.Fatal(err)
		}
		a, b := slices.Sorted(slices.Values(viaIoctl.tids)), slices.Sorted(slices.Values(viaStatus.tids))
		if !slices.Equal(a, b) || viaIoctl.pid != viaStatus.pid {
			t.Errorf("process %d: thread ids %v through the ioctl, %v through the statuses", pid, a, b)
		}
		// And back: the namespace's pid names the host's process.
		if host, ok := ns.host(viaIoctl.pid); !ok || host != pid {
			t.Errorf("process %d (%d in the namespace): back through the ioctl %d (ok %v)", pid, viaIoctl.pid, host, ok)
		}
		if pid == py {
			if host, err := hostPID(sb.InitPID(), viaIoctl.pid); err != nil || host != py {
				t.Errorf("hostPID(init, %d) = %d, %v; want %d", viaIoctl.pid, host, err, py)
			}
		}
		if pid == py && len(a) != 10 {
			t.Errorf("python %d: %d other threads, want 10", pid, len(a))
		}
		for _, tid := range a {
			if tid > 1000 {
				t.Errorf("process %d: thread id %d is not the namespace's (a new namespace's ids are small)", pid, tid)
			}
		}
	}
	// An id nothing has in the namespace.
	if host, ok := ns.host(999999); !ok || host != 0 {
		t.Errorf("an id nothing has in the namespace: host %d ok %v, want 0 true", host, ok)
	}
	// A thread id that is not in the namespace: gone.
	if _, ok, err := ns.tid(os.Getpid()); !ok || err != unix.ESRCH {
		t.Errorf("a host thread outside the namespace: ok %v err %v, want ESRCH", ok, err)
	}
}

// BenchmarkHostPID: finding a restored process's host pid from its pid in
// the sandbox's namespace, through the namespace's ioctl (hostPID) and
// through the walk of the init's descendants it replaced, in a sandbox
// whose init runs one sleep.
func BenchmarkHostPID(b *testing.B) {
	sb := startSandbox(b, "sleep", "100")
	var child int
	if !waitUntil(context.Background(), 10*time.Second, func() bool {
		kids, _ := children(sb.InitPID())
		if len(kids) == 1 {
			child = kids[0]
		}
		return child != 0
	}) {
		b.Fatal("the sleep did not start")
	}
	ids, err := readNSIDs(child)
	if err != nil {
		b.Fatal(err)
	}
	b.Run("ioctl", func(b *testing.B) {
		for b.Loop() {
			if pid, err := hostPID(sb.InitPID(), ids.pid); err != nil || pid != child {
				b.Fatalf("hostPID = %d, %v; want %d", pid, err, child)
			}
		}
	})
	b.Run("walk", func(b *testing.B) {
		for b.Loop() {
			ps, err := descendants(sb.InitPID(), nil)
			if err != nil || len(ps) != 1 || ps[0].NSPID != ids.pid {
				b.Fatalf("descendants = %v, %v", ps, err)
			}
		}
	})
}
