package bench

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"github.com/rewind-sandbox/rewind/internal/mountinfo"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/cr/criu"
)

// criuBaseline is what `docker checkpoint` / `podman container checkpoint`
// do, every turn: a full CRIU dump of the shell's process tree
// (--leave-running) plus a copy of the repository (`cp -a`); a restore
// kills the tree, copies the repository back and runs `criu restore`. The
// shell is the init of its own PID namespace (as in a container), so its
// pids are free again as soon as it is killed, and it keeps its cwd,
// variables and background jobs across restores — the one baseline that
// recovers process state, at CRIU's cost.
//
// As in a container, the shell and every criu call run in a mount
// namespace of the baseline's own (see mountNS): CRIU parses the mountinfo
// of the namespace it dumps, and fails on any line of 4 KiB or more, which
// the overlays of a sandbox with many layers elsewhere on the host have.
type criuBaseline struct {
	dirBase
	parent string
	bin    string
	mnt    *mountNS
	pid    int // host pid of the shell (its namespace's init)
	// Our ends of the shell's stdio, and the pipe inodes the shell holds
	// (CRIU names the pipes it must reconnect by them).
	stdinIno, stdoutIno uint64
}

// NewCRIUBaseline returns the CRIU-every-turn baseline ("criu-cp-a").
func NewCRIUBaseline(parent string) Manager {
	return &criuBaseline{dirBase: dirBase{name: "criu-cp-a"}, parent: parent}
}

func (c *criuBaseline) Start(ctx context.Context, setup []string) error {
	bin, err := criu.Find("")
	if err != nil {
		return err
	}
	c.bin = bin
	if err := c.init(c.parent); err != nil {
		return err
	}
	if c.mnt, err = newMountNS(); err != nil {
		return err
	}
	c.repo = filepath.Join(c.root, "repo")
	if err := os.Mkdir(c.repo, 0o755); err != nil {
		return err
	}
	if err := c.startNSShell(); err != nil {
		return err
	}
	return c.runSetup(ctx, setup)
}

// startNSShell starts bash as PID 1 of a new PID namespace, in its own
// session and the baseline's mount namespace, with pipes for stdio.
func (c *criuBaseline) startNSShell() error {
	// Descriptors we inherited without close-on-exec would reach the
	// shell, and CRIU cannot dump a file of another mount namespace: the
	// shell closes all but its stdio first (as a container runtime does).
	cmd := c.mnt.commandIn(c.repo, "bash", "--noprofile", "--norc", "-c", closeFDs+"exec bash --noprofile --norc")
	cmd.Env = append(os.Environ(), "R="+c.repo, "PS1=", "HOME="+c.repo)
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true, Cloneflags: syscall.CLONE_NEWPID}
	inR, inW, err := os.Pipe()
	if err != nil {
		return err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return err
	}
	cmd.Stdin, cmd.Stdout, cmd.Stderr = inR, outW, outW
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return fmt.Errorf("start bash: %w", err)
	}
	c.pid = cmd.Process.Pid
	c.adopt(inW, outR, func() { _ = cmd.Wait() })
	return nil
}

// adopt makes the shell talk through our pipe ends in and out; reap waits
// for the shell once it is killed.
func (c *criuBaseline) adopt(in, out *os.File, reap func()) {
	c.stdinIno, c.stdoutIno = inode(in), inode(out)
	pid := c.pid
	c.sh = &shell{stdin: in, out: bufio.NewReaderSize(out, 64<<10), stop: func() {
		// Killing a PID namespace's init kills the whole namespace.
		_ = syscall.Kill(pid, syscall.SIGKILL)
		reap()
		out.Close()
	}}
}

func inode(f *os.File) uint64 {
	var st unix.Stat_t
	if unix.Fstat(int(f.Fd()), &st) != nil {
		return 0
	}
	return st.Ino
}

func (c *criuBaseline) snap(id string) string { return filepath.Join(c.root, "snaps", id) }

func (c *criuBaseline) criu(args ...string) error {
	cmd := c.mnt.command(append([]string{c.bin}, args...)...)
	cmd.Env = append(os.Environ(), criu.Env()...)
	out, err := cmd.CombinedOutput()
	if err != nil {
		msg := string(out)
		// With -o, CRIU writes its errors to the log in the images dir.
		if dir, log := argAfter(args, "-D"), argAfter(args, "-o"); dir != "" && log != "" {
			if b, rerr := os.ReadFile(filepath.Join(dir, log)); rerr == nil {
				msg += errorLines(string(b))
			}
		}
		return fmt.Errorf("criu %s: %v: %s", args[0], err, lastLines(msg, 3))
	}
	return nil
}

// argAfter returns the argument that follows flag in args ("" if none).
func argAfter(args []string, flag string) string {
	for i, a := range args[:max(len(args)-1, 0)] {
		if a == flag {
			return args[i+1]
		}
	}
	return ""
}

// errorLines keeps the lines of a CRIU log that report an error.
func errorLines(log string) string {
	var b strings.Builder
	for _, l := range strings.Split(log, "\n") {
		if strings.Contains(l, "Error") || strings.Contains(l, "rror (") {
			b.WriteString(l + "\n")
		}
	}
	return b.String()
}

func lastLines(s string, n int) string {
	l := strings.Split(strings.TrimSpace(s), "\n")
	if len(l) > n {
		l = l[len(l)-n:]
	}
	return strings.Join(l, " | ")
}

// Checkpoint dumps the tree (the shell is stopped for the dump) and copies
// the repository while it is stopped, so both parts agree.
func (c *criuBaseline) Checkpoint(ctx context.Context) (string, Cost, error) {
	c.n++
	id := strconv.Itoa(c.n)
	dir := c.snap(id)
	start := time.Now()
	if err := os.MkdirAll(filepath.Join(dir, "img"), 0o755); err != nil {
		return "", Cost{}, err
	}
	// Stop the tree, copy the files, dump with --leave-running (CRIU
	// resumes the tree when it is done).
	if err := syscall.Kill(-c.pid, syscall.SIGSTOP); err != nil {
		return "", Cost{}, fmt.Errorf("stop shell: %w", err)
	}
	err := run("cp", "-a", c.repo, filepath.Join(dir, "repo"))
	for attempt := 0; err == nil; attempt++ {
		// One retry, as a user would: a process of the tree that exits
		// while CRIU seizes it fails the whole dump. The time counts.
		err = c.criu("dump", "-t", strconv.Itoa(c.pid), "-D", filepath.Join(dir, "img"), "-o", "dump.log",
			"--leave-running", "--tcp-established", "--ext-unix-sk", "--file-locks", "--network-lock", "skip")
		if err == nil || attempt == 1 {
			break
		}
		err = nil
	}
	_ = syscall.Kill(-c.pid, syscall.SIGCONT)
	d := time.Since(start)
	if err == nil {
		err = os.WriteFile(filepath.Join(dir, "pipes"), fmt.Appendf(nil, "%d %d\n", c.stdinIno, c.stdoutIno), 0o644)
	}
	return id, Cost{Visible: d, Frozen: d, Decision: "full"}, err
}

func (c *criuBaseline) Restore(ctx context.Context, id string) (Cost, error) {
	dir := c.snap(id)
	var inIno, outIno uint64
	b, err := os.ReadFile(filepath.Join(dir, "pipes"))
	if err != nil {
		return Cost{}, fmt.Errorf("restore %s: %w", id, err)
	}
	if _, err := fmt.Sscan(string(b), &inIno, &outIno); err != nil {
		return Cost{}, fmt.Errorf("restore %s: pipes: %w", id, err)
	}
	start := time.Now()
	c.sh.kill()
	if err := os.RemoveAll(c.repo); err != nil {
		return Cost{}, err
	}
	if err := run("cp", "-a", filepath.Join(dir, "repo"), c.repo); err != nil {
		return Cost{}, err
	}
	inR, inW, err := os.Pipe()
	if err != nil {
		return Cost{}, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		return Cost{}, err
	}
	pidfile := filepath.Join(c.root, "restore.pid")
	os.Remove(pidfile)
	cmd := c.mnt.command(c.bin, "restore", "-D", filepath.Join(dir, "img"), "-o", "restore-"+strconv.Itoa(c.n)+".log",
		"--restore-detached", "--pidfile", pidfile, "--tcp-established", "--ext-unix-sk", "--file-locks",
		"--inherit-fd", fmt.Sprintf("fd[3]:pipe:[%d]", inIno), "--inherit-fd", fmt.Sprintf("fd[4]:pipe:[%d]", outIno))
	cmd.ExtraFiles = []*os.File{inR, outW}
	cmd.Env = append(os.Environ(), criu.Env()...)
	out, err := cmd.CombinedOutput()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		outR.Close()
		return Cost{}, fmt.Errorf("criu restore: %v: %s", err, lastLines(string(out), 3))
	}
	pb, err := os.ReadFile(pidfile)
	if err != nil {
		return Cost{}, fmt.Errorf("criu restore: pidfile: %w", err)
	}
	pid, err := strconv.Atoi(strings.TrimSpace(string(pb)))
	if err != nil {
		return Cost{}, fmt.Errorf("criu restore: pidfile %q", pb)
	}
	// The tree was dumped while we had it stopped (SIGSTOP, for the copy),
	// so CRIU restores it stopped: resume it.
	if err := syscall.Kill(-pid, syscall.SIGCONT); err != nil {
		return Cost{}, fmt.Errorf("resume restored shell: %w", err)
	}
	// The restored shell is a child of the host's init, not ours: wait
	// for it to be gone (or a zombie) after a kill.
	c.pid = pid
	c.adopt(inW, outR, func() { waitGone(pid) })
	return Cost{Visible: time.Since(start), Decision: "full"}, nil
}

// waitGone waits (up to 2 s) until pid is gone or a zombie.
func waitGone(pid int) {
	for range 400 {
		b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
		if err != nil {
			return
		}
		if i := strings.LastIndexByte(string(b), ')'); i > 0 && i+2 < len(b) && (b[i+2] == 'Z' || b[i+2] == 'X') {
			return
		}
		time.Sleep(5 * time.Millisecond)
	}
}

func (c *criuBaseline) Close() error {
	err := c.closeBase()
	c.mnt.close()
	return err
}

// closeFDs is bash that closes every descriptor but 0, 1 and 2.
const closeFDs = `for f in /proc/self/fd/*; do n=${f##*/}; [ "$n" -gt 2 ] && eval "exec $n>&-" 2>/dev/null; done; `

// criuLineMax is the size of CRIU 4.1.1's line buffer for mountinfo
// (BUF_SIZE of criu/proc_parse.c): a longer line, newline included, fails
// every dump of a process that sees the mount.
const criuLineMax = 4096

// mountNS is a private mount namespace, held by a process that exits when
// we close its stdin (or die). It is a copy of the host's mounts when it
// was made, minus those CRIU cannot parse; later host mounts do not
// propagate into it.
type mountNS struct {
	holder *exec.Cmd
	stdin  *os.File
	ns     string // /proc/<holder>/ns/mnt
}

func newMountNS() (*mountNS, error) {
	inR, inW, err := os.Pipe()
	if err != nil {
		return nil, err
	}
	outR, outW, err := os.Pipe()
	if err != nil {
		inR.Close()
		inW.Close()
		return nil, err
	}
	defer outR.Close()
	cmd := exec.Command("unshare", "--mount", "--propagation", "private", "--", "sh", "-c", "echo; exec cat >/dev/null")
	cmd.Stdin, cmd.Stdout = inR, outW
	err = cmd.Start()
	inR.Close()
	outW.Close()
	if err != nil {
		inW.Close()
		return nil, fmt.Errorf("mount namespace: %w", err)
	}
	m := &mountNS{holder: cmd, stdin: inW, ns: fmt.Sprintf("/proc/%d/ns/mnt", cmd.Process.Pid)}
	if _, err := bufio.NewReader(outR).ReadString('\n'); err != nil {
		m.close()
		return nil, fmt.Errorf("mount namespace: holder: %w", err)
	}
	if err := m.dropLongMounts(); err != nil {
		m.close()
		return nil, err
	}
	return m, nil
}

// dropLongMounts detaches every mount of the namespace whose mountinfo line
// CRIU cannot read (with its submounts).
func (m *mountNS) dropLongMounts() error {
	for range 5 {
		b, err := os.ReadFile(filepath.Join(filepath.Dir(filepath.Dir(m.ns)), "mountinfo"))
		if err != nil {
			return fmt.Errorf("mount namespace: %w", err)
		}
		var long []string
		for _, l := range strings.Split(string(b), "\n") {
			if f := strings.Fields(l); len(l)+1 >= criuLineMax && len(f) > 4 {
				long = append(long, mountinfo.Unescape(f[4]))
			}
		}
		if len(long) == 0 {
			return nil
		}
		for _, p := range long {
			// A mount below one detached before is gone already.
			_ = m.command("umount", "-l", p).Run()
		}
	}
	return errors.New("mount namespace: cannot detach the mounts whose mountinfo lines CRIU cannot read")
}

// command returns a command that runs argv in the namespace (nsenter
// execs argv: no process is added).
func (m *mountNS) command(argv ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"--mount=" + m.ns, "--"}, argv...)...)
}

// commandIn is command, run in directory dir (entering a mount namespace
// resets the working directory to its root).
func (m *mountNS) commandIn(dir string, argv ...string) *exec.Cmd {
	return exec.Command("nsenter", append([]string{"--mount=" + m.ns, "--wdns=" + dir, "--"}, argv...)...)
}

func (m *mountNS) close() {
	if m == nil {
		return
	}
	m.stdin.Close()
	_ = m.holder.Wait()
}
