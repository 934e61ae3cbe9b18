package probe

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

const unifiedRoot = "/sys/fs/cgroup/unified"

// newCgroup creates a fresh cgroup v2 directory; cleanup kills its
// processes and removes it.
func newCgroup(t testing.TB) string {
	t.Helper()
	testenv.RequireRoot(t)
	var st syscall.Statfs_t
	err := syscall.Statfs(unifiedRoot, &st)
	testenv.Require(t, err == nil && st.Type == 0x63677270, "cgroup2 mounted at "+unifiedRoot)
	b := make([]byte, 6)
	rand.Read(b)
	dir := filepath.Join(unifiedRoot, "rewind-probetest-"+hex.EncodeToString(b))
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatalf("create cgroup: %v", err)
	}
	t.Cleanup(func() { removeCgroup(t, dir) })
	return dir
}

// killCgroup kills every process of a cgroup.
func killCgroup(dir string) {
	if err := os.WriteFile(filepath.Join(dir, "cgroup.kill"), []byte("1"), 0); err != nil {
		// Older kernels: kill one by one.
		pids, _ := cgroupPIDs(nil, dir)
		for _, pid := range pids {
			syscall.Kill(pid, syscall.SIGKILL)
		}
	}
}

func removeCgroup(t testing.TB, dir string) {
	deadline := time.Now().Add(20 * time.Second)
	for {
		killCgroup(dir)
		err := os.Remove(dir)
		if err == nil || os.IsNotExist(err) {
			return
		}
		if time.Now().After(deadline) {
			t.Errorf("remove cgroup %s: %v", dir, err)
			return
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// cgroupAttr starts a command directly inside the cgroup.
func cgroupAttr(t testing.TB, cg string) *syscall.SysProcAttr {
	t.Helper()
	fd, err := syscall.Open(cg, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatalf("open cgroup: %v", err)
	}
	t.Cleanup(func() { syscall.Close(fd) })
	return &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
}

// runIn runs a one-shot command inside cgroup cg with working dir dir.
func runIn(t testing.TB, cg, dir string, args ...string) string {
	t.Helper()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = dir
	cmd.SysProcAttr = cgroupAttr(t, cg)
	out, err := cmd.CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %v\n%s", args, err, out)
	}
	return string(out)
}

// pshell is a persistent interpreter (bash or python3) fed on stdin.
type pshell struct {
	t     testing.TB
	cmd   *exec.Cmd
	in    io.WriteCloser
	lines chan string
	n     int
	py    bool
}

func startShell(t testing.TB, cg, dir string, py bool) *pshell {
	t.Helper()
	args := []string{"bash", "--norc", "--noprofile"}
	if py {
		args = []string{"python3", "-i", "-u", "-q"}
	}
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Dir = dir
	cmd.SysProcAttr = cgroupAttr(t, cg)
	cmd.Stderr = io.Discard
	in, err := cmd.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatalf("start %v: %v", args, err)
	}
	s := &pshell{t: t, cmd: cmd, in: in, lines: make(chan string, 1024), py: py}
	go func() {
		sc := bufio.NewScanner(out)
		for sc.Scan() {
			s.lines <- sc.Text()
		}
		close(s.lines)
	}()
	cmd.WaitDelay = 2 * time.Second // background jobs may hold the pipes
	t.Cleanup(func() {
		in.Close()
		killCgroup(cg)
		cmd.Process.Kill()
		cmd.Wait()
	})
	s.run("") // wait until it is up
	return s
}

// run sends one line and waits until it has been executed; it returns the
// output lines before the marker.
func (s *pshell) run(line string) []string {
	s.t.Helper()
	s.n++
	marker := fmt.Sprintf("__M%d__", s.n)
	echo := "echo " + marker
	if s.py {
		echo = "print(" + strconv.Quote(marker) + ")"
	}
	if _, err := fmt.Fprintf(s.in, "%s\n%s\n", line, echo); err != nil {
		s.t.Fatalf("write to shell: %v", err)
	}
	return s.waitLine(func(l string) bool { return l == marker })
}

// waitLine returns the lines read before the first line matching ok.
func (s *pshell) waitLine(ok func(string) bool) []string {
	s.t.Helper()
	var got []string
	timeout := time.After(60 * time.Second)
	for {
		select {
		case l, open := <-s.lines:
			if !open {
				s.t.Fatalf("shell exited; output so far: %q", got)
			}
			if ok(l) {
				return got
			}
			got = append(got, l)
		case <-timeout:
			s.t.Fatalf("shell timed out; output so far: %q", got)
		}
	}
}

func (s *pshell) pid() int { return s.cmd.Process.Pid }

func hasPrefixLine(prefix string) func(string) bool {
	return func(l string) bool { return strings.HasPrefix(l, prefix) }
}
