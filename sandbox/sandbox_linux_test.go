package sandbox

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestExec(t *testing.T) {
	sb := startTest(t, nil)
	tests := []struct {
		name     string
		argv     []string
		stdin    string
		wantOut  string
		wantErr  string
		wantCode int
	}{
		{"echo", []string{"echo", "hello", "world"}, "", "hello world\n", "", 0},
		{"exit code", []string{"sh", "-c", "exit 3"}, "", "", "", 3},
		{"stderr", []string{"sh", "-c", "echo out; echo err >&2; exit 1"}, "", "out\n", "err\n", 1},
		{"stdin", []string{"tr", "a-z", "A-Z"}, "abc\n", "ABC\n", "", 0},
		{"signal", []string{"sh", "-c", "kill -9 $$"}, "", "", "", 137},
		{"env", []string{"sh", "-c", "echo $FOO $HOME"}, "", "bar /root\n", "", 0},
		{"cwd", []string{"pwd"}, "", "/tmp\n", "", 0},
		{"hostname", []string{"cat", "/proc/sys/kernel/hostname"}, "", sb.ID() + "\n", "", 0},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var out, errb bytes.Buffer
			req := ExecRequest{Argv: tc.argv, Stdout: &out, Stderr: &errb, Env: []string{"FOO=bar"}}
			if tc.name == "cwd" {
				req.Dir = "/tmp"
			}
			if tc.stdin != "" {
				req.Stdin = strings.NewReader(tc.stdin)
			}
			code, err := sb.Exec(testCtx(t), req)
			if err != nil {
				t.Fatal(err)
			}
			if code != tc.wantCode || out.String() != tc.wantOut || errb.String() != tc.wantErr {
				t.Fatalf("got code %d out %q err %q; want %d %q %q", code, out.String(), errb.String(), tc.wantCode, tc.wantOut, tc.wantErr)
			}
		})
	}
	t.Run("missing command", func(t *testing.T) {
		_, err := sb.Exec(testCtx(t), ExecRequest{Argv: []string{"no-such-command-xyz"}})
		if err == nil || !strings.Contains(err.Error(), "not found") {
			t.Fatalf("want not found error, got %v", err)
		}
	})
	t.Run("missing directory", func(t *testing.T) {
		_, err := sb.Exec(testCtx(t), ExecRequest{Argv: []string{"true"}, Dir: "/no-such-dir-xyz"})
		if err == nil || !strings.Contains(err.Error(), "working directory /no-such-dir-xyz") {
			t.Fatalf("want an error naming the working directory, got %v", err)
		}
	})
	t.Run("cancel kills", func(t *testing.T) {
		ctx, cancel := context.WithCancel(context.Background())
		go func() { time.Sleep(100 * time.Millisecond); cancel() }()
		_, err := sb.Exec(ctx, ExecRequest{Argv: []string{"sleep", "1000"}})
		if !errors.Is(err, context.Canceled) {
			t.Fatalf("want context.Canceled, got %v", err)
		}
		waitFor(t, "sleep to die", func() bool {
			procs, _ := sb.Processes()
			for _, p := range procs {
				if p.Comm == "sleep" {
					return false
				}
			}
			return true
		})
	})
	t.Run("background child keeps stdout", func(t *testing.T) {
		out, _, code := run(t, sb, "sh", "-c", "sleep 1000 & echo started")
		if code != 0 || out != "started\n" {
			t.Fatalf("got %d %q", code, out)
		}
	})
}

func TestPIDNamespace(t *testing.T) {
	sb := startTest(t, nil)
	if got := sh(t, sb, "cat /proc/1/cmdline | tr '\\0' ' '"); got != "rewind-init " {
		t.Fatalf("pid 1 cmdline %q", got)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(sh(t, sb, "echo $$")))
	// A pid of the sandbox's own namespace: just above the floor its
	// init's threads stay below (TestPIDFloor).
	if err != nil || pid <= pidFloor || pid > pidFloor+100 {
		t.Fatalf("shell pid inside %d (%v), want one just above %d", pid, err, pidFloor)
	}
	// Only the sandbox's processes are visible.
	n := strings.Fields(sh(t, sb, "ls /proc | grep -c '^[0-9]'"))
	if c, _ := strconv.Atoi(n[0]); c > 5 {
		t.Fatalf("%d processes visible inside", c)
	}
	procs, err := sb.Processes()
	if err != nil {
		t.Fatal(err)
	}
	if len(procs) != 1 || procs[0].PID != sb.InitPID() || procs[0].NSPID != 1 || procs[0].Threads < 1 {
		t.Fatalf("Processes() = %+v, want only the init (host pid %d, ns pid 1)", procs, sb.InitPID())
	}
	// Namespaces differ from the host's.
	for _, ns := range []string{"pid", "mnt", "uts", "ipc", "net"} {
		host, _ := os.Readlink("/proc/self/ns/" + ns)
		in, err := os.Readlink(sb.NSPath(ns))
		if err != nil || in == host {
			t.Fatalf("%s namespace not separate: host %s sandbox %s (%v)", ns, host, in, err)
		}
	}
	// cgroups.
	var st os.FileInfo
	if st, err = os.Stat(sb.CgroupV2Dir()); err != nil || sb.CgroupID() == 0 {
		t.Fatalf("cgroup v2 dir %v id %d", err, sb.CgroupID())
	}
	_ = st
	cg, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sb.InitPID()))
	if err != nil || !strings.Contains(string(cg), ":freezer:/rewind/"+sb.ID()+"\n") || !strings.Contains(string(cg), "0::/rewind/"+sb.ID()+"\n") {
		t.Fatalf("init cgroups:\n%s", cg)
	}
}

func TestIsolation(t *testing.T) {
	marker := filepath.Join(t.TempDir(), "host-secret")
	if err := os.WriteFile(marker, []byte("x"), 0o644); err != nil {
		t.Fatal(err)
	}
	hideDir := "/etc/rewind-test-hide"
	sb := startTest(t, func(c *Config) { c.Hide = []string{"/etc/ssl", "/etc/hostname"} })
	_ = hideDir
	other := startTest(t, nil)
	sh(t, other, "sleep 1000 &")

	// Host files outside the root are not visible.
	if _, _, code := run(t, sb, "test", "-e", marker); code == 0 {
		t.Fatalf("host file %s visible inside", marker)
	}
	// /run/rewind is a private empty tmpfs; hidden dirs are empty.
	if out := sh(t, sb, "ls -A /run/rewind; ls -A /etc/ssl 2>&1 | head -1; echo end"); out != "end\n" && !strings.Contains(out, "Permission denied") {
		t.Fatalf("masked dirs not empty: %q", out)
	}
	if out := sh(t, sb, "wc -c < /etc/hostname"); strings.TrimSpace(out) != "0" {
		t.Fatalf("hidden file readable: %q", out)
	}
	// No route out of the sandbox's network namespace.
	if out, _, code := run(t, sb, "python3", "-c", "import socket\ntry:\n    socket.create_connection(('10.0.2.2', 80), timeout=2)\nexcept OSError as e:\n    print(e.errno)"); code != 0 || strings.TrimSpace(out) != "101" {
		t.Fatalf("connect out of the sandbox: %q (exit %d), want ENETUNREACH (101)", out, code)
	}
	// Only loopback, and it is up.
	if out := sh(t, sb, "cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '"); out != "lo\n" {
		t.Fatalf("interfaces %q", out)
	}
	// Reduced capabilities, the same for the init (PID 1 as the sandbox
	// sees it) and its children: no mount, no mknod.
	if out := sh(t, sb, "grep -h -E 'Cap(Eff|Prm|Bnd)' /proc/1/task/*/status /proc/self/status | cut -f2 | sort -u | wc -l"); out != "1\n" {
		t.Fatalf("init threads and sandbox processes differ in capabilities: %q", out)
	}
	// Nothing inheritable or ambient (the init gets its setup
	// capabilities through its inheritable set, see startReduced).
	if out := sh(t, sb, "grep -h -E 'Cap(Inh|Amb)' /proc/1/task/*/status /proc/self/status | cut -f2 | sort -u"); out != "0000000000000000\n" {
		t.Fatalf("init threads or sandbox processes keep inheritable or ambient capabilities: %q", out)
	}
	if out := sh(t, sb, "grep CapEff /proc/self/status | cut -f2"); out == "000001ffffffffff\n" || out == "000001fffeffffff\n" {
		t.Fatalf("sandbox process has every capability: %q", out)
	}
	if _, errs, code := run(t, sb, "sh", "-c", "mkdir -p /tmp/m && mount -t tmpfs x /tmp/m"); code == 0 || !strings.Contains(errs, "permission denied") {
		t.Fatalf("mount inside the sandbox: exit %d, %q", code, errs)
	}
	if _, errs, code := run(t, sb, "mknod", "/tmp/disk", "b", "8", "0"); code == 0 || !strings.Contains(errs, "not permitted") {
		t.Fatalf("mknod inside the sandbox: exit %d, %q", code, errs)
	}
	// Dangerous kernel interfaces are read-only or masked.
	if _, _, code := run(t, sb, "sh", "-c", "echo h > /proc/sysrq-trigger"); code == 0 {
		t.Fatal("/proc/sysrq-trigger writable inside the sandbox")
	}
	if out := sh(t, sb, "cat /proc/timer_list /proc/keys 2>/dev/null | wc -c"); strings.TrimSpace(out) != "0" {
		t.Fatalf("/proc/timer_list, /proc/keys readable: %q", out)
	}
	// The other sandbox's processes are invisible and unreachable.
	if out := sh(t, sb, "grep -l sleep /proc/[0-9]*/comm 2>/dev/null | wc -l"); strings.TrimSpace(out) != "0" {
		t.Fatalf("other sandbox's sleep visible: %q", out)
	}
	// Sandbox processes start with default signal dispositions.
	if out := sh(t, sb, "grep -E 'SigIgn|SigBlk' /proc/self/status | cut -f2 | sort -u"); out != "0000000000000000\n" {
		t.Fatalf("sandbox process starts with ignored or blocked signals: %q", out)
	}
	// Signals from inside do not kill the init.
	sh(t, sb, "for s in TERM INT HUP QUIT USR1 USR2 PIPE ALRM SEGV BUS FPE ILL TRAP SYS XCPU XFSZ PROF STOP TSTP; do kill -$s 1; done; true")
	time.Sleep(50 * time.Millisecond)
	if err := sb.Ping(testCtx(t)); err != nil {
		t.Fatalf("init died after signals: %v", err)
	}
	// WriteRunFile lands in /run/rewind inside.
	if err := sb.WriteRunFile("copy", []byte("7\n")); err != nil {
		t.Fatal(err)
	}
	if out := sh(t, sb, "cat /run/rewind/copy"); out != "7\n" {
		t.Fatalf("run file %q", out)
	}
	// A sandbox symlink does not redirect WriteRunFile out of the sandbox.
	sh(t, sb, "ln -s /etc/hostname-escape /run/rewind/evil || true")
	if err := sb.WriteRunFile("evil", []byte("x")); err == nil {
		t.Fatal("WriteRunFile followed a symlink")
	}
}

func TestSession(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "bash", Argv: []string{"bash", "--norc"}, Dir: "/"})
	if err != nil {
		t.Fatal(err)
	}
	if sb.Session("bash") != ss {
		t.Fatal("Session lookup")
	}
	if _, err := sb.StartSession(ctx, SessionConfig{ID: "bash", Argv: []string{"bash"}}); !errors.Is(err, ErrSessionExists) {
		t.Fatalf("duplicate session: %v", err)
	}
	steps := []struct{ send, want string }{
		{"cd /tmp && export V=42 && f() { echo fn-$1; }", ""},
		{"echo $V $(pwd)", "42 /tmp\n"},
		{"f x", "fn-x\n"},
		{"echo err >&2", "err\n"},
	}
	for _, st := range steps {
		out, err := ss.Send(ctx, st.send, SendOptions{})
		if err != nil || out != st.want {
			t.Fatalf("Send %q = %q, %v; want %q", st.send, out, err, st.want)
		}
	}
	// Until returns on the marker even when the command is slow.
	out, err := ss.Send(ctx, "sleep 0.5; echo DONE-1", SendOptions{Until: regexp.MustCompile(`DONE-\d`)})
	if err != nil || out != "DONE-1\n" {
		t.Fatalf("until: %q %v", out, err)
	}
	// Output printed between sends is kept for the next call.
	if _, err := ss.Send(ctx, "(sleep 0.3; echo late) &", SendOptions{Idle: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "background output to be buffered", func() bool {
		ss.mu.Lock()
		defer ss.mu.Unlock()
		return strings.Contains(string(ss.buf), "late")
	})
	if out, err := ss.Send(ctx, "echo now", SendOptions{}); err != nil || out != "late\nnow\n" {
		t.Fatalf("buffered output: %q %v", out, err)
	}
	// Until matches only what comes after the text: a match already in
	// the buffered output (an earlier command's late answer, a prompt
	// printed at start) does not end the read early.
	if _, err := ss.Send(ctx, "(sleep 0.3; echo MARK-old) &", SendOptions{Idle: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "background output to be buffered", func() bool {
		ss.mu.Lock()
		defer ss.mu.Unlock()
		return strings.Contains(string(ss.buf), "MARK-old")
	})
	a, err := ss.SendAnswer(ctx, "sleep 0.3; echo MARK-new", SendOptions{Until: regexp.MustCompile(`MARK-\w+\n`)})
	if err != nil || a.Output != "MARK-old\nMARK-new\n" || !a.Matched {
		t.Fatalf("until over buffered output: %+v %v; want both lines, matched", a, err)
	}
	if a, err := ss.SendAnswer(ctx, "echo idle", SendOptions{Idle: 50 * time.Millisecond}); err != nil || a.Output != "idle\n" || a.Matched {
		t.Fatalf("idle answer: %+v %v; want not matched", a, err)
	}
	// A signal to the session's process: bash survives a SIGINT aimed at it
	// alone and reports the trap.
	if _, err := ss.Send(ctx, "trap 'echo got-int' INT", SendOptions{Idle: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if err := ss.Signal(ctx, unix.SIGINT, false); err != nil {
		t.Fatal(err)
	}
	if out, err := ss.Send(ctx, "echo after", SendOptions{Until: regexp.MustCompile(`after\n`)}); err != nil || out != "got-int\nafter\n" {
		t.Fatalf("after SIGINT: %q %v", out, err)
	}
	if ss.PID() == 0 || ss.NSPID() < 2 {
		t.Fatalf("pids %d %d", ss.PID(), ss.NSPID())
	}
	// Exit code of the session.
	if _, err := ss.Send(ctx, "exit 5", SendOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ss.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("session did not exit")
	}
	if ss.ExitCode() != 5 {
		t.Fatalf("exit code %d", ss.ExitCode())
	}
	if _, err := ss.Send(ctx, "echo x", SendOptions{}); !errors.Is(err, ErrSessionExited) {
		t.Fatalf("send after exit: %v", err)
	}
	// Python REPL.
	py, err := sb.StartSession(ctx, SessionConfig{ID: "py", Argv: []string{"python3", "-i", "-q"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := py.Send(ctx, "x = [i*i for i in range(10)]", SendOptions{}); err != nil {
		t.Fatal(err)
	}
	out, err = py.Send(ctx, "print(sum(x))", SendOptions{Until: regexp.MustCompile(`285\n`)})
	if err != nil || !strings.Contains(out, "285\n") {
		t.Fatalf("python: %q %v", out, err)
	}
	if err := py.Close(); err != nil {
		t.Fatal(err)
	}
	if sb.Session("py") != nil {
		t.Fatal("closed session still listed")
	}
}

func TestFreezeThaw(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	counter := filepath.Join(sb.Root(), "tmp", "counter")
	if _, err := sb.StartSession(ctx, SessionConfig{ID: "count", Argv: []string{"sh", "-c", "i=0; while :; do i=$((i+1)); echo $i > /tmp/counter.new; mv /tmp/counter.new /tmp/counter; done"}}); err != nil {
		t.Fatal(err)
	}
	read := func() int {
		b, err := os.ReadFile(counter)
		if err != nil {
			return -1
		}
		n, err := strconv.Atoi(strings.TrimSpace(string(b)))
		if err != nil {
			return -1
		}
		return n
	}
	waitFor(t, "counter to run", func() bool { return read() > 10 })
	for round := 0; round < 3; round++ {
		if err := sb.Freeze(ctx); err != nil {
			t.Fatal(err)
		}
		a := read()
		time.Sleep(200 * time.Millisecond)
		if b := read(); b != a {
			t.Fatalf("counter moved while frozen: %d -> %d", a, b)
		}
		procs, err := sb.Processes()
		if err != nil || len(procs) < 2 {
			t.Fatalf("processes while frozen: %v %v", procs, err)
		}
		if err := sb.Thaw(ctx); err != nil {
			t.Fatal(err)
		}
		waitFor(t, "counter to move after thaw", func() bool { return read() > a })
	}
}

func TestCloseLeavesNothing(t *testing.T) {
	requireSandbox(t)
	root, binds := testRoot(t)
	ctx := testCtx(t)
	sb, err := Start(ctx, Config{ID: fmt.Sprintf("close-%d", os.Getpid()), Root: root, Binds: binds})
	if err != nil {
		t.Fatal(err)
	}
	hooked := false
	sb.OnClose(func() { hooked = true })
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "s", Argv: []string{"bash"}})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, sb, "sleep 1000 & sleep 1000 & (sleep 1000 & kill -STOP $!) ; true")
	sh(t, sb, "sh -c 'kill -STOP $$' & true")
	// A ptrace-stopped process whose tracer (this process) never detaches
	// nor waits after the kill, as a template of package cr could be.
	traced, err := sb.StartSession(ctx, SessionConfig{ID: "traced", Argv: []string{"sleep", "1000"}})
	if err != nil {
		t.Fatal(err)
	}
	attached, release := make(chan error), make(chan struct{})
	defer close(release)
	go func() {
		runtime.LockOSThread()
		pid := traced.PID()
		err := unix.PtraceAttach(pid)
		if err == nil {
			var ws unix.WaitStatus
			_, err = unix.Wait4(pid, &ws, unix.WALL, nil)
		}
		attached <- err
		<-release
	}()
	if err := <-attached; err != nil {
		t.Fatalf("ptrace attach: %v", err)
	}
	procs, err := sb.Processes()
	if err != nil || len(procs) < 6 {
		t.Fatalf("processes: %+v %v", procs, err)
	}
	var ids []proc
	for _, p := range procs {
		ids = append(ids, procOf(p.PID))
	}
	if err := sb.Freeze(ctx); err != nil {
		t.Fatal(err)
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if !hooked {
		t.Fatal("OnClose hook not run")
	}
	for _, p := range ids {
		if alive(p) {
			t.Fatalf("process %+v survived Close", p)
		}
	}
	for _, d := range []string{sb.FreezerDir(), sb.CgroupV2Dir(), keepDirOf(sb)} {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("cgroup %s still exists (%v)", d, err)
		}
	}
	if _, err := ss.Send(ctx, "echo", SendOptions{}); !errors.Is(err, ErrClosed) {
		t.Fatalf("send after close: %v", err)
	}
	if _, err := sb.Exec(ctx, ExecRequest{Argv: []string{"true"}}); err == nil {
		t.Fatal("exec after close succeeded")
	}
	if err := sb.Close(); err != nil {
		t.Fatalf("second Close: %v", err)
	}
}

func TestKillProcesses(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	keep, err := sb.StartSession(ctx, SessionConfig{ID: "keep", Argv: []string{"cat"}})
	if err != nil {
		t.Fatal(err)
	}
	sh(t, sb, "sleep 1000 & sleep 1000 & true")
	keepPID := keep.PID()
	if err := sb.KillProcesses(ctx, func(p Process) bool { return p.PID == keepPID }); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "only init and the kept session", func() bool {
		procs, err := sb.Processes()
		if err != nil {
			t.Fatal(err)
		}
		live := 0
		for _, p := range procs {
			if p.State != "Z" {
				live++
			}
		}
		return live == 2
	})
	if out, err := keep.Send(ctx, "still here", SendOptions{}); err != nil || out != "still here\n" {
		t.Fatalf("kept session: %q %v", out, err)
	}
}

// TestAdoptSession plays the cr side of seam #3: a process created inside the
// sandbox picks up fresh channels from /proc/1/fd/N and becomes a session.
func TestAdoptSession(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	old, err := sb.StartSession(ctx, SessionConfig{ID: "main", Argv: []string{"bash"}})
	if err != nil {
		t.Fatal(err)
	}
	ch, err := sb.NewChannels()
	if err != nil {
		t.Fatal(err)
	}
	in, out, err := sb.mustInitFDs(ctx, ch)
	if err != nil {
		t.Fatal(err)
	}
	heldIn, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", sb.InitPID(), in))
	heldOut, _ := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", sb.InitPID(), out))
	if !strings.HasPrefix(heldIn, "pipe:") || !strings.HasPrefix(heldOut, "pipe:") {
		t.Fatalf("init holds %q %q, want pipes", heldIn, heldOut)
	}
	// The "restored" process: a bash whose stdio comes from the init's fds,
	// reparented to init when its launcher exits.
	script := fmt.Sprintf("(exec </proc/1/fd/%d >/proc/1/fd/%d 2>&1; exec bash) & echo $!", in, out)
	nspid, err := strconv.Atoi(strings.TrimSpace(sh(t, sb, script)))
	if err != nil {
		t.Fatal(err)
	}
	var host int
	waitFor(t, "restored process", func() bool {
		host = sb.hostPID(nspid)
		p, err := readProcess(host)
		return host != 0 && err == nil && p.PPID == sb.InitPID()
	})
	ss, err := sb.AdoptSession("main", host, ch)
	if err != nil {
		t.Fatal(err)
	}
	if sb.Session("main") != ss {
		t.Fatal("session not replaced")
	}
	if _, err := old.Send(ctx, "echo", SendOptions{}); !errors.Is(err, ErrSessionReplaced) {
		t.Fatalf("old session: %v", err)
	}
	if got, err := ss.Send(ctx, "echo adopted $$", SendOptions{}); err != nil || got != fmt.Sprintf("adopted %d\n", nspid) {
		t.Fatalf("adopted send: %q %v", got, err)
	}
	// The init released its copies: only the daemon and the process hold the pipes.
	for _, link := range initLinks(t, sb) {
		if link == heldIn || link == heldOut {
			t.Fatalf("init still holds channel %s", link)
		}
	}
	if _, err := ss.Send(ctx, "exit 9", SendOptions{}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ss.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("adopted session did not end")
	}
	if ss.ExitCode() != 9 {
		t.Fatalf("adopted exit code %d", ss.ExitCode())
	}
	// Unused channels are released.
	ch2, err := sb.NewChannels()
	if err != nil {
		t.Fatal(err)
	}
	if _, _, err := ch2.InitFDs(ctx); err != nil {
		t.Fatal(err)
	}
	if err := ch2.Close(); err != nil {
		t.Fatal(err)
	}
}

// initLinks returns what the init's fds point to.
func initLinks(t *testing.T, sb *Sandbox) []string {
	t.Helper()
	dir := fmt.Sprintf("/proc/%d/fd", sb.InitPID())
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var links []string
	for _, e := range ents {
		if l, err := os.Readlink(dir + "/" + e.Name()); err == nil {
			links = append(links, l)
		}
	}
	return links
}

func (s *Sandbox) mustInitFDs(ctx context.Context, ch *Channels) (int, int, error) {
	return ch.InitFDs(ctx)
}

// TestInitCrash: when the init dies, sessions end, calls fail cleanly and
// Close still removes everything.
func TestInitCrash(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "s", Argv: []string{"cat"}})
	if err != nil {
		t.Fatal(err)
	}
	pid := procOf(ss.PID())
	if err := syscall.Kill(sb.InitPID(), syscall.SIGKILL); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ss.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("session not ended after init crash")
	}
	<-sb.Done()
	if alive(pid) {
		t.Fatal("session process survived its init")
	}
	if _, err := sb.Exec(ctx, ExecRequest{Argv: []string{"true"}}); err == nil {
		t.Fatal("exec after init crash succeeded")
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(sb.CgroupV2Dir()); !os.IsNotExist(err) {
		t.Fatalf("cgroup left: %v", err)
	}
}

// TestParallelStart starts sandboxes concurrently (fork fan-out) and checks
// each is isolated and works.
func TestParallelStart(t *testing.T) {
	requireSandbox(t)
	const n = 8
	errs := make(chan error, n)
	for i := 0; i < n; i++ {
		go func(i int) {
			root, binds := testRoot(t)
			sb, err := Start(testCtx(t), Config{ID: fmt.Sprintf("par-%d-%d", os.Getpid(), i), Root: root, Binds: binds})
			if err != nil {
				errs <- err
				return
			}
			defer sb.Close()
			if err := sb.WriteRunFile("copy", []byte(strconv.Itoa(i)+"\n")); err != nil {
				errs <- err
				return
			}
			var out bytes.Buffer
			code, err := sb.Exec(testCtx(t), ExecRequest{Argv: []string{"sh", "-c", "cat /run/rewind/copy /proc/1/cmdline"}, Stdout: &out})
			if err == nil && (code != 0 || out.String() != fmt.Sprintf("%d\nrewind-init\x00", i)) {
				err = fmt.Errorf("sandbox %d: code %d out %q", i, code, out.String())
			}
			errs <- err
		}(i)
	}
	for i := 0; i < n; i++ {
		if err := <-errs; err != nil {
			t.Error(err)
		}
	}
}

func TestLimits(t *testing.T) {
	sb := startTest(t, func(c *Config) { c.PidsMax = 16; c.MemoryMax = 64 << 20 })
	// A fork bomb stays within pids.max.
	run(t, sb, "sh", "-c", "for i in $(seq 100); do sleep 1000 2>/dev/null & done 2>/dev/null; true")
	procs, err := sb.Processes()
	threads := 0
	for _, p := range procs {
		threads += p.Threads
	}
	if err != nil || threads > 16+initThreadAllowance || len(procs) < 16 {
		t.Fatalf("%d processes, %d tasks with pids.max 16 (%v)", len(procs), threads, err)
	}
	// The init survived the limit and still works.
	for i := 0; i < 3; i++ {
		if err := sb.Ping(testCtx(t)); err != nil {
			t.Fatalf("init after fork bomb: %v", err)
		}
		if _, err := sb.Exec(testCtx(t), ExecRequest{Argv: []string{"true"}}); err == nil {
			break // (may fail while the limit is full: that is fine)
		}
	}
	if err := sb.KillProcesses(testCtx(t), nil); err != nil {
		t.Fatal(err)
	}
	// Allocating past memory.max gets the process killed, not the host.
	_, _, code := run(t, sb, "python3", "-c", "b = bytearray(256 << 20); b[::4096] = b'x' * len(b[::4096]); print(len(b))")
	if code == 0 {
		t.Fatal("256 MiB allocation succeeded under a 64 MiB limit")
	}
	// The limits' cgroups go away with the sandbox.
	dirs := sb.cgroupDirs()
	if len(dirs) != 4 {
		t.Fatalf("cgroups %v", dirs)
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	for _, d := range dirs {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("cgroup %s left (%v)", d, err)
		}
	}
}

// TestCleanupStale: the cgroups of a sandbox whose daemon died (simulated:
// processes left in them) are emptied and removed.
func TestCleanupStale(t *testing.T) {
	requireSandbox(t)
	id := fmt.Sprintf("stale-%d", os.Getpid())
	var procs []*exec.Cmd
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent} {
		dir := filepath.Join(parent, id)
		if err := makeCgroup(dir); err != nil {
			t.Fatal(err)
		}
		c := exec.Command("sleep", "1000")
		if err := c.Start(); err != nil {
			t.Fatal(err)
		}
		procs = append(procs, c)
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(c.Process.Pid)), 0); err != nil {
			t.Fatal(err)
		}
	}
	if ids, err := CgroupIDs(); err != nil || !slices.Contains(ids, id) {
		t.Fatalf("CgroupIDs() = %v, %v; want %s in it", ids, err, id)
	}
	done := make(chan struct{})
	go func() {
		for _, c := range procs {
			_ = c.Wait()
		}
		close(done)
	}()
	if err := CleanupStale(id); err != nil {
		t.Fatal(err)
	}
	select {
	case <-done:
	case <-time.After(30 * time.Second):
		t.Fatal("stale processes survived")
	}
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent, DefaultMemoryParent} {
		if _, err := os.Stat(filepath.Join(parent, id)); !os.IsNotExist(err) {
			t.Fatalf("%s left: %v", filepath.Join(parent, id), err)
		}
	}
	if err := CleanupStale("../x"); err == nil {
		t.Fatal("CleanupStale accepted a bad id")
	}
}

// TestCancelledSpawnLeavesNothing: a command whose caller gives up while
// the init starts it is killed, whichever way the race goes.
func TestCancelledSpawnLeavesNothing(t *testing.T) {
	sb := startTest(t, nil)
	for i := 0; i < 30; i++ {
		ctx, cancel := context.WithTimeout(context.Background(), time.Duration(i*50)*time.Microsecond)
		_, _ = sb.Exec(ctx, ExecRequest{Argv: []string{"sleep", "1000"}})
		_, _ = sb.StartSession(ctx, SessionConfig{ID: fmt.Sprint("s", i), Argv: []string{"sleep", "1000"}})
		cancel()
	}
	// Sessions that did start are legitimate; close them.
	for _, ss := range sb.Sessions() {
		_ = ss.Close()
	}
	waitFor(t, "cancelled commands to be killed", func() bool {
		procs, _ := sb.Processes()
		for _, p := range procs {
			if p.Comm == "sleep" && p.State != "Z" {
				return false
			}
		}
		return true
	})
}

// TestConcurrentUseAndClose: execs, sessions, freezes and a Close racing
// each other end cleanly (no deadlock, no leftover process or cgroup).
func TestConcurrentUseAndClose(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	stop := make(chan struct{})
	done := make(chan struct{})
	workers := 0
	worker := func(f func(i int)) {
		workers++
		go func() {
			defer func() { done <- struct{}{} }()
			for i := 0; ; i++ {
				select {
				case <-stop:
					return
				default:
				}
				f(i)
			}
		}()
	}
	worker(func(i int) { _, _ = sb.Exec(ctx, ExecRequest{Argv: []string{"echo", "x"}, Stdout: io.Discard}) })
	worker(func(i int) {
		ss, err := sb.StartSession(ctx, SessionConfig{ID: fmt.Sprint("w", i), Argv: []string{"cat"}})
		if err == nil {
			_, _ = ss.Send(ctx, "hi", SendOptions{Idle: time.Millisecond})
			_ = ss.Close()
		}
	})
	worker(func(i int) {
		if sb.Freeze(ctx) == nil {
			_ = sb.Thaw(ctx)
		}
	})
	worker(func(i int) { _, _ = sb.Processes() })
	time.Sleep(300 * time.Millisecond)
	closed := make(chan error, 1)
	go func() { closed <- sb.Close() }()
	select {
	case err := <-closed:
		if err != nil {
			t.Fatalf("Close: %v", err)
		}
	case <-time.After(60 * time.Second):
		t.Fatal("Close hung")
	}
	close(stop)
	for i := 0; i < workers; i++ {
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			t.Fatal("a worker hung after Close")
		}
	}
	// (cgroups can only be removed once no live process is left in them)
	for _, d := range sb.cgroupDirs() {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Fatalf("cgroup %s left", d)
		}
	}
}

func TestTTYSession(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "tty", Argv: []string{"bash", "--norc", "-i"}, TTY: true, Rows: 30, Cols: 100, Env: []string{"PS1=$ "}})
	if err != nil {
		t.Fatal(err)
	}
	out, err := ss.Send(ctx, "tty; stty size; echo $((6*7))", SendOptions{Until: regexp.MustCompile(`\n42\r?\n`)})
	if err != nil || !strings.Contains(out, "/dev/pts/") || !strings.Contains(out, "30 100") {
		t.Fatalf("tty session: %q %v", out, err)
	}
	// Python without -i is interactive on a terminal.
	if _, err := ss.Send(ctx, "python3 -q", SendOptions{Until: regexp.MustCompile(`>>> $`)}); err != nil {
		t.Fatal(err)
	}
	if out, err := ss.Send(ctx, "print(sum(range(10)))", SendOptions{Until: regexp.MustCompile(`45\r?\n`)}); err != nil || !strings.Contains(out, "45") {
		t.Fatalf("python on tty: %q %v", out, err)
	}
	if _, err := ss.Send(ctx, "exit()", SendOptions{Until: regexp.MustCompile(`\$ $`)}); err != nil {
		t.Fatal(err)
	}
	if _, err := ss.Send(ctx, "exit 3", SendOptions{Idle: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	select {
	case <-ss.Done():
	case <-time.After(30 * time.Second):
		t.Fatal("tty session did not end")
	}
	if ss.ExitCode() != 3 {
		t.Fatalf("exit code %d", ss.ExitCode())
	}
}

func TestKeepCaps(t *testing.T) {
	sb := startTest(t, func(c *Config) { c.KeepCaps = true })
	if _, errs, code := run(t, sb, "sh", "-c", "mkdir -p /tmp/m && mount -t tmpfs x /tmp/m"); code != 0 {
		t.Fatalf("mount with KeepCaps: exit %d %s", code, errs)
	}
}

// keepDirOf is where sb's kept-frozen freezer cgroup lives.
func keepDirOf(sb *Sandbox) string {
	return filepath.Join(filepath.Dir(sb.FreezerDir()), ".keep-"+sb.ID())
}

// TestKeepFreezerActive: while a sandbox lives, an empty sibling freezer
// cgroup stays FROZEN (it holds the kernel's freezer static key on, so
// freezing the sandbox patches no kernel text); the sandbox itself runs,
// freezes and thaws as before, and Close removes the sibling.
func TestKeepFreezerActive(t *testing.T) {
	sb := startTest(t, nil)
	ctx := testCtx(t)
	keep := keepDirOf(sb)
	if sb.keepDir != keep {
		t.Fatalf("kept-frozen cgroup %q, want %q", sb.keepDir, keep)
	}
	state := func(dir string) string {
		b, err := os.ReadFile(filepath.Join(dir, "freezer.state"))
		if err != nil {
			t.Fatal(err)
		}
		return strings.TrimSpace(string(b))
	}
	if got := state(keep); got != "FROZEN" {
		t.Fatalf("%s: state %s, want FROZEN", keep, got)
	}
	if b, err := os.ReadFile(filepath.Join(keep, "cgroup.procs")); err != nil || len(b) != 0 {
		t.Fatalf("%s holds tasks: %q %v", keep, b, err)
	}
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "k", Argv: []string{"bash"}})
	if err != nil {
		t.Fatal(err)
	}
	for range 3 {
		if err := sb.Freeze(ctx); err != nil {
			t.Fatal(err)
		}
		if got := state(sb.FreezerDir()); got != "FROZEN" {
			t.Fatalf("sandbox state %s after Freeze", got)
		}
		if err := sb.Thaw(ctx); err != nil {
			t.Fatal(err)
		}
		if got, keepGot := state(sb.FreezerDir()), state(keep); got != "THAWED" || keepGot != "FROZEN" {
			t.Fatalf("after Thaw: sandbox %s, kept cgroup %s", got, keepGot)
		}
		out, err := ss.Send(ctx, "echo alive", SendOptions{})
		if err != nil || !strings.Contains(out, "alive") {
			t.Fatalf("session after thaw: %q %v", out, err)
		}
	}
	if err := sb.Close(); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(keep); !os.IsNotExist(err) {
		t.Fatalf("%s still exists after Close (%v)", keep, err)
	}
}
