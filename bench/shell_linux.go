package bench

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
)

// shell is a persistent bash on the host, in its own process group, used
// by the baselines (rewind runs its shell inside the sandbox instead).
type shell struct {
	cmd   *exec.Cmd
	stdin io.WriteCloser
	out   *bufio.Reader
	seq   int
	mu    sync.Mutex
	// stop, if set, replaces kill's own way of ending the shell (for a
	// shell that is not this process's child, e.g. one CRIU restored).
	stop func()
}

func startShell(dir, repo string) (*shell, error) {
	cmd := exec.Command("bash", "--noprofile", "--norc")
	cmd.Dir = dir
	cmd.Env = append(os.Environ(), "R="+repo, "PS1=", "HOME="+dir)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	cmd.Stdout, cmd.Stderr = pw, pw
	if err := cmd.Start(); err != nil {
		pr.Close()
		pw.Close()
		return nil, fmt.Errorf("start bash: %w", err)
	}
	pw.Close()
	return &shell{cmd: cmd, stdin: in, out: bufio.NewReaderSize(pr, 64<<10)}, nil
}

var markerRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`__RWB_(\d+)_(\d+)__`) })

// run runs one command line and returns its output and exit status.
func (s *shell) run(ctx context.Context, cmdline string) (string, int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.seq++
	marker := fmt.Sprintf("__RWB_%d_", s.seq)
	if _, err := fmt.Fprintf(s.stdin, "%s\necho %s$?__\n", cmdline, marker); err != nil {
		return "", -1, fmt.Errorf("write to shell: %w", err)
	}
	var b strings.Builder
	deadline := time.Now().Add(5 * time.Minute)
	for {
		if err := ctx.Err(); err != nil {
			return b.String(), -1, err
		}
		if time.Now().After(deadline) {
			return b.String(), -1, fmt.Errorf("command timed out: %s", cmdline)
		}
		l, err := s.out.ReadString('\n')
		if i := strings.Index(l, marker); i >= 0 {
			b.WriteString(l[:i])
			m := markerRE().FindStringSubmatch(l[i:])
			code := -1
			if m != nil {
				fmt.Sscan(m[2], &code)
			}
			return b.String(), code, nil
		}
		b.WriteString(l)
		if err != nil {
			return b.String(), -1, fmt.Errorf("shell output: %w", err)
		}
	}
}

// kill stops the shell and everything it started (same process group).
func (s *shell) kill() {
	if s != nil && s.stop != nil {
		s.stop()
		s.stdin.Close()
		return
	}
	if s == nil || s.cmd.Process == nil {
		return
	}
	pgid := s.cmd.Process.Pid
	_ = syscall.Kill(-pgid, syscall.SIGKILL)
	s.stdin.Close()
	_ = s.cmd.Wait()
	// Background jobs are in the same group but not our children: wait
	// until the group is gone so their cwd and fds no longer pin the tree.
	// Zombies do not count: the VM's init reaps them when it gets to it.
	for i := 0; i < 400 && groupAlive(pgid); i++ {
		time.Sleep(5 * time.Millisecond)
	}
}

// groupAlive reports whether a non-zombie process of process group pgid
// exists.
func groupAlive(pgid int) bool {
	if syscall.Kill(-pgid, 0) != nil {
		return false
	}
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return true
	}
	for _, e := range ents {
		if e.Name()[0] < '0' || e.Name()[0] > '9' {
			continue
		}
		b, err := os.ReadFile("/proc/" + e.Name() + "/stat")
		if err != nil {
			continue
		}
		// pid (comm) state ppid pgrp ...: comm may hold spaces; cut after ')'.
		i := strings.LastIndexByte(string(b), ')')
		if i < 0 {
			continue
		}
		f := strings.Fields(string(b[i+1:]))
		if len(f) >= 3 && f[2] == strconv.Itoa(pgid) && f[0] != "Z" && f[0] != "X" {
			return true
		}
	}
	return false
}
