package cr

import (
	"context"
	"errors"
	"fmt"
	"os"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/sandbox"
	"golang.org/x/sys/unix"
)

// shellIdle reports whether the bash pid is blocked reading its stdin and
// has consumed everything written to it (so what was sent has run).
func shellIdle(pid int) bool {
	sc, err := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", pid))
	// read(0, ...), or readline's pselect6 on fd 0 (interactive).
	if err != nil || !(strings.HasPrefix(string(sc), "0 0x0 ") || strings.HasPrefix(string(sc), "270 0x1 ")) {
		return false
	}
	f, err := os.OpenFile(fmt.Sprintf("/proc/%d/fd/0", pid), os.O_RDONLY|unix.O_NONBLOCK, 0)
	if err != nil {
		return false
	}
	defer f.Close()
	n, err := unix.IoctlGetInt(int(f.Fd()), unix.TIOCINQ)
	return err == nil && n == 0
}

type shellRig struct {
	t   testing.TB
	ctx context.Context
	sb  *sandbox.Sandbox
	e   *Engine
	ss  *sandbox.Session
}

func newShellRig(t *testing.T, cfg Config) *shellRig {
	sb := startReal(t)
	ctx := ctxT(t)
	e := newEngine(t, cfg)
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/"})
	if err != nil {
		t.Fatal(err)
	}
	return &shellRig{t: t, ctx: ctx, sb: sb, e: e, ss: ss}
}

// run sends cmd followed by a marker and returns cmd's output; the shell
// is idle again when it returns.
func (r *shellRig) run(cmd string) string {
	r.t.Helper()
	out, err := r.ss.Send(r.ctx, cmd+"\necho __E__", sandbox.SendOptions{Until: regexp.MustCompile(`(^|\n)__E__\n$`)})
	if err != nil {
		r.t.Fatalf("send %q: %v (output %q)", cmd, err, out)
	}
	r.settle()
	return strings.TrimSuffix(out, "__E__\n")
}

func (r *shellRig) settle() {
	r.t.Helper()
	if !waitUntil(r.ctx, 30*time.Second, func() bool { return shellIdle(r.ss.PID()) }) {
		r.t.Fatal("shell did not become idle")
	}
}

func (r *shellRig) digest() *ShellState {
	r.t.Helper()
	// A digest right after another finds the shell restarting the read
	// the last one interrupted (ErrShellBusy): wait for it to sleep there.
	r.settle()
	st, err := r.e.ShellDigest(r.ctx, r.sb, r.ss.PID())
	if err != nil {
		r.t.Fatalf("ShellDigest: %v", err)
	}
	return st
}

// diffLines names the lines of b missing from a and the reverse.
func diffLines(a, b string) string {
	in := func(s string) map[string]bool {
		m := map[string]bool{}
		for _, l := range strings.Split(s, "\n") {
			m[l] = true
		}
		return m
	}
	ma, mb := in(a), in(b)
	var out []string
	for _, l := range strings.Split(a, "\n") {
		if !mb[l] {
			out = append(out, "- "+l)
		}
	}
	for _, l := range strings.Split(b, "\n") {
		if !ma[l] {
			out = append(out, "+ "+l)
		}
	}
	return strings.Join(out, "\n")
}

func TestShellDigest(t *testing.T) {
	r := newShellRig(t, Config{})
	r.run("echo content > /tmp/file")
	base := r.digest()
	if !strings.Contains(base.Text, "declare -x PATH=") || !strings.Contains(base.Text, "set +o noclobber") {
		t.Fatalf("dump lacks the shell state:\n%s", base.Text)
	}
	for _, c := range []struct{ cmd, out string }{
		{"true", ""}, {"echo hi", "hi\n"}, {"ls /", ""}, {"cat /tmp/file", "content\n"}, {"pwd", "/\n"},
	} {
		out := r.run(c.cmd)
		if c.out != "" && out != c.out {
			t.Fatalf("%q printed %q, want %q", c.cmd, out, c.out)
		}
		if strings.Contains(out, "rewind-") || strings.Contains(out, "declare") {
			t.Fatalf("a digest's dump reached the live shell's output: %q", out)
		}
		if d := r.digest(); d.Digest != base.Digest {
			t.Fatalf("digest changed after read-only %q:\n%s", c.cmd, diffLines(base.Text, d.Text))
		}
	}
	// $? is reported, not digested, and the live shell keeps its own.
	if _, err := r.ss.Send(r.ctx, "false", sandbox.SendOptions{Idle: 10 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	r.settle()
	if d := r.digest(); d.Status != 1 || d.Digest != base.Digest {
		t.Fatalf("after false: status %d (want 1), digest equal %v", d.Status, d.Digest == base.Digest)
	}
	if out, err := r.ss.Send(r.ctx, `echo "live $?"`, sandbox.SendOptions{Until: regexp.MustCompile(`live \d+\n`)}); err != nil || out != "live 1\n" {
		t.Fatalf("live shell after a digest: %q %v, want %q", out, err, "live 1\n")
	}
	r.settle()
	seen := map[string]string{base.Digest: "base"}
	for _, c := range []struct{ cmd, want string }{
		{"X=1", "X="},
		{"export V=2", "V="},
		{"f(){ :; }", "f ()"},
		{"alias ll=ls", "alias ll="},
		{"set -o noclobber", "set -o noclobber"},
		{"shopt -s extglob", "shopt -s extglob"},
		{"cd /tmp", "cwd "},
		{"umask 077", "Umask:"},
		{"trap 'echo' USR1", "trap -- 'echo' SIGUSR1"},
		{"sleep 100 &", "sleep 100"},
		{"exec 3>/tmp/x", "fd 3 "},
	} {
		r.run(c.cmd)
		d := r.digest()
		if prev, ok := seen[d.Digest]; ok {
			t.Fatalf("digest after %q equals the one after %q", c.cmd, prev)
		}
		if !strings.Contains(d.Text, c.want) {
			t.Fatalf("dump after %q lacks %q:\n%s", c.cmd, c.want, d.Text)
		}
		seen[d.Digest] = c.cmd
		// Asking twice gives the same answer.
		if d2 := r.digest(); d2.Digest != d.Digest {
			t.Fatalf("two digests after %q differ:\n%s", c.cmd, diffLines(d.Text, d2.Text))
		}
	}
	if out := r.run(`echo "$X $V $(type -t f) $PWD $(umask)"; jobs | wc -l`); out != "1 2 function /tmp 0077\n1\n" {
		t.Fatalf("live shell state after the digests: %q", out)
	}
	// No copy is left behind: only the shell and its job run.
	// (Copies are reaped in the background.)
	if !waitUntil(r.ctx, 30*time.Second, func() bool {
		ps, err := r.e.Processes(r.sb)
		kids, _ := children(r.sb.InitPID())
		return err == nil && len(ps) == 2 && len(r.e.TemplatePIDs(r.sb.ID())) == 0 && len(kids) == 1
	}) {
		ps, _ := r.e.Processes(r.sb)
		kids, _ := children(r.sb.InitPID())
		t.Fatalf("processes after the digests: %+v, helpers %v, children of init %v", ps, r.e.TemplatePIDs(r.sb.ID()), kids)
	}
}

func TestShellDigestRefusals(t *testing.T) {
	r := newShellRig(t, Config{})
	r.run("true")
	py, err := r.sb.StartSession(r.ctx, sandbox.SessionConfig{ID: "py", Argv: []string{"python3", "-u", "-c", "import sys; sys.stdin.read()"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := r.e.ShellDigest(r.ctx, r.sb, py.PID()); !errors.Is(err, ErrNotBash) {
		t.Fatalf("digest of python: %v, want ErrNotBash", err)
	}
	// A shell running a command is busy; it finishes it untouched.
	if _, err := r.ss.Send(r.ctx, "sleep 1; echo slept", sandbox.SendOptions{Idle: time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	if !waitUntil(r.ctx, 10*time.Second, func() bool {
		sc, _ := os.ReadFile(fmt.Sprintf("/proc/%d/syscall", r.ss.PID()))
		return strings.HasPrefix(string(sc), strconv.Itoa(unix.SYS_WAIT4)+" ")
	}) {
		t.Fatal("shell never waited for its sleep")
	}
	if _, err := r.e.ShellDigest(r.ctx, r.sb, r.ss.PID()); !errors.Is(err, ErrShellBusy) {
		t.Fatalf("digest of a busy shell: %v, want ErrShellBusy", err)
	}
	if out, err := r.ss.Read(r.ctx, sandbox.SendOptions{Until: regexp.MustCompile("slept\n")}); err != nil || out != "slept\n" {
		t.Fatalf("busy shell after the refusal: %q %v", out, err)
	}
}

// An interactive bash on a terminal (readline waits in pselect6) digests
// the same way, and the digest's commands stay out of its history.
func TestShellDigestInteractive(t *testing.T) {
	sb := startReal(t)
	ctx := ctxT(t)
	e := newEngine(t, Config{})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "tty", TTY: true, Argv: []string{"bash", "--norc", "--noprofile", "-i"}, Dir: "/"})
	if err != nil {
		t.Fatal(err)
	}
	r := &shellRig{t: t, ctx: ctx, sb: sb, e: e, ss: ss}
	send := func(cmd string) string {
		t.Helper()
		out, err := ss.Send(ctx, cmd+"; echo __E__", sandbox.SendOptions{Until: regexp.MustCompile(`[\r\n]__E__\r?\n`)})
		if err != nil {
			t.Fatalf("send %q: %v (%q)", cmd, err, out)
		}
		r.settle()
		return out
	}
	send("X=1")
	base := r.digest()
	if !strings.Contains(base.Text, "set -o monitor") || !strings.Contains(base.Text, `declare -- X="1"`) {
		t.Fatalf("interactive dump:\n%s", base.Text)
	}
	send("ls / >/dev/null")
	if d := r.digest(); d.Digest != base.Digest {
		t.Fatalf("digest changed after ls:\n%s", diffLines(base.Text, d.Text))
	}
	send("Y=2")
	if d := r.digest(); d.Digest == base.Digest {
		t.Fatal("digest unchanged after Y=2")
	}
	if out := send("history | grep -c 'builtin[ ]declare'"); !regexp.MustCompile(`[\r\n]0\r\n__E__`).MatchString(out) {
		t.Fatalf("digest commands in the live shell's history: %q", out)
	}
}

// Agent code that runs in the copy (here a DEBUG trap, run before every
// command of the dump) cannot change the sandbox: the copy's seccomp filter
// fails its file writes.
func TestShellDigestConfinesTheCopy(t *testing.T) {
	r := newShellRig(t, Config{})
	r.run("trap 'echo dbg >> /tmp/dbg' DEBUG")
	path := fmt.Sprintf("/proc/%d/root/tmp/dbg", r.ss.PID())
	before, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	d := r.digest()
	after, err := os.ReadFile(path)
	if err != nil {
		t.Fatal(err)
	}
	if string(after) != string(before) {
		t.Fatalf("the digest copy ran the DEBUG trap's write: %d lines before, %d after", strings.Count(string(before), "\n"), strings.Count(string(after), "\n"))
	}
	if !strings.Contains(d.Text, "trap -- 'echo dbg >> /tmp/dbg' DEBUG") || !strings.Contains(d.Text, "Operation not permitted") {
		t.Fatalf("dump under a DEBUG trap:\n%s", d.Text)
	}
	if d2 := r.digest(); d2.Digest != d.Digest {
		t.Fatalf("two digests differ:\n%s", diffLines(d.Text, d2.Text))
	}
}

// A checkpoint's template digests like the live shell it copies, and a
// change in the live shell makes them differ.
func TestTemplateShellDigest(t *testing.T) {
	r := newShellRig(t, Config{})
	r.run("cd /tmp && export V=1")
	ck, err := r.e.Checkpoint(r.ctx, r.sb, CheckpointOptions{ID: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	live := r.digest()
	tmpl, err := r.e.TemplateShellDigest(r.ctx, "c1", ck.Procs[0].PID)
	if err != nil {
		t.Fatal(err)
	}
	if tmpl.Digest != live.Digest {
		t.Fatalf("template and live shell differ:\n%s", diffLines(tmpl.Text, live.Text))
	}
	r.run("export V=2")
	if d := r.digest(); d.Digest == tmpl.Digest {
		t.Fatal("digest unchanged after export V=2")
	}
	// The template is still a good restore source.
	if _, err := r.e.Restore(r.ctx, r.sb, "c1", RestoreOptions{Stdio: sessionStdio(r.ctx, r.sb, "main")}); err != nil {
		t.Fatal(err)
	}
	if out, err := r.sb.Session("main").Send(r.ctx, `echo "$PWD $V"`, sandbox.SendOptions{Until: regexp.MustCompile(`\n`)}); err != nil || out != "/tmp 1\n" {
		t.Fatalf("restored shell: %q %v", out, err)
	}
}

// A template's digest holds the checkpoint's file offsets, which its
// copies get, not the ones the live shell moved on to through the file
// description the template shares with it: else a restore would keep a
// live shell that has read on, as if it were in the checkpoint's state.
func TestTemplateShellDigestOffsets(t *testing.T) {
	r := newShellRig(t, Config{})
	r.run("printf 0123456789 > /tmp/r; exec 3</tmp/r; read -r -n 2 x <&3")
	ck, err := r.e.Checkpoint(r.ctx, r.sb, CheckpointOptions{ID: "c1"})
	if err != nil {
		t.Fatal(err)
	}
	before := r.digest()
	// dd moves the offset of the description fd 3 shares with the
	// template, and nothing else of the shell's.
	r.run("dd bs=1 count=3 <&3 >/dev/null 2>&1")
	live := r.digest()
	if live.Digest == before.Digest {
		t.Fatal("live digest unchanged after the shell's descriptor moved on")
	}
	tmpl, err := r.e.TemplateShellDigest(r.ctx, "c1", ck.Procs[0].PID)
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(tmpl.Text, "fd 3 /tmp/r pos 2 ") {
		t.Fatalf("template digest lacks the checkpoint's offset of fd 3:\n%s", tmpl.Text)
	}
	if tmpl.Digest != before.Digest {
		t.Fatalf("template digest differs from the live shell's at the checkpoint:\n%s", diffLines(before.Text, tmpl.Text))
	}
}

// BenchmarkShellDigest: go test -run '^$' -bench ShellDigest -benchtime 30x ./cr/
// The cost of one digest of an idle bash next to a template checkpoint of
// the same sandbox (freeze, template fork, thaw) and one with its CRIU
// image written, measured in the same run: each iteration does all three,
// so machine noise hits them alike. Reports p50 of each and the ratios.
func BenchmarkShellDigest(b *testing.B) {
	sb := startReal(b)
	ctx := context.Background()
	needCRIU(b)
	e := newEngine(b, Config{ImagesDir: b.TempDir()})
	sb.OnClose(func() { e.DropSandbox(sb.ID()) })
	ss, err := sb.StartSession(ctx, sandbox.SessionConfig{ID: "main", Argv: []string{"bash", "--norc", "--noprofile"}, Dir: "/"})
	if err != nil {
		b.Fatal(err)
	}
	if _, err := ss.Send(ctx, "cd /tmp; export V=1; f(){ :; }; echo __E__", sandbox.SendOptions{Until: regexp.MustCompile("__E__\n")}); err != nil {
		b.Fatal(err)
	}
	waitUntil(ctx, 30*time.Second, func() bool { return shellIdle(ss.PID()) })
	seq := 0
	var held []time.Duration   // how long each digest stopped the shell
	var frozen []time.Duration // how long each template checkpoint froze it
	ops := []struct {
		name string
		op   func() error
	}{
		{"digest", func() error {
			st, err := e.ShellDigest(ctx, sb, ss.PID())
			if err == nil {
				held = append(held, st.Stopped)
			}
			return err
		}},
		{"template", func() error {
			seq++
			id := fmt.Sprint("b", seq)
			ck, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: id, Ephemeral: true})
			if err != nil {
				return err
			}
			frozen = append(frozen, ck.Frozen)
			e.Drop(id)
			return nil
		}},
		{"template+image", func() error {
			seq++
			id := fmt.Sprint("b", seq)
			if _, err := e.Checkpoint(ctx, sb, CheckpointOptions{ID: id}); err != nil {
				return err
			}
			err := e.WaitImage(ctx, id)
			e.Drop(id)
			return err
		}},
	}
	ds := make([][]time.Duration, len(ops))
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		for j, o := range ops {
			t0 := time.Now()
			if err := o.op(); err != nil {
				b.Fatalf("%s: %v", o.name, err)
			}
			ds[j] = append(ds[j], time.Since(t0))
		}
	}
	b.StopTimer()
	p50 := make([]float64, len(ops))
	for j, o := range ops {
		sort.Slice(ds[j], func(a, c int) bool { return ds[j][a] < ds[j][c] })
		p50[j] = float64(ds[j][len(ds[j])/2]) / 1e6
		b.ReportMetric(p50[j], o.name+"-p50-ms")
	}
	mid := func(d []time.Duration) float64 {
		sort.Slice(d, func(a, c int) bool { return d[a] < d[c] })
		return float64(d[len(d)/2]) / 1e6
	}
	heldP50, frozenP50 := mid(held), mid(frozen)
	b.ReportMetric(heldP50, "digest-shell-stopped-p50-ms")
	b.ReportMetric(frozenP50, "template-frozen-p50-ms")
	b.ReportMetric(0, "ns/op")
	fmt.Printf("BenchmarkShellDigest p50 (n=%d): digest %.2f ms (shell stopped %.2f ms), template checkpoint %.2f ms (%.1fx the digest; frozen %.2f ms), checkpoint with its CRIU image %.2f ms (%.1fx)\n",
		b.N, p50[0], heldP50, p50[1], p50[1]/p50[0], frozenP50, p50[2], p50[2]/p50[0])
}
