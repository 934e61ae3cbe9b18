package sandbox

import (
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	crcriu "github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func findCRIU() string {
	if p := os.Getenv("REWIND_CRIU"); p != "" {
		return p
	}
	if _, err := os.Stat("/opt/rewind/criu/sbin/criu"); err == nil {
		return "/opt/rewind/criu/sbin/criu"
	}
	p, _ := exec.LookPath("criu")
	return p
}

func criuErrors(dir, log string) string {
	b, _ := os.ReadFile(dir + "/" + log)
	var out []string
	for _, l := range strings.Split(string(b), "\n") {
		if strings.Contains(l, "Error") {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}

// TestCRIURoundTrip checks that the sandbox process model is what CRIU
// needs: a session dumped from inside the sandbox's namespaces and restored
// onto fresh channels comes back with its state, in the sandbox, as a child
// of the init, and can be adopted as the session.
func TestCRIURoundTrip(t *testing.T) {
	criu := findCRIU()
	testenv.Require(t, criu != "", "criu (REWIND_CRIU, /opt/rewind/criu/sbin/criu or PATH)")
	criuDir := criu[:strings.LastIndex(criu, "/")]
	sb := startTest(t, func(c *Config) {
		c.Binds = append(c.Binds, Bind{Source: criuDir, Target: criuDir, ReadOnly: true})
	})
	ctx := testCtx(t)
	for name, src := range map[string]string{
		"server.py": "import socket\ns = socket.socket()\ns.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)\ns.bind(('127.0.0.1', 8765))\ns.listen()\nwhile True:\n    c, _ = s.accept()\n    c.sendall(b'pong\\n')\n    c.close()\n",
		"client.py": "import socket\ntry:\n    print(socket.create_connection(('127.0.0.1', 8765)).recv(10).decode(), end='')\nexcept OSError:\n    print('refused')\n",
	} {
		if err := os.WriteFile(filepath.Join(sb.Root(), "tmp", name), []byte(src), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "bash", Argv: []string{"bash"}})
	if err != nil {
		t.Fatal(err)
	}
	// A shell with state, a background job and a loopback server.
	if _, err := ss.Send(ctx, "cd /tmp; export V=checkpointed; sleep 1000 & python3 /tmp/server.py &", SendOptions{Idle: 50 * time.Millisecond}); err != nil {
		t.Fatal(err)
	}
	waitFor(t, "loopback server", func() bool {
		out, err := ss.Send(ctx, "python3 /tmp/client.py", SendOptions{Until: regexp.MustCompile(`(pong|refused)`)})
		return err == nil && strings.Contains(out, "pong")
	})
	pid, nspid := ss.PID(), ss.NSPID()
	dumped := procOf(pid)
	inLink, err1 := os.Readlink(fmt.Sprintf("/proc/%d/fd/0", pid))
	outLink, err2 := os.Readlink(fmt.Sprintf("/proc/%d/fd/1", pid))
	if err1 != nil || err2 != nil {
		t.Fatal(err1, err2)
	}
	images := t.TempDir()
	dirFile, err := os.Open(images)
	if err != nil {
		t.Fatal(err)
	}
	defer dirFile.Close()

	// The sandbox's network namespace is private: nothing to lock.
	dump := sb.CommandContext(ctx, criu, "dump", "-t", fmt.Sprint(nspid), "-D", "/proc/self/fd/3", "-o", "dump.log",
		"--tcp-established", "--network-lock", "skip")
	dump.Env = append(os.Environ(), crcriu.Env()...)
	dump.ExtraFiles = []*os.File{dirFile}
	if out, err := dump.CombinedOutput(); err != nil {
		t.Fatalf("criu dump: %v %s\n%s", err, out, criuErrors(images, "dump.log"))
	}
	waitFor(t, "dumped shell to exit", func() bool { return !alive(dumped) })

	ch, err := sb.NewChannels()
	if err != nil {
		t.Fatal(err)
	}
	in, out := ch.ChildFiles()
	restore := sb.CommandContext(ctx, criu, "restore", "-D", "/proc/self/fd/5", "-o", "restore.log",
		"--restore-detached", "--manage-cgroups=ignore", "--tcp-established",
		"--inherit-fd", "fd[3]:"+inLink, "--inherit-fd", "fd[4]:"+outLink)
	restore.Env = append(os.Environ(), crcriu.Env()...)
	restore.ExtraFiles = []*os.File{in, out, dirFile}
	if out, err := restore.CombinedOutput(); err != nil {
		t.Fatalf("criu restore: %v %s\n%s", err, out, criuErrors(images, "restore.log"))
	}
	host := sb.hostPID(nspid)
	p, err := readProcess(host)
	if host == 0 || err != nil || p.PPID != sb.InitPID() {
		t.Fatalf("restored process %d: %+v %v (init %d)", host, p, err, sb.InitPID())
	}
	adopted, err := sb.AdoptSession("bash", host, ch)
	if err != nil {
		t.Fatal(err)
	}
	got, err := adopted.Send(ctx, "echo $V $(pwd) $$; jobs | wc -l; python3 /tmp/client.py", SendOptions{Until: regexp.MustCompile(`(pong|refused)\n`)})
	if want := fmt.Sprintf("checkpointed /tmp %d\n2\npong\n", nspid); err != nil || got != want {
		t.Fatalf("restored shell says %q (%v), want %q", got, err, want)
	}
	if _, err := adopted.Send(ctx, "exit 4", SendOptions{}); err != nil {
		t.Fatal(err)
	}
	<-adopted.Done()
	if adopted.ExitCode() != 4 {
		t.Fatalf("restored shell exit code %d", adopted.ExitCode())
	}
}
