package sandbox

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"runtime"
	"sort"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/rewind-sandbox/rewind/internal/pause"
	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// Default cgroup parents (seam #1, plus the v1 pids and memory limits).
const (
	DefaultFreezerParent  = "/sys/fs/cgroup/freezer/rewind"
	DefaultCgroupV2Parent = "/sys/fs/cgroup/unified/rewind"
	DefaultPidsParent     = "/sys/fs/cgroup/pids/rewind"
	DefaultMemoryParent   = "/sys/fs/cgroup/memory/rewind"
)

// DefaultPidsMax bounds the tasks (processes and threads) of a sandbox when
// Config.PidsMax is 0: a fork bomb inside stays inside.
const DefaultPidsMax = 8192

// DefaultEnv is the base environment of sandbox processes when Config.Env is nil.
var DefaultEnv = []string{
	"PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
	"HOME=/root", "LANG=C.UTF-8", "TERM=dumb",
}

// Bind is a bind mount of a host path into the sandbox, made inside the
// sandbox's mount namespace (it never appears on the host).
type Bind struct {
	// Source is the host path.
	Source string `json:"source"`
	// Target is the path inside the sandbox.
	Target string `json:"target"`
	// ReadOnly makes the bind read-only.
	ReadOnly bool `json:"read_only,omitempty"`
}

// Config describes a sandbox to start.
type Config struct {
	// ID names the sandbox (letters, digits, '-', '_', '.'); it names the cgroups.
	ID string
	// Root is the host directory that becomes / inside (the sandbox's DeltaFS
	// mount in production). proc, dev and run/rewind are created in it if missing.
	Root string
	// HostNet shares the host's network namespace. By default the sandbox
	// gets its own network namespace with only loopback, up.
	HostNet bool
	// Env is the base environment of every process (DefaultEnv when nil).
	Env []string
	// Hostname inside the sandbox (default: ID).
	Hostname string
	// Tmpfs lists directories inside the sandbox that get a fresh tmpfs.
	// /tmp is not one by default: it stays in the root file system, so
	// that checkpoints of the file system include it.
	Tmpfs []string
	// Hide lists paths inside the sandbox masked by an empty read-only tmpfs
	// (directories) or /dev/null (files): the daemon's state dir when the
	// base is the host root. /run/rewind is always a private tmpfs.
	Hide []string
	// Binds are host paths bind-mounted into the sandbox.
	Binds []Bind
	// KeepCaps keeps every capability for sandbox processes (debugging
	// only). By default they run with a reduced bounding set (no
	// CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_MKNOD, CAP_DAC_READ_SEARCH, ...).
	KeepCaps bool
	// InitPath is the binary re-executed as the init (default /proc/self/exe;
	// it must call MaybeRunInit).
	InitPath string
	// PidsMax bounds the sandbox's tasks (v1 pids controller; the init's
	// own threads get a small allowance on top): 0 means DefaultPidsMax,
	// negative means no limit.
	PidsMax int
	// MemoryMax bounds the sandbox's memory in bytes (v1 memory
	// controller; templates of package cr count too); 0 means no limit.
	MemoryMax int64
	// FreezerParent and CgroupV2Parent override the cgroup parents.
	FreezerParent, CgroupV2Parent string
	// PIDCounterMin, when above the init's pid floor, is where the init
	// moves its PID namespace's pid counter during its setup, while it
	// still holds the capability to: the first sandbox process then gets
	// a pid above it. A sandbox made to restore a process image whose
	// pids are all at most this (a fork child) needs no process of its
	// own started for that later (see TakePIDCounterMin).
	PIDCounterMin int
	// Logger receives the init's log lines (default slog.Default()).
	Logger *slog.Logger
}

// idRE is compiled on first use, not at package init: every process of
// this binary, each sandbox init among them, runs the package inits (a
// regexp compiled there cost a fork child about 1 ms of CPU on a
// paravirtualized VM). The other package-level regexps of rewind are
// lazy for the same reason.
var idRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z0-9_][A-Za-z0-9_.-]{0,99}$`) })

// Sandbox is a running sandbox. Its methods are safe for concurrent use.
type Sandbox struct {
	cfg        Config
	log        *slog.Logger
	cmd        *exec.Cmd
	initPID    int
	cli        *client
	freezerDir string
	v2Dir      string
	limitDirs  []string // v1 pids and memory cgroups, when used
	spareV2    string   // a spare's v2 cgroup, removed once the init left it
	cgroupID   uint64
	initDone   chan struct{} // closed when the init process has been waited for

	mu       sync.Mutex
	sessions map[string]*Session
	onClose  []func()
	closed   bool

	freezeMu  sync.Mutex
	frozen    bool
	stateFile *os.File
	// keepDir is an empty freezer cgroup held frozen while the sandbox
	// lives (keepFreezerActive); "" if it could not be made.
	keepDir string
	// counterMin is Config.PIDCounterMin as the init applied it, until
	// TakePIDCounterMin takes it.
	counterMin int
}

// ErrClosed is returned by calls on a closed sandbox.
var ErrClosed = errors.New("sandbox closed")

// ErrBadCommand is matched (errors.Is) by the error of an exec or session
// start whose command cannot start as given: its program or its working
// directory is not there (or is not one). The sandbox is fine.
var ErrBadCommand = errors.New("the command cannot start as given")

// badCommandError is an init's answer that matches ErrBadCommand; its text
// is the init's.
type badCommandError string

func (e badCommandError) Error() string        { return string(e) }
func (e badCommandError) Is(target error) bool { return target == ErrBadCommand }

// Start starts a sandbox: cgroups, namespaces, root switch and the init.
func Start(ctx context.Context, cfg Config) (*Sandbox, error) {
	return start(ctx, cfg, nil)
}

// start starts a sandbox with a spare init, or a new one when spare is nil.
// It owns spare from the call on.
func start(ctx context.Context, cfg Config, spare *initProc) (_ *Sandbox, err error) {
	defer func() {
		if err != nil && spare != nil && spare.cmd != nil {
			spare.kill() // (a no-op when teardown already killed it)
			spare.removeCgroups()
		}
	}()
	if spare != nil && spare.id != "" && cfg.ID == "" {
		cfg.ID = spare.id
	}
	if !idRE().MatchString(cfg.ID) || strings.Contains(cfg.ID, "..") {
		return nil, fmt.Errorf("start sandbox: invalid id %q", cfg.ID)
	}
	root, err := filepath.Abs(cfg.Root)
	if err != nil {
		return nil, fmt.Errorf("start sandbox %s: root: %w", cfg.ID, err)
	}
	if st, err := os.Stat(root); err != nil || !st.IsDir() {
		return nil, fmt.Errorf("start sandbox %s: root %s is not a directory", cfg.ID, root)
	}
	cfg.Root = root
	if cfg.Env == nil {
		cfg.Env = DefaultEnv
	}
	if cfg.Hostname == "" {
		cfg.Hostname = cfg.ID
		if len(cfg.Hostname) > 64 {
			cfg.Hostname = cfg.Hostname[:64]
		}
	}
	if cfg.InitPath == "" {
		cfg.InitPath = "/proc/self/exe"
	}
	if cfg.FreezerParent == "" {
		cfg.FreezerParent = DefaultFreezerParent
	}
	if cfg.CgroupV2Parent == "" {
		cfg.CgroupV2Parent = DefaultCgroupV2Parent
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	s := &Sandbox{
		cfg:        cfg,
		log:        cfg.Logger.With("sandbox", cfg.ID),
		freezerDir: filepath.Join(cfg.FreezerParent, cfg.ID),
		v2Dir:      filepath.Join(cfg.CgroupV2Parent, cfg.ID),
		sessions:   map[string]*Session{},
	}
	joined := map[string]bool{} // cgroups the init is in already
	if spare != nil && spare.id != "" {
		if err := s.takeSpareCgroups(spare, joined); err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, err)
		}
	} else {
		if err := makeCgroup(s.freezerDir); err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, err)
		}
		if err := makeCgroup(s.v2Dir); err != nil {
			_ = unix.Rmdir(s.freezerDir)
			return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, err)
		}
	}
	defer func() {
		if err != nil {
			s.teardown()
		}
	}()
	if err := s.makeLimits(joined); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, err)
	}
	s.keepFreezerActive()
	var st unix.Stat_t
	if err := unix.Stat(s.v2Dir, &st); err != nil {
		return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, err)
	}
	s.cgroupID = st.Ino

	ip := spare
	if ip == nil {
		if ip, err = spawnInit(cfg.InitPath, cfg.HostNet, cfg.KeepCaps, false, -1, s.log); err != nil {
			return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, err)
		}
	} else {
		ip.logw.setLogger(s.log)
	}
	s.cmd = ip.cmd
	s.initPID = ip.cmd.Process.Pid
	s.initDone = ip.done
	c := ip.conn
	s.cli = newClient(c, s.log)
	// The init waits for its setup message, so nothing runs outside the
	// cgroups: join them first.
	for _, dir := range s.cgroupDirs() {
		if joined[dir] {
			continue
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(s.initPID)), 0); err != nil {
			return nil, fmt.Errorf("start sandbox %s: join cgroup %s: %w", cfg.ID, dir, err)
		}
	}
	if s.spareV2 != "" {
		_ = unix.Rmdir(s.spareV2)
		s.spareV2 = ""
	}
	setup := &setupConfig{
		Root: cfg.Root, Hostname: cfg.Hostname, Net: !cfg.HostNet,
		Tmpfs: cfg.Tmpfs, Hide: cfg.Hide, Binds: cfg.Binds, KeepCaps: cfg.KeepCaps,
		PIDCounterMin: cfg.PIDCounterMin,
	}
	var fds []int
	if spare != nil {
		// A spare waits in a mount tree of its own, with none of the
		// host's mounts (enterSpareRoot): hand it the root (often a FUSE
		// view mounted for this sandbox) and the binds' sources as
		// clones made here.
		defer func() { closeFDs(fds) }()
		for i, src := range append([]string{cfg.Root}, bindSources(cfg.Binds)...) {
			fd, err := unix.OpenTree(unix.AT_FDCWD, src, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
			if err != nil {
				what := "root"
				if i > 0 {
					what = "bind source"
				}
				return nil, fmt.Errorf("start sandbox %s: clone %s %s: %w", cfg.ID, what, src, err)
			}
			fds = append(fds, fd)
		}
		setup.RootFD, setup.BindFDs = true, true
	}
	if err := s.cli.conn.send(&msg{Op: opSetup, Setup: setup}, fds...); err != nil {
		return nil, fmt.Errorf("start sandbox %s: send setup: %w", cfg.ID, err)
	}
	select {
	case r := <-s.cli.ready:
		if r.Err != "" {
			return nil, fmt.Errorf("start sandbox %s: init: %s", cfg.ID, r.Err)
		}
		s.counterMin = cfg.PIDCounterMin
	case <-s.cli.dead:
		return nil, fmt.Errorf("start sandbox %s: init exited during setup (see log)", cfg.ID)
	case <-s.initDone:
		return nil, fmt.Errorf("start sandbox %s: init exited during setup (see log)", cfg.ID)
	case <-ctx.Done():
		return nil, fmt.Errorf("start sandbox %s: %w", cfg.ID, ctx.Err())
	}
	return s, nil
}

func bindSources(binds []Bind) []string {
	srcs := make([]string, len(binds))
	for i, b := range binds {
		srcs[i] = b.Source
	}
	return srcs
}

// makeLimits creates the v1 pids and memory cgroups and sets their limits.
// The cgroups already there (joined, from a spare) only get their limit
// written.
func (s *Sandbox) makeLimits(joined map[string]bool) error {
	type limit struct{ parent, file, value string }
	var limits []limit
	pidsDir := filepath.Join(DefaultPidsParent, s.cfg.ID)
	switch {
	case joined[pidsDir] && s.cfg.PidsMax < 0:
		limits = append(limits, limit{DefaultPidsParent, "pids.max", "max"})
	case s.cfg.PidsMax == 0:
		if _, err := os.Stat(filepath.Dir(DefaultPidsParent)); err == nil {
			limits = append(limits, limit{DefaultPidsParent, "pids.max", strconv.Itoa(DefaultPidsMax + initThreadAllowance)})
		}
	case s.cfg.PidsMax > 0:
		limits = append(limits, limit{DefaultPidsParent, "pids.max", strconv.Itoa(s.cfg.PidsMax + initThreadAllowance)})
	}
	if s.cfg.MemoryMax > 0 {
		limits = append(limits, limit{DefaultMemoryParent, "memory.limit_in_bytes", strconv.FormatInt(s.cfg.MemoryMax, 10)})
	}
	for _, l := range limits {
		dir := filepath.Join(l.parent, s.cfg.ID)
		if !joined[dir] {
			if err := makeCgroup(dir); err != nil {
				return err
			}
		}
		s.limitDirs = append(s.limitDirs, dir)
		if err := os.WriteFile(filepath.Join(dir, l.file), []byte(l.value), 0); err != nil {
			return fmt.Errorf("set %s: %w", filepath.Join(dir, l.file), err)
		}
		if l.file == "memory.limit_in_bytes" {
			// Memory plus swap: the limit must not be dodged by swapping.
			memsw := filepath.Join(dir, "memory.memsw.limit_in_bytes")
			if _, err := os.Stat(memsw); err == nil {
				if err := os.WriteFile(memsw, []byte(l.value), 0); err != nil {
					return fmt.Errorf("set %s: %w", memsw, err)
				}
			}
		}
	}
	return nil
}

// cgroupDirs lists every cgroup of the sandbox.
func (s *Sandbox) cgroupDirs() []string {
	return append([]string{s.freezerDir, s.v2Dir}, s.limitDirs...)
}

func makeCgroup(dir string) error {
	if err := os.MkdirAll(filepath.Dir(dir), 0o755); err != nil {
		return fmt.Errorf("cgroup parent: %w", err)
	}
	err := unix.Mkdir(dir, 0o755)
	if errors.Is(err, unix.EEXIST) {
		// Left over from a crash: reuse it only if it is empty.
		if rerr := unix.Rmdir(dir); rerr != nil {
			return fmt.Errorf("cgroup %s exists and is in use: %w", dir, rerr)
		}
		err = unix.Mkdir(dir, 0o755)
	}
	if err != nil {
		return fmt.Errorf("create cgroup %s: %w", dir, err)
	}
	return nil
}

// initProc is a started init still waiting for its setup message.
type initProc struct {
	cmd     *exec.Cmd
	conn    *conn // the daemon's end of the control channel
	logw    *lineLogger
	done    chan struct{} // closed when cmd has been waited for
	hostNet bool
	// id and dirs: a spare's own sandbox id and the cgroups (named by id)
	// it already is in.
	id   string
	dirs []string
}

// spawnInit starts an init process in new namespaces.
// With cgroupFD >= 0 (a cgroup v2 directory) it starts in that cgroup.
func spawnInit(initPath string, hostNet, keepCaps, spare bool, cgroupFD int, log *slog.Logger) (*initProc, error) {
	pair, err := unix.Socketpair(unix.AF_UNIX, unix.SOCK_SEQPACKET|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("socketpair: %w", err)
	}
	parentEnd := os.NewFile(uintptr(pair[0]), "ctl")
	childEnd := os.NewFile(uintptr(pair[1]), "ctl-init")
	c, err := newConn(parentEnd)
	parentEnd.Close()
	if err != nil {
		childEnd.Close()
		return nil, err
	}
	flags := uintptr(unix.CLONE_NEWPID | unix.CLONE_NEWNS | unix.CLONE_NEWUTS | unix.CLONE_NEWIPC)
	if !hostNet {
		flags |= unix.CLONE_NEWNET
	}
	cmd := exec.Command(initPath)
	cmd.Args = []string{"rewind-init"}
	stage := stageFirst
	switch {
	case keepCaps:
		stage = stageKeepCaps
	case spare:
		stage = stageSpare
	}
	cmd.Env = []string{initEnv + "=" + stage, "GOMAXPROCS=1"}
	cmd.Dir = "/"
	cmd.ExtraFiles = []*os.File{childEnd}
	logw := &lineLogger{log: log}
	cmd.Stdout = logw
	cmd.Stderr = logw
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: flags}
	if cgroupFD >= 0 {
		cmd.SysProcAttr.UseCgroupFD = true
		cmd.SysProcAttr.CgroupFD = cgroupFD
	}
	err = startReduced(cmd, keepCaps)
	childEnd.Close()
	if err != nil {
		c.close()
		return nil, fmt.Errorf("start init: %w", err)
	}
	ip := &initProc{cmd: cmd, conn: c, logw: logw, done: make(chan struct{}), hostNet: hostNet}
	go func() {
		_ = cmd.Wait()
		close(ip.done)
	}()
	return ip, nil
}

// startReduced starts cmd from a fresh OS thread whose capability bounding
// set is reduced first, so that the init starts with it (dropping it there
// would stop every thread of the init's runtime for each capability: about
// 1 ms each on a paravirtualized VM). Unless keepCaps, the bounding set is
// keptCaps only, and setupCaps, which the init needs for its setup and then
// drops, come through the inheritable set: a root process's permitted set
// after exec is its bounding set plus its inheritable set. With keepCaps the
// bounding set keeps setupCaps. The thread exits with the goroutine (it
// stays locked), so the daemon's own threads keep their sets.
func startReduced(cmd *exec.Cmd, keepCaps bool) error {
	errc := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		keep := keptMask()
		setup := uint64(0)
		for _, c := range setupCaps {
			setup |= 1 << c
		}
		// Best effort (needs CAP_SETPCAP): the init drops whatever is
		// left itself.
		if keepCaps || raiseInheritable(setup) != nil {
			keep |= setup
		}
		_ = dropBoundingExcept(keep)
		errc <- cmd.Start()
	}()
	return <-errc
}

// raiseInheritable adds caps to the calling thread's inheritable set (they
// must be in its permitted set, and still in its bounding set).
func raiseInheritable(caps uint64) error {
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	var data [2]unix.CapUserData
	if err := unix.Capget(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capget: %w", err)
	}
	data[0].Inheritable |= uint32(caps)
	data[1].Inheritable |= uint32(caps >> 32)
	if err := unix.Capset(&hdr, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	return nil
}

// kill ends an init that never became a sandbox.
func (ip *initProc) kill() {
	_ = ip.cmd.Process.Kill()
	ip.conn.close()
	select {
	case <-ip.done:
	case <-time.After(10 * time.Second):
	}
}

// lineLogger logs each line written by the init.
type lineLogger struct {
	log *slog.Logger
	mu  sync.Mutex
	buf []byte
}

func (l *lineLogger) setLogger(log *slog.Logger) {
	l.mu.Lock()
	l.log = log
	l.mu.Unlock()
}

func (l *lineLogger) Write(p []byte) (int, error) {
	l.mu.Lock()
	defer l.mu.Unlock()
	l.buf = append(l.buf, p...)
	for {
		i := strings.IndexByte(string(l.buf), '\n')
		if i < 0 {
			break
		}
		l.log.Warn("sandbox init", "line", string(l.buf[:i]))
		l.buf = l.buf[i+1:]
	}
	if len(l.buf) > 4096 {
		l.log.Warn("sandbox init", "line", string(l.buf))
		l.buf = nil
	}
	return len(p), nil
}

// ID returns the sandbox id.
func (s *Sandbox) ID() string { return s.cfg.ID }

// InitPID returns the host pid of the sandbox's PID 1 (the rewind init).
func (s *Sandbox) InitPID() int { return s.initPID }

// TakePIDCounterMin returns Config.PIDCounterMin once (then 0): the
// sandbox's pid counter was moved to at least that at its setup, and only
// a run round the whole pid range moves it below. cr's first restore into
// the sandbox (a fork child's, right after its start) takes it to skip
// moving the counter itself, which costs a process started in the
// sandbox's PID namespace.
func (s *Sandbox) TakePIDCounterMin() int {
	s.mu.Lock()
	defer s.mu.Unlock()
	v := s.counterMin
	s.counterMin = 0
	return v
}

// Root returns the host directory that is / inside the sandbox.
func (s *Sandbox) Root() string { return s.cfg.Root }

// CgroupV2Dir returns the sandbox's cgroup v2 directory.
func (s *Sandbox) CgroupV2Dir() string { return s.v2Dir }

// FreezerDir returns the sandbox's cgroup v1 freezer directory.
func (s *Sandbox) FreezerDir() string { return s.freezerDir }

// CgroupID returns the cgroup v2 id (inode of CgroupV2Dir), as reported by
// bpf_get_current_cgroup_id for sandbox processes.
func (s *Sandbox) CgroupID() uint64 { return s.cgroupID }

// NSPath returns /proc/<init>/ns/<kind> for kind pid, mnt, net, uts, ipc...
func (s *Sandbox) NSPath(kind string) string {
	return fmt.Sprintf("/proc/%d/ns/%s", s.initPID, kind)
}

// NSEnterArgs returns the argv prefix that runs a host command inside the
// sandbox's pid, mount, network, UTS and IPC namespaces (util-linux
// nsenter). The command is resolved in the sandbox's root.
func (s *Sandbox) NSEnterArgs() []string {
	return []string{"nsenter", "-t", strconv.Itoa(s.initPID), "-p", "-m", "-n", "-u", "-i", "--"}
}

// CommandContext returns a command that runs argv (argv[0] resolved in the
// sandbox's root) inside the sandbox's namespaces AND cgroups, so that the
// processes it creates (a criu restore) belong to the sandbox. It joins the
// cgroups with a tiny host shell before nsenter forks.
func (s *Sandbox) CommandContext(ctx context.Context, argv ...string) *exec.Cmd {
	script := ""
	for _, dir := range s.cgroupDirs() {
		script += fmt.Sprintf("echo $$ > %s/cgroup.procs && ", dir)
	}
	script += `exec "$@"`
	args := append([]string{"-c", script, "rewind-nsenter"}, s.NSEnterArgs()...)
	return exec.CommandContext(ctx, "/bin/sh", append(args, argv...)...)
}

// JoinCgroups moves host process pid into the sandbox's cgroups; children
// it forks afterwards belong to the sandbox.
func (s *Sandbox) JoinCgroups(pid int) error {
	for _, dir := range s.cgroupDirs() {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(pid)), 0); err != nil {
			return fmt.Errorf("join cgroup %s: %w", dir, err)
		}
	}
	return nil
}

// Done is closed when the sandbox's init has exited (Close, or a crash).
func (s *Sandbox) Done() <-chan struct{} { return s.initDone }

// OnClose registers fn to run at the start of Close, before any process is
// killed (the cr pool releases its ptrace-stopped templates there).
func (s *Sandbox) OnClose(fn func()) {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.onClose = append(s.onClose, fn)
}

// Ping makes a round trip through the init's control channel.
func (s *Sandbox) Ping(ctx context.Context) error {
	_, _, err := s.cli.call(ctx, &msg{Op: opPing})
	return err
}

// Freeze stops every process of the sandbox atomically (cgroup v1 freezer)
// and returns once the cgroup reports FROZEN. On failure (ctx done) it thaws
// again and returns the error.
func (s *Sandbox) Freeze(ctx context.Context) error {
	s.freezeMu.Lock()
	defer s.freezeMu.Unlock()
	f, err := s.freezerState()
	if err != nil {
		return fmt.Errorf("freeze %s: %w", s.cfg.ID, err)
	}
	start := time.Now()
	sleep := 20 * time.Microsecond
	for {
		if _, err := f.WriteAt([]byte("FROZEN"), 0); err != nil {
			return fmt.Errorf("freeze %s: %w", s.cfg.ID, err)
		}
		state, err := readState(f)
		if err != nil {
			return fmt.Errorf("freeze %s: %w", s.cfg.ID, err)
		}
		if state == "FROZEN" {
			s.frozen = true
			return nil
		}
		select {
		case <-ctx.Done():
			_, _ = f.WriteAt([]byte("THAWED"), 0)
			return fmt.Errorf("freeze %s: %w", s.cfg.ID, ctx.Err())
		default:
		}
		if time.Since(start) < 200*time.Microsecond {
			runtime.Gosched() // freezing usually completes within microseconds
			continue
		}
		if sleep < time.Millisecond {
			pause.For(sleep) // time.Sleep would take a millisecond
			sleep *= 2
		} else {
			time.Sleep(sleep)
		}
	}
}

// Thaw resumes the processes stopped by Freeze.
func (s *Sandbox) Thaw(ctx context.Context) error {
	s.freezeMu.Lock()
	defer s.freezeMu.Unlock()
	f, err := s.freezerState()
	if err != nil {
		return fmt.Errorf("thaw %s: %w", s.cfg.ID, err)
	}
	sleep := 20 * time.Microsecond
	for {
		if _, err := f.WriteAt([]byte("THAWED"), 0); err != nil {
			return fmt.Errorf("thaw %s: %w", s.cfg.ID, err)
		}
		state, err := readState(f)
		if err != nil {
			return fmt.Errorf("thaw %s: %w", s.cfg.ID, err)
		}
		if state == "THAWED" {
			s.frozen = false
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("thaw %s: %w", s.cfg.ID, err)
		}
		if sleep < time.Millisecond {
			pause.For(sleep) // a timer would take a millisecond
			sleep *= 2
		} else {
			time.Sleep(sleep)
		}
	}
}

// Frozen reports whether the sandbox was left frozen by Freeze.
func (s *Sandbox) Frozen() bool {
	s.freezeMu.Lock()
	defer s.freezeMu.Unlock()
	return s.frozen
}

// keepFreezerActive makes the sandbox's sibling cgroup .keep-ID in the
// freezer hierarchy, empty, and freezes it for the sandbox's life. The
// kernel's v1 freezer turns a static key (freezer_active) on when the
// first cgroup of the host starts freezing and off when the last thaws;
// each turn patches kernel text on every CPU. Measured on this host (2
// vCPUs, a VM): freezing a cgroup holding one sleeping task and thawing it
// took 1.33 ms each, 0.012 ms each while another, empty cgroup stayed
// frozen; a sandbox checkpoint's freeze and thaw took 2-7 ms each. With
// the key held on, freezing the sandbox is only the tasks' own stop. An
// empty frozen cgroup stops nothing. Best effort: without it freezes are
// slower, not wrong.
func (s *Sandbox) keepFreezerActive() {
	dir := filepath.Join(filepath.Dir(s.freezerDir), ".keep-"+s.cfg.ID)
	if err := makeCgroup(dir); err != nil {
		s.log.Debug("freezer: no kept-frozen cgroup; freezes toggle the kernel's static key", "err", err)
		return
	}
	if err := os.WriteFile(filepath.Join(dir, "freezer.state"), []byte("FROZEN"), 0); err != nil {
		_ = unix.Rmdir(dir)
		s.log.Debug("freezer: no kept-frozen cgroup; freezes toggle the kernel's static key", "err", err)
		return
	}
	s.keepDir = dir
}

// freezerState returns the open freezer.state file (freezeMu held).
func (s *Sandbox) freezerState() (*os.File, error) {
	if s.stateFile == nil {
		f, err := os.OpenFile(filepath.Join(s.freezerDir, "freezer.state"), os.O_RDWR, 0)
		if err != nil {
			return nil, err
		}
		s.stateFile = f
	}
	return s.stateFile, nil
}

func readState(f *os.File) (string, error) {
	var b [32]byte
	n, err := f.ReadAt(b[:], 0)
	if n == 0 && err != nil {
		return "", err
	}
	return strings.TrimSpace(string(b[:n])), nil
}

// Process describes one process of a sandbox.
type Process struct {
	// PID and PPID are host pids; NSPID is the pid inside the sandbox.
	PID, PPID, NSPID int
	// Threads is the thread count.
	Threads int
	// Comm is the command name; State the one-letter state (R, S, T, t, Z...).
	Comm, State string
}

// Processes lists the sandbox's processes (init included), from its cgroup.
func (s *Sandbox) Processes() ([]Process, error) {
	pids, err := cgroupPIDs(s.freezerDir)
	if err != nil {
		return nil, fmt.Errorf("processes of %s: %w", s.cfg.ID, err)
	}
	out := make([]Process, 0, len(pids))
	for _, pid := range pids {
		p, err := readProcess(pid)
		if err != nil {
			continue // exited meanwhile
		}
		out = append(out, p)
	}
	return out, nil
}

// MemberPIDs returns the host pids of the sandbox's cgroup (init, helpers
// and exiting processes included): one read, for callers that must act
// on every process quickly. cr's restore kill also confirms with it that
// nothing survived, unless a CRIU restore left a process outside the
// cgroup (then it walks the init's descendants).
func (s *Sandbox) MemberPIDs() ([]int, error) {
	pids, err := cgroupPIDs(s.freezerDir)
	if err != nil {
		return nil, fmt.Errorf("members of %s: %w", s.cfg.ID, err)
	}
	return pids, nil
}

func cgroupPIDs(dir string) ([]int, error) {
	b, err := procfs.ReadFile(filepath.Join(dir, "cgroup.procs"))
	if err != nil {
		return nil, err
	}
	var pids []int
	for _, f := range strings.Fields(string(b)) {
		if n, err := strconv.Atoi(f); err == nil {
			pids = append(pids, n)
		}
	}
	return pids, nil
}

func readProcess(pid int) (Process, error) {
	p := Process{PID: pid}
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "stat"))
	if err != nil {
		return p, err
	}
	s := string(b)
	open, close := strings.IndexByte(s, '('), strings.LastIndexByte(s, ')')
	if open < 0 || close < open {
		return p, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	p.Comm = s[open+1 : close]
	f := strings.Fields(s[close+1:])
	// f[0]=state f[1]=ppid ... f[17]=num_threads
	if len(f) < 18 {
		return p, fmt.Errorf("parse /proc/%d/stat", pid)
	}
	p.State = f[0]
	p.PPID, _ = strconv.Atoi(f[1])
	p.Threads, _ = strconv.Atoi(f[17])
	p.NSPID = nsPID(pid)
	return p, nil
}

// statusPIDs returns the innermost pid and the parent's host pid of host
// pid from one read of its status (0s if unknown).
func statusPIDs(pid int) (nspid, ppid int) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "status"))
	if err != nil {
		return 0, 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "PPid:"); ok {
			ppid, _ = strconv.Atoi(strings.TrimSpace(v))
		} else if v, ok := strings.CutPrefix(l, "NSpid:"); ok {
			if fs := strings.Fields(v); len(fs) > 0 {
				nspid, _ = strconv.Atoi(fs[len(fs)-1])
			}
			break // NSpid comes after PPid
		}
	}
	return nspid, ppid
}

// nsPID returns the innermost pid of host pid (0 if unknown).
func nsPID(pid int) int {
	f, err := os.Open(fmt.Sprintf("/proc/%d/status", pid))
	if err != nil {
		return 0
	}
	defer f.Close()
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		if v, ok := strings.CutPrefix(sc.Text(), "NSpid:"); ok {
			fs := strings.Fields(v)
			if len(fs) == 0 {
				return 0
			}
			n, _ := strconv.Atoi(fs[len(fs)-1])
			return n
		}
	}
	return 0
}

// hostPID finds the host pid of the sandbox process whose pid inside is nspid.
func (s *Sandbox) hostPID(nspid int) int {
	pids, err := cgroupPIDs(s.freezerDir)
	if err != nil {
		return 0
	}
	for _, pid := range pids {
		if nsPID(pid) == nspid {
			return pid
		}
	}
	return 0
}

// pidfd opens a pidfd for host pid if it is (still) in this sandbox's
// cgroup: the pidfd then names that very process, even if the pid is
// recycled later. It returns -1 otherwise.
func (s *Sandbox) pidfd(pid int) int {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return -1 // gone
	}
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "cgroup"))
	if err != nil || !strings.Contains(string(b), ":freezer:"+strings.TrimPrefix(s.freezerDir, "/sys/fs/cgroup/freezer")+"\n") {
		unix.Close(fd)
		return -1 // not ours (any more)
	}
	return fd
}

// memberPidfds returns pidfds of the sandbox's processes but the init.
func (s *Sandbox) memberPidfds() []int {
	pids, _ := cgroupPIDs(s.freezerDir)
	var fds []int
	for _, pid := range pids {
		if pid == s.initPID {
			continue
		}
		if fd := s.pidfd(pid); fd >= 0 {
			fds = append(fds, fd)
		}
	}
	return fds
}

// killPID sends SIGKILL to host pid if it is still in this sandbox's cgroup
// (pidfd, so a recycled pid is never hit).
func (s *Sandbox) killPID(pid int) error {
	fd := s.pidfd(pid)
	if fd < 0 {
		return nil
	}
	defer unix.Close(fd)
	if err := unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0); err != nil && err != unix.ESRCH {
		return err
	}
	return nil
}

// KillProcesses SIGKILLs every process of the sandbox except the init and
// those keep returns true for (keep may be nil), and waits until they are
// gone (zombies count as gone). The sandbox must not be frozen.
func (s *Sandbox) KillProcesses(ctx context.Context, keep func(Process) bool) error {
	if s.Frozen() {
		return fmt.Errorf("kill processes of %s: sandbox is frozen", s.cfg.ID)
	}
	for {
		procs, err := s.Processes()
		if err != nil {
			return err
		}
		left := 0
		for _, p := range procs {
			if p.PID == s.initPID || p.State == "Z" || (keep != nil && keep(p)) {
				continue
			}
			left++
			if err := s.killPID(p.PID); err != nil {
				return fmt.Errorf("kill %d in %s: %w", p.PID, s.cfg.ID, err)
			}
		}
		if left == 0 {
			return nil
		}
		select {
		case <-ctx.Done():
			return fmt.Errorf("kill processes of %s: %d left: %w", s.cfg.ID, left, ctx.Err())
		case <-time.After(200 * time.Microsecond):
		}
	}
}

// WriteRunFile writes /run/rewind/<name> inside the sandbox (a per-sandbox
// tmpfs, e.g. the fork copy number). The path is resolved inside the
// sandbox's root; no sandbox symlink is followed out of it.
func (s *Sandbox) WriteRunFile(name string, data []byte) error {
	if name == "" || strings.Contains(name, "/") || name == "." || name == ".." {
		return fmt.Errorf("write run file %q: invalid name", name)
	}
	rootFD, err := unix.Open(fmt.Sprintf("/proc/%d/root", s.initPID), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("write run file %s: %w", name, err)
	}
	defer unix.Close(rootFD)
	fd, err := unix.Openat2(rootFD, "run/rewind/"+name, &unix.OpenHow{
		Flags:   unix.O_WRONLY | unix.O_CREAT | unix.O_TRUNC | unix.O_NOFOLLOW | unix.O_CLOEXEC,
		Mode:    0o644,
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return fmt.Errorf("write run file %s: %w", name, err)
	}
	f := os.NewFile(uintptr(fd), name)
	defer f.Close()
	if _, err := f.Write(data); err != nil {
		return fmt.Errorf("write run file %s: %w", name, err)
	}
	return nil
}

// Close kills every process of the sandbox (templates included, after the
// OnClose hooks ran), waits for them and removes the cgroups.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return nil
	}
	s.closed = true
	hooks := s.onClose
	s.onClose = nil
	sessions := make([]*Session, 0, len(s.sessions))
	for _, ss := range s.sessions {
		sessions = append(sessions, ss)
	}
	s.mu.Unlock()
	for _, fn := range hooks {
		fn()
	}
	for _, ss := range sessions {
		ss.shutdown(ErrClosed)
	}
	return s.teardown()
}

// teardown kills everything and removes the cgroups.
func (s *Sandbox) teardown() error {
	var errs []error
	if s.cmd != nil && s.cmd.Process != nil {
		// cgroup.kill kills every member atomically (no fork escapes);
		// frozen tasks cannot die: thaw after signalling.
		members := s.memberPidfds()
		defer func() {
			for _, fd := range members {
				unix.Close(fd)
			}
		}()
		_ = os.WriteFile(filepath.Join(s.v2Dir, "cgroup.kill"), []byte("1"), 0)
		_ = s.cmd.Process.Kill()
		for _, fd := range members {
			_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
		}
		_ = os.WriteFile(filepath.Join(s.freezerDir, "freezer.state"), []byte("THAWED"), 0)
		s.freezeMu.Lock()
		if s.stateFile != nil {
			s.stateFile.Close()
			s.stateFile = nil
		}
		s.freezeMu.Unlock()
		if s.cli != nil {
			s.cli.close()
		}
		// A killed process that this daemon still ptrace-attaches stays a
		// zombie until its tracer waits for it, and the pid namespace (the
		// init) cannot end before: reap such tracees here.
		timeout := time.After(20 * time.Second)
		tick := time.NewTicker(5 * time.Millisecond)
	wait:
		for {
			select {
			case <-s.initDone:
				break wait
			case <-timeout:
				errs = append(errs, fmt.Errorf("close %s: init %d did not exit", s.cfg.ID, s.initPID))
				break wait
			case <-tick.C:
				for _, fd := range members {
					// Reaps the very process (pidfd), and only if it is
					// our tracee: never another child of this daemon.
					_ = unix.Waitid(unix.P_PIDFD, fd, nil, unix.WEXITED|unix.WNOHANG|unix.WALL, nil)
				}
			}
		}
		tick.Stop()
	} else if s.cli != nil {
		s.cli.close()
	}
	deadline := time.Now().Add(20 * time.Second)
	dirs := s.cgroupDirs()
	if s.spareV2 != "" {
		dirs = append(dirs, s.spareV2)
	}
	if s.keepDir != "" {
		dirs = append(dirs, s.keepDir) // empty: an rmdir, frozen or not
	}
	for _, dir := range dirs {
		for {
			if pids, err := cgroupPIDs(dir); err == nil {
				for _, pid := range pids {
					_ = s.killPID(pid)
				}
			}
			err := unix.Rmdir(dir)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("close %s: remove cgroup %s: %w", s.cfg.ID, dir, err))
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

var _ io.Writer = (*lineLogger)(nil)

// CleanupStale kills whatever a dead daemon left in the cgroups of sandbox
// id (default cgroup parents) and removes them. Nothing is done for a
// sandbox that is running in this process; call it only for ids whose
// Sandbox is gone.
func CleanupStale(id string) error {
	if !idRE().MatchString(id) || strings.Contains(id, "..") {
		return fmt.Errorf("cleanup sandbox: invalid id %q", id)
	}
	dirs := []string{
		filepath.Join(DefaultFreezerParent, id), filepath.Join(DefaultCgroupV2Parent, id),
		filepath.Join(DefaultPidsParent, id), filepath.Join(DefaultMemoryParent, id),
		filepath.Join(DefaultFreezerParent, ".keep-"+id),
	}
	_ = os.WriteFile(filepath.Join(dirs[1], "cgroup.kill"), []byte("1"), 0)
	_ = os.WriteFile(filepath.Join(dirs[0], "freezer.state"), []byte("THAWED"), 0)
	var errs []error
	deadline := time.Now().Add(10 * time.Second)
	for _, dir := range dirs {
		for {
			if pids, err := cgroupPIDs(dir); err == nil {
				for _, pid := range pids {
					fd, err := unix.PidfdOpen(pid, 0)
					if err != nil {
						continue
					}
					// Still a member (the pid may have been recycled)?
					if b, err := procfs.ReadFile(procfs.PIDPath(pid, "cgroup")); err == nil && strings.Contains(string(b), "/rewind/"+id+"\n") {
						_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
					}
					unix.Close(fd)
				}
			}
			err := unix.Rmdir(dir)
			if err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			if time.Now().After(deadline) {
				errs = append(errs, fmt.Errorf("cleanup sandbox %s: remove %s: %w", id, dir, err))
				break
			}
			time.Sleep(2 * time.Millisecond)
		}
	}
	return errors.Join(errs...)
}

// CgroupIDs lists the ids of every sandbox (or spare) that has a cgroup
// under the default parents: after a daemon crash, those not running
// anymore can be passed to CleanupStale.
func CgroupIDs() ([]string, error) {
	seen := map[string]bool{}
	var ids []string
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent, DefaultMemoryParent} {
		ents, err := os.ReadDir(parent)
		if err != nil {
			if errors.Is(err, os.ErrNotExist) {
				continue
			}
			return nil, fmt.Errorf("list sandbox cgroups: %w", err)
		}
		for _, e := range ents {
			if e.IsDir() && idRE().MatchString(e.Name()) && !seen[e.Name()] {
				seen[e.Name()] = true
				ids = append(ids, e.Name())
			}
		}
	}
	sort.Strings(ids)
	return ids, nil
}
