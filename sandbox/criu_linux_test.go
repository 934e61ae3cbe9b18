package sandbox

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"

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
	ss, err := sb.StartSession(ctx, SessionConfig{ID: "bash", Argv: []string{"bash"}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := ss.Send(ctx, "cd /tmp && export V=checkpointed", SendOptions{}); err != nil {
		t.Fatal(err)
	}
	pid, nspid := ss.PID(), ss.NSPID()
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

	dump := sb.CommandContext(ctx, criu, "dump", "-t", fmt.Sprint(nspid), "-D", "/proc/self/fd/3", "-o", "dump.log")
	dump.ExtraFiles = []*os.File{dirFile}
	if out, err := dump.CombinedOutput(); err != nil {
		t.Fatalf("criu dump: %v %s\n%s", err, out, criuErrors(images, "dump.log"))
	}
	waitFor(t, "dumped shell to exit", func() bool { return !alive(pid) })

	ch, err := sb.NewChannels()
	if err != nil {
		t.Fatal(err)
	}
	in, out := ch.ChildFiles()
	restore := sb.CommandContext(ctx, criu, "restore", "-D", "/proc/self/fd/5", "-o", "restore.log",
		"--restore-detached", "--manage-cgroups=ignore",
		"--inherit-fd", "fd[3]:"+inLink, "--inherit-fd", "fd[4]:"+outLink)
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
	got, err := adopted.Send(ctx, "echo $V $(pwd) $$", SendOptions{})
	if want := fmt.Sprintf("checkpointed /tmp %d\n", nspid); err != nil || got != want {
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
