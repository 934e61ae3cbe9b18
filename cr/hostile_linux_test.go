package cr

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/sandbox"
	"golang.org/x/sys/unix"
)

// hostileRoot is a sandbox root whose /etc, /root, /run, /tmp and
// /usr/lib/criu belong to the agent (as on a real sandbox's DeltaFS root);
// only the programs and libraries it needs come read-only from the host.
func hostileRoot(t *testing.T) (string, []sandbox.Bind) {
	t.Helper()
	root := t.TempDir()
	for _, d := range []string{"tmp", "root", "proc", "dev", "run", "etc", "usr/lib/criu"} {
		must(os.MkdirAll(filepath.Join(root, d), 0o755))
	}
	must(os.Chmod(filepath.Join(root, "tmp"), 0o1777))
	var binds []sandbox.Bind
	for _, d := range []string{"/usr/bin", "/usr/sbin", "/usr/lib64", "/usr/lib/x86_64-linux-gnu", "/usr/lib/aarch64-linux-gnu"} {
		if st, err := os.Stat(d); err != nil || !st.IsDir() {
			continue
		}
		must(os.MkdirAll(filepath.Join(root, d), 0o755))
		binds = append(binds, sandbox.Bind{Source: d, Target: d, ReadOnly: true})
	}
	for _, d := range []string{"bin", "sbin", "lib", "lib64"} {
		if fi, err := os.Lstat("/" + d); err == nil && fi.Mode()&os.ModeSymlink != 0 {
			target, err := os.Readlink("/" + d)
			must(err)
			must(os.Symlink(target, filepath.Join(root, d)))
		}
	}
	return root, binds
}

func startHostile(t *testing.T, root string, binds []sandbox.Bind) *sandbox.Sandbox {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat(filepath.Dir(sandbox.DefaultFreezerParent))
	testenv.Require(t, err == nil, "cgroup v1 freezer")
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sb, err := sandbox.Start(ctx, sandbox.Config{
		ID:    fmt.Sprintf("crhostile-%d-%d", os.Getpid(), realSeq.Add(1)),
		Root:  root,
		Binds: binds,
	})
	if err != nil {
		t.Fatalf("sandbox.Start: %v", err)
	}
	t.Cleanup(func() {
		if err := sb.Close(); err != nil {
			t.Errorf("sandbox Close: %v", err)
		}
	})
	return sb
}

// TestCRIUIgnoresSandboxFiles plants, inside a sandbox, every file CRIU
// 4.1.1 would read for itself from its mount namespace (configuration,
// plugins, its kernel-feature cache, programs found through $PATH) and
// checks that a dump and a restore there still work, run nothing of the
// sandbox's, and leave the planted files as they were.
func TestCRIUIgnoresSandboxFiles(t *testing.T) {
	r := needCRIU(t)
	good, err := r.Kdat(ctxT(t))
	if err != nil {
		t.Fatalf("criu kdat: %v", err)
	}
	// A forged cache: CRIU's magics (the first 8 bytes) with every
	// feature zeroed.
	forged := make([]byte, len(good))
	copy(forged, good[:8])
	const script = "#!/usr/bin/dash\necho pwned >>/tmp/pwned\n"
	cases := []struct {
		name  string
		plant map[string]string // path in the sandbox -> content ("->x": symlink to x, "|": FIFO)
		env   string            // prepended to the daemon's $PATH
	}{
		{"config action-script", map[string]string{
			"etc/criu/default.conf":   "action-script /tmp/evil\n",
			"root/.criu/default.conf": "action-script /tmp/evil\n",
			"tmp/evil":                script,
		}, ""},
		{"plugin", map[string]string{"usr/lib/criu/evil.so": "not a shared object\n"}, ""},
		{"forged kdat", map[string]string{"run/criu.kdat": string(forged)}, ""},
		{"kdat symlink to a fifo", map[string]string{"run/criu.kdat": "->/tmp/fifo", "tmp/fifo": "|"}, ""},
		{"programs on PATH", map[string]string{"tmp/bin/sh": script, "tmp/bin/iptables": script, "tmp/bin/ip6tables": script}, "/tmp/bin"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			if tc.env != "" {
				t.Setenv("PATH", tc.env+":"+os.Getenv("PATH"))
			}
			root, binds := hostileRoot(t)
			for p, content := range tc.plant {
				full := filepath.Join(root, p)
				must(os.MkdirAll(filepath.Dir(full), 0o755))
				switch {
				case strings.HasPrefix(content, "->"):
					must(os.Symlink(content[2:], full))
				case content == "|":
					must(unix.Mkfifo(full, 0o644))
				default:
					must(os.WriteFile(full, []byte(content), 0o755))
				}
			}
			sb := startHostile(t, root, binds)
			ctx, cancel := context.WithTimeout(ctxT(t), 60*time.Second)
			defer cancel()
			if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "s", Argv: []string{"sleep", "1000"}, Dir: "/"}); err != nil {
				t.Fatal(err)
			}
			dumpRestore(ctx, t, r, sb.InitPID())
			if b, err := os.ReadFile(filepath.Join(root, "tmp/pwned")); err == nil {
				t.Fatalf("criu ran a program of the sandbox: %q", b)
			}
			for p, content := range tc.plant {
				full := filepath.Join(root, p)
				switch {
				case strings.HasPrefix(content, "->"):
					if l, err := os.Readlink(full); err != nil || l != content[2:] {
						t.Errorf("%s: symlink now %q %v", p, l, err)
					}
				case content == "|":
					if st, err := os.Lstat(full); err != nil || st.Mode()&fs.ModeNamedPipe == 0 {
						t.Errorf("%s: fifo now %v %v", p, st, err)
					}
				default:
					if b, err := os.ReadFile(full); err != nil || !bytes.Equal(b, []byte(content)) {
						t.Errorf("%s changed: %d bytes, %v", p, len(b), err)
					}
				}
			}
			if _, err := os.Lstat(filepath.Join(root, "run/criu.kdat.tmp")); !errors.Is(err, fs.ErrNotExist) {
				t.Errorf("criu wrote its cache into the sandbox: %v", err)
			}
		})
	}
}

// dumpRestore dumps the only process of the sandbox of init with CRIU and
// restores it.
func dumpRestore(ctx context.Context, t *testing.T, r *criu.Runner, init int) {
	t.Helper()
	procs, err := descendants(init, nil)
	if err != nil || len(procs) != 1 {
		t.Fatalf("procs %+v %v", procs, err)
	}
	p := procs[0]
	must(unix.Kill(p.PID, unix.SIGSTOP))
	if !waitUntil(ctx, 10*time.Second, func() bool { st, _ := procState(p.PID); return st == 'T' }) {
		t.Fatal("target did not stop")
	}
	dir := filepath.Join(t.TempDir(), "img")
	if err := r.Dump(ctx, criu.DumpOptions{NSInit: init, Pid: p.NSPID, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctx, 10*time.Second, func() bool { _, err := os.Stat("/proc/" + itoa(p.PID)); return err != nil }) {
		t.Fatal("dumped process still there")
	}
	if _, err := r.Restore(ctx, criu.RestoreOptions{NSInit: init, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	for _, l := range []string{criu.DumpLog, criu.RestoreLog} {
		b, err := os.ReadFile(filepath.Join(dir, l))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Contains(b, []byte("Loaded kdat cache from /proc/self/fd/")) {
			t.Errorf("%s: criu did not load the runner's kernel-feature cache", l)
		}
	}
}

// A stdio path the daemon opens inside a sandbox never follows one of the
// sandbox's symlinks to a host file, and /proc/1/fd/N is the init's.
func TestOpenInSandboxStaysInside(t *testing.T) {
	sb := startReal(t)
	root := sb.Root()
	host := filepath.Join(t.TempDir(), "host-secret")
	must(os.WriteFile(host, []byte("host"), 0o600))
	must(os.Symlink(host, filepath.Join(root, "tmp/link")))
	if f, err := openInSandbox(sb.InitPID(), "/tmp/link", unix.O_RDONLY); err == nil {
		b := make([]byte, 16)
		n, _ := f.Read(b)
		f.Close()
		t.Fatalf("opened %q through a sandbox symlink", b[:n])
	}
	// The same name inside the sandbox is what a rooted symlink reaches.
	must(os.MkdirAll(filepath.Join(root, filepath.Dir(host)), 0o755))
	must(os.WriteFile(filepath.Join(root, host), []byte("sandbox"), 0o600))
	f, err := openInSandbox(sb.InitPID(), "/tmp/link", unix.O_RDONLY)
	if err != nil {
		t.Fatal(err)
	}
	b := make([]byte, 16)
	n, _ := f.Read(b)
	f.Close()
	if string(b[:n]) != "sandbox" {
		t.Fatalf("read %q, want the sandbox's file", b[:n])
	}
	ch, err := sb.NewChannels()
	if err != nil {
		t.Fatal(err)
	}
	defer ch.Close()
	_, nOut, err := ch.InitFDs(ctxT(t))
	if err != nil {
		t.Fatal(err)
	}
	w, err := openInSandbox(sb.InitPID(), fmt.Sprintf("/proc/1/fd/%d", nOut), unix.O_WRONLY)
	if err != nil {
		t.Fatal(err)
	}
	w.Close()
}

// The agent's processes (root in the sandbox, without CAP_SYS_PTRACE) can
// neither read nor write a template's memory; a template they kill is
// noticed and the checkpoint restores from its image, unchanged; the
// restored process is dumpable again, as its original was.
func TestTemplatesClosedToTheAgent(t *testing.T) {
	const probeParent = `sh -c 'exec 3</proc/$PPID/environ' 2>/dev/null && echo open || echo denied`
	needCRIU(t)
	sb := startReal(t)
	ctx := ctxT(t)
	e := newEngine(t, Config{Warm: true, ImagesDir: t.TempDir()})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/"})
	if err != nil {
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
	_ = ss
	send("export V=kept")
	before := send(probeParent)
	if before != "open" {
		t.Fatalf("original shell: environ %s", before)
	}
	if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: "c"}); err != nil {
		t.Fatal(err)
	}
	if err := e.WaitImage(ctx, "c"); err != nil {
		t.Fatal(err)
	}
	waitSpare(e, "c")
	helpers := e.TemplatePIDs(sb.ID())
	if len(helpers) < 2 {
		t.Fatalf("template and spare: %v", helpers)
	}
	var ns []string
	for _, pid := range helpers {
		p, err := readProc(pid)
		if err != nil || p.NSPID == 0 {
			t.Fatalf("template %d: %+v %v", pid, p, err)
		}
		ns = append(ns, itoa(p.NSPID))
		for _, probe := range []string{
			"exec 3<>/proc/%s/mem",
			"exec 3</proc/%s/mem",
			"exec 3</proc/%s/environ",
			"exec 3</proc/%s/fd/0",
		} {
			cmd := fmt.Sprintf(probe, itoa(p.NSPID))
			if got := send("( " + cmd + " ) 2>/dev/null && echo open || echo denied"); got != "denied" {
				t.Errorf("agent: %s: %s", cmd, got)
			}
		}
	}
	// Killed from inside: template and spare.
	send("kill -9 " + strings.Join(ns, " ") + "; echo")
	res, err := e.Restore(ctx, sb, "c", RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "criu" {
		t.Fatalf("restore path %q after the template was killed, want criu", res.Path)
	}
	if got := send("echo $V"); got != "kept" {
		t.Fatalf("restored V=%q", got)
	}
	// The restored shell is dumpable, as the original was: its child
	// reads its environment. (A copy has a new pid; bash's $$ is the
	// original's.)
	if got := send(probeParent); got != "open" {
		t.Fatalf("restored process: environ %s", got)
	}
	// Restored from the template this time (the image made new ones).
	res, err = e.Restore(ctx, sb, "c", RestoreOptions{Stdio: sessionStdio(ctx, sb, "main")})
	if err != nil || res.Path != "template" {
		t.Fatalf("second restore %+v %v", res, err)
	}
	if got := send("echo $V; " + probeParent); got != "kept\nopen" {
		t.Fatalf("template copy: %q", got)
	}
}

// A file the image names that the sandbox turned into a symlink after the
// dump (here to a look-alike file: CRIU would accept it) is not followed:
// the restore is refused before criu runs.
func TestCRIURestoreRefusesSymlinkedImagePath(t *testing.T) {
	r := needCRIU(t)
	sb := startReal(t)
	ctx := ctxT(t)
	root := sb.Root()
	must(os.WriteFile(filepath.Join(root, "tmp/a"), []byte("data\n"), 0o644))
	if _, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "s", Argv: []string{"sh", "-c", "exec sleep 1000 3</tmp/a"}, Dir: "/"}); err != nil {
		t.Fatal(err)
	}
	var p Proc
	if !waitUntil(ctx, 10*time.Second, func() bool {
		procs, err := descendants(sb.InitPID(), nil)
		if err != nil || len(procs) != 1 || procs[0].Comm != "sleep" {
			return false
		}
		p = procs[0]
		return true
	}) {
		t.Fatal("no sleep")
	}
	must(unix.Kill(p.PID, unix.SIGSTOP))
	if !waitUntil(ctx, 10*time.Second, func() bool { st, _ := procState(p.PID); return st == 'T' }) {
		t.Fatal("target did not stop")
	}
	dir := filepath.Join(t.TempDir(), "img")
	if err := r.Dump(ctx, criu.DumpOptions{NSInit: sb.InitPID(), Pid: p.NSPID, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(ctx, 10*time.Second, func() bool { _, err := os.Stat("/proc/" + itoa(p.PID)); return err != nil }) {
		t.Fatal("dumped process still there")
	}
	must(os.WriteFile(filepath.Join(root, "tmp/b"), []byte("data\n"), 0o644))
	must(os.Remove(filepath.Join(root, "tmp/a")))
	must(os.Symlink("/tmp/b", filepath.Join(root, "tmp/a")))
	if _, err := r.Restore(ctx, criu.RestoreOptions{NSInit: sb.InitPID(), Dir: dir}); !errors.Is(err, criu.ErrImagePath) {
		t.Fatalf("restore through a symlink: %v, want %v", err, criu.ErrImagePath)
	}
	// Put back, it restores.
	must(os.Remove(filepath.Join(root, "tmp/a")))
	must(os.Rename(filepath.Join(root, "tmp/b"), filepath.Join(root, "tmp/a")))
	if _, err := r.Restore(ctx, criu.RestoreOptions{NSInit: sb.InitPID(), Dir: dir}); err != nil {
		t.Fatal(err)
	}
}
