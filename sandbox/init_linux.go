package sandbox

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"os/signal"
	"path/filepath"
	"runtime"
	"runtime/metrics"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// initEnv marks a process started by Start (the same binary re-executed)
// as a sandbox's PID 1.
const initEnv = "REWIND_SANDBOX_INIT"

// ctlFD is the control socket's fd number in the init.
const ctlFD = 3

// keptCaps is the capability set of the init after setup and of every
// sandbox process: roughly Docker's default set without CAP_MKNOD.
var keptCaps = []uintptr{
	unix.CAP_CHOWN, unix.CAP_DAC_OVERRIDE, unix.CAP_FOWNER, unix.CAP_FSETID,
	unix.CAP_KILL, unix.CAP_SETGID, unix.CAP_SETUID, unix.CAP_SETPCAP,
	unix.CAP_NET_BIND_SERVICE, unix.CAP_NET_RAW, unix.CAP_SYS_CHROOT,
	unix.CAP_AUDIT_WRITE, unix.CAP_SETFCAP,
}

// init takes over a process started by Start as a sandbox init as early as
// possible: package initialization order puts this package's init before
// heavy ones (metrics, net/http...), which saves milliseconds per Start.
func init() { MaybeRunInit() }

// MaybeRunInit runs the sandbox init and never returns when the current
// process was started as one by Start; otherwise it returns at once.
// Importing the package already does this from its init function; calling
// it first thing in main (or TestMain) as well is harmless.
func MaybeRunInit() {
	if os.Getenv(initEnv) == "" {
		return
	}
	// Package initialization runs on the main thread: keep this goroutine
	// there for good; every sandbox process is forked from it.
	runtime.LockOSThread()
	name := []byte("rewind-init\x00")
	_ = unix.Prctl(unix.PR_SET_NAME, uintptr(unsafe.Pointer(&name[0])), 0, 0, 0)
	err := runInit()
	fmt.Fprintln(os.Stderr, "rewind init:", err)
	os.Exit(1)
}

// runInit receives the setup, builds the mount namespace, switches root,
// drops every thread's capabilities to the sandbox's set (re-executing
// itself when the runtime cannot: cgo), then serves the control channel and
// reaps children until the daemon goes away.
func runInit() error {
	// Nothing the daemon inherited may leak into the sandbox.
	_ = unix.CloseRange(ctlFD+1, ^uint(0), unix.CLOSE_RANGE_CLOEXEC)
	if err := resetSignalState(); err != nil {
		return err
	}
	// Catch and drop every signal a sandbox process could send us (PID 1
	// only gets signals it handles, and the Go runtime handles them all,
	// dying on most by default). Catch, not ignore: ignored dispositions
	// would be inherited by every sandbox process through exec.
	// os/signal starts its own locked thread on first use (about 2 ms on a
	// paravirtualized VM): that runs meanwhile, and is waited for before
	// the ready message (no sandbox process exists before it).
	drop := make(chan os.Signal, 64)
	chld := make(chan os.Signal, 16)
	caught := make(chan struct{})
	go func() {
		defer close(caught)
		var sigs []os.Signal
		for s := syscall.Signal(1); s < 32; s++ {
			switch s {
			case unix.SIGCHLD, unix.SIGKILL, unix.SIGSTOP, unix.SIGURG:
				continue
			}
			sigs = append(sigs, s)
		}
		signal.Notify(drop, sigs...)
		signal.Notify(chld, unix.SIGCHLD)
	}()
	go func() {
		for range drop {
		}
	}()

	ctlFile := os.NewFile(ctlFD, "control")
	c, err := newConn(ctlFile)
	if err != nil {
		return err
	}
	ctlFile.Close()
	buf := make([]byte, maxMsg)
	oob := make([]byte, unix.CmsgSpace(maxSetupFDs*4))
	fail := func(err error) error {
		_ = c.send(&msg{Op: opReady, Err: err.Error()})
		return err
	}
	keepCaps := false
	stage := os.Getenv(initEnv)
	spareStage := stage == stageSpare
	if spareStage {
		stage = stageFirst
	}
	first := stage != stageReexeced
	// The init's threads are made before the hello where they can be (a
	// spare init makes them while it waits, not on a start's path).
	prewarmed := false
	switch stage {
	case stageFirst:
		// The setup needs setupCaps effective, not in the bounding set:
		// drop them there now, while the runtime has few threads (every
		// all-thread syscall stops them all); threads made from here on
		// inherit the reduced set. A cgo binary cannot: it re-executes
		// after the setup and makes its threads then.
		err := dropBoundingAllThreads()
		if err != nil && !errors.Is(err, errNoAllThreads) {
			return err
		}
		if err == nil {
			prewarmThreads()
			prewarmed = true
		}
	case stageKeepCaps:
		prewarmThreads()
		prewarmed = true
	}
	if prewarmed {
		// Every thread of the init exists once the signal thread does:
		// sandbox processes get pids above them all (raisePIDFloor).
		<-caught
		if err := waitThreadsStarted(time.Second); err != nil {
			return fail(err)
		}
		if err := raisePIDFloor(); err != nil {
			return fail(err)
		}
	}
	if spareStage {
		// A spare's mount namespace is a copy of the host's, made when
		// it was spawned: every mount in it (other sandboxes' FUSE views
		// and overlays, a loop-mounted file system, an operator's mount)
		// would stay alive here after the host unmounted it, holding its
		// superblock, connection and loop device until this spare is
		// used. Its root and binds come as descriptors
		// (setupConfig.RootFD, BindFDs), so it waits in a tree of its own.
		if err := enterSpareRoot(); err != nil {
			return err
		}
	}
	if first {
		if err := c.send(&msg{Op: opHello}); err != nil {
			return err
		}
		m, fds, err := c.recv(buf, oob)
		if err != nil {
			return fmt.Errorf("read setup: %w", err)
		}
		if m.Op != opSetup || m.Setup == nil {
			closeFDs(fds)
			return fmt.Errorf("expected setup, got %q", m.Op)
		}
		rootFD := -1
		var bindFDs []int
		if m.Setup.RootFD {
			want := 1
			if m.Setup.BindFDs {
				want += len(m.Setup.Binds)
			}
			if len(fds) != want || !spareStage {
				closeFDs(fds)
				return fail(fmt.Errorf("setup: %d descriptors for the root and binds, want %d (spare %v)", len(fds), want, spareStage))
			}
			rootFD, bindFDs, fds = fds[0], fds[1:], nil
		} else if spareStage {
			closeFDs(fds)
			return fail(errors.New("setup: a spare needs its root as a descriptor"))
		}
		closeFDs(fds)
		// The counter before the namespace's setup, which mounts
		// /proc/sys read-only.
		err = nil
		if m.Setup.PIDCounterMin > pidFloor {
			err = raisePIDCounter(m.Setup.PIDCounterMin)
		}
		if err == nil {
			err = setupNamespace(m.Setup, rootFD, bindFDs)
		}
		if rootFD >= 0 {
			unix.Close(rootFD)
		}
		closeFDs(bindFDs)
		if err != nil {
			return fail(err)
		}
		keepCaps = m.Setup.KeepCaps
		if keepCaps && stage != stageKeepCaps {
			return fail(errors.New("keep_caps needs an init started for it (Config.KeepCaps; spares are not)"))
		}
		if !keepCaps {
			err := dropCapsAllThreads()
			if errors.Is(err, errNoAllThreads) {
				// This binary links cgo: the runtime cannot change every
				// thread's credentials. Drop them on this thread and
				// re-execute: exec leaves one thread, with these.
				return fail(reexecReduced(c))
			}
			if err != nil {
				return fail(err)
			}
		}
	}
	devNull, err := unix.Open("/dev/null", unix.O_RDWR|unix.O_CLOEXEC, 0)
	if err != nil {
		return fail(fmt.Errorf("open /dev/null: %w", err))
	}
	// stdin becomes the sandbox's own /dev/null (it was the host's).
	_ = unix.Dup3(devNull, 0, 0)
	st := &initState{c: c, devNull: devNull, held: map[int]bool{}, spawns: make(chan spawnReq)}
	// No sandbox process exists before opReady: every OS thread the init
	// will need exists by now, made while the pids limit has room (before
	// the hello, or here, after a re-executed init's caps drop). The check
	// below covers them all.
	if !prewarmed {
		prewarmThreads()
	}
	if !keepCaps {
		// Every thread of PID 1 must be as powerless as the sandbox's
		// processes: they can open /proc/1/mem.
		if err := checkThreadCaps(); err != nil {
			return fail(err)
		}
	}
	<-caught
	if err := c.send(&msg{Op: opReady, PID: os.Getpid()}); err != nil {
		return err
	}
	go st.reaper(chld)
	go st.serve(buf, oob)
	// Spawns run here, on the main thread, so that children inherit its
	// reduced capabilities.
	for r := range st.spawns {
		st.spawn(r.m, r.fds)
	}
	return errors.New("unreachable")
}

// resetSignalState clears what the daemon's own environment (a shell, a CI
// runner) may have passed down to the init, which would otherwise reach
// every sandbox process: exec keeps ignored dispositions and the signal
// mask, and syscall.ForkExec offers no way to reset them in the child.
//
//   - Dispositions: the child of a fork resets only the signals the Go
//     runtime handles. It never handles signal 32 (glibc's SIGCANCEL) or 34
//     (musl's SIGSYNCCALL) without cgo, so an inherited SIG_IGN for them
//     survived into the sandbox. Every signal still ignored here is set to
//     SIG_DFL (Go's handlers and glibc's are left alone).
//   - Mask: a forked child starts with the forking thread's current mask,
//     and the runtime keeps the signals the init's process started with
//     blocked (the daemon's inherited mask) on its threads. Spawns run on
//     this thread (the main thread, locked for good): unblock everything.
func resetSignalState() error {
	// struct kernel_sigaction on Linux: handler, flags, restorer, mask.
	type sigaction struct {
		handler, flags, restorer uintptr
		mask                     uint64
	}
	const sigIgn, sigDfl = 1, 0
	for sig := uintptr(1); sig <= 64; sig++ {
		if sig == uintptr(unix.SIGKILL) || sig == uintptr(unix.SIGSTOP) {
			continue
		}
		var old sigaction
		if _, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, sig, 0, uintptr(unsafe.Pointer(&old)), 8, 0, 0); e != 0 {
			return fmt.Errorf("read disposition of signal %d: %w", sig, e)
		}
		if old.handler != sigIgn {
			continue
		}
		act := sigaction{handler: sigDfl}
		if _, _, e := unix.RawSyscall6(unix.SYS_RT_SIGACTION, sig, uintptr(unsafe.Pointer(&act)), 0, 8, 0, 0); e != 0 {
			return fmt.Errorf("reset disposition of signal %d: %w", sig, e)
		}
	}
	if err := unix.PthreadSigmask(unix.SIG_SETMASK, &unix.Sigset_t{}, nil); err != nil {
		return fmt.Errorf("clear signal mask: %w", err)
	}
	return nil
}

// prewarmThreads starts, once and for all, the OS threads the init's Go
// runtime will ever need. The init shares the sandbox's v1 pids cgroup (the
// limit plus initThreadAllowance), and a Go runtime that fails to create a
// thread aborts ("failed to create new OS thread"): before this, a fork bomb
// that filled the limit killed PID 1 (about 1 sandbox in 18 under load), and
// with it the sandbox's control channel.
//
// The runtime never frees an idle thread (an M), and starts a new one only
// when no idle one is left. So the init fixes GOMAXPROCS (an explicit value
// also stops the runtime's automatic updates) and makes initSpareThreads
// threads exist at once, by locking that many goroutines to threads at the
// same time, then releasing them: the threads stay parked in the runtime's
// idle list. What the init can need at a time is far below that: one thread
// per P, the main thread (locked; spawns block in it), sysmon, the template
// thread, the os/signal receiver, and the few goroutines in a blocking
// syscall (the control socket and timers use the netpoller instead).
//
// (Moving the init out of the limited cgroup would need every spawn to
// reach the limited child cgroup before it can fork, which v1 offers no
// atomic way to do from an unprivileged init; preallocating is enough.)
func prewarmThreads() {
	runtime.GOMAXPROCS(initMaxProcs)
	var locked, release sync.WaitGroup
	release.Add(1)
	var done sync.WaitGroup
	for i := 0; i < initSpareThreads; i++ {
		locked.Add(1)
		done.Add(1)
		go func() {
			defer done.Done()
			runtime.LockOSThread()
			locked.Done()
			release.Wait()
			// Unlocked before returning: the thread goes idle, not away.
			runtime.UnlockOSThread()
		}()
	}
	locked.Wait()
	release.Done()
	done.Wait()
}

// waitThreadsStarted returns once every OS thread the Go runtime has
// decided to make exists. A thread wanted by a locked thread (the init's
// main one, or a goroutine of prewarmThreads) is made asynchronously, by
// the runtime's template thread: it can appear after prewarmThreads
// returns, and then, made after raisePIDFloor, took pid floor+1, the
// first sandbox process's pid (a flake of TestPIDFloor: "init thread has
// id 129"). The runtime counts a thread when it decides to make it
// (/sched/threads/total), the kernel when it exists (/proc/self/task): the
// two agree once none is pending.
func waitThreadsStarted(timeout time.Duration) error {
	s := []metrics.Sample{{Name: "/sched/threads/total:threads"}}
	deadline := time.Now().Add(timeout)
	for {
		metrics.Read(s)
		if s[0].Value.Kind() != metrics.KindUint64 {
			return nil // not in this runtime: nothing to wait with
		}
		want := s[0].Value.Uint64()
		tasks, err := os.ReadDir("/proc/self/task")
		if err != nil {
			return fmt.Errorf("pid floor: %w", err)
		}
		if uint64(len(tasks)) >= want {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("pid floor: the runtime wants %d threads, %d exist after %v", want, len(tasks), timeout)
		}
		time.Sleep(20 * time.Microsecond)
	}
}

// raisePIDFloor moves the counter of the init's PID namespace to pidFloor,
// once the init's threads exist: every sandbox process then gets a pid
// above pidFloor, and the init's threads keep their ids below it. Their
// number varies from one init to the next (the runtime's own threads race
// the prewarmed ones: 22 or 23 of them), so without the floor the first
// sandbox process got pid 24 or 25; an image with pid 24 restored into a
// sandbox whose init had a thread 24 (a fork child, a restore after a
// daemon restart) failed with "File exists", and kept failing. The write
// needs CAP_SYS_ADMIN (or CAP_CHECKPOINT_RESTORE) over the namespace, which
// the init holds until the setup's drop; it acts on the writer's own PID
// namespace whatever /proc is mounted.
func raisePIDFloor() error {
	if err := raisePIDCounter(pidFloor); err != nil {
		return fmt.Errorf("pid floor: %w", err)
	}
	return nil
}

// raisePIDCounter moves the counter of the init's PID namespace to to,
// unless it is there or above already (see raisePIDFloor for who may).
func raisePIDCounter(to int) error {
	const f = "/proc/sys/kernel/ns_last_pid"
	b, err := os.ReadFile(f)
	if err != nil {
		return err
	}
	if cur, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil && cur >= to {
		return nil
	}
	if err := os.WriteFile(f, []byte(strconv.Itoa(to)), 0); err != nil {
		return fmt.Errorf("pid counter to %d: %w", to, err)
	}
	return nil
}

// pidFloor is the last pid of a sandbox's namespace reserved for its
// init's threads (see raisePIDFloor): far above what the pids limit lets
// the init have (initThreadAllowance).
const pidFloor = 4 * initThreadAllowance

// initMaxProcs is the init's GOMAXPROCS; initSpareThreads is how many OS
// threads prewarmThreads makes exist (besides the main one);
// initThreadAllowance is added to the sandbox's pids limit for the init's
// own threads, and must exceed initSpareThreads plus the runtime's own few.
const (
	initMaxProcs        = 2
	initSpareThreads    = 16
	initThreadAllowance = 32
)

// Values of initEnv: a first start, and the re-execution of an init whose
// credentials are reduced already.
const (
	stageFirst    = "1"
	stageReexeced = "2"
	// stageKeepCaps is a first start for a sandbox with Config.KeepCaps:
	// its bounding set keeps setupCaps.
	stageKeepCaps = "3"
	// stageSpare is a first start of a spare init (Spares), whose root
	// and binds come as descriptors: it waits in a tree of its own, not
	// in its copy of the host's (enterSpareRoot).
	stageSpare = "4"
)

// spareRootDir is where a spare attaches the sandbox's root in its own
// tree (enterSpareRoot) before it pivots into it.
const spareRootDir = "/root"

// maxSetupFDs is how many descriptors a message to the init may carry: a
// spare's setup has the root and one per bind.
const maxSetupFDs = 16

// enterSpareRoot leaves the spare's copy of the host's mount tree: it
// makes the copy private (nothing done here reaches the host), pivots into
// a small tmpfs of its own with a fresh /proc (the setup writes the PID
// counter there) and an empty spareRootDir, and detaches the whole copy.
// The spare then holds no host mount: whatever the host unmounts while it
// waits is gone (superblock, FUSE connection, loop device) as if the spare
// did not exist. Its setup brings the root and binds as descriptors.
func enterSpareRoot() error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	fsfd, err := unix.Fsopen("tmpfs", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("spare root: fsopen tmpfs: %w", err)
	}
	defer unix.Close(fsfd)
	for _, kv := range [][2]string{{"mode", "0755"}, {"size", "64k"}, {"nr_inodes", "16"}} {
		if err := unix.FsconfigSetString(fsfd, kv[0], kv[1]); err != nil {
			return fmt.Errorf("spare root: tmpfs %s=%s: %w", kv[0], kv[1], err)
		}
	}
	if err := unix.FsconfigCreate(fsfd); err != nil {
		return fmt.Errorf("spare root: create tmpfs: %w", err)
	}
	mfd, err := unix.Fsmount(fsfd, unix.FSMOUNT_CLOEXEC, unix.MOUNT_ATTR_NOSUID|unix.MOUNT_ATTR_NODEV|unix.MOUNT_ATTR_NOEXEC)
	if err != nil {
		return fmt.Errorf("spare root: fsmount: %w", err)
	}
	defer unix.Close(mfd)
	for _, d := range []string{"proc", spareRootDir[1:]} {
		if err := unix.Mkdirat(mfd, d, 0o755); err != nil {
			return fmt.Errorf("spare root: mkdir %s: %w", d, err)
		}
	}
	// Attached over the copy's root, then swapped with it (pivot_root's
	// new and old root the same directory, as in setupNamespace).
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, "/", unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("spare root: attach: %w", err)
	}
	if err := unix.Fchdir(mfd); err != nil {
		return fmt.Errorf("spare root: chdir: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("spare root: pivot_root: %w", err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("spare root: detach the host's mounts: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	if err := unix.Mount("proc", "/proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return fmt.Errorf("spare root: mount proc: %w", err)
	}
	return nil
}

var errNoAllThreads = errors.New("cannot run a syscall on every thread (cgo)")

// keptMask returns keptCaps as a bit mask.
func keptMask() uint64 {
	var m uint64
	for _, c := range keptCaps {
		m |= 1 << c
	}
	return m
}

// dropCapsAllThreads reduces the bounding, permitted and effective
// capability sets of every thread of the process to keptCaps.
func dropCapsAllThreads() error {
	if err := dropBoundingAllThreads(); err != nil {
		return err
	}
	hdr := unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}
	data := capData()
	if _, _, e := syscall.AllThreadsSyscall(unix.SYS_CAPSET, uintptr(unsafe.Pointer(&hdr)), uintptr(unsafe.Pointer(&data[0])), 0); e != 0 {
		if e == syscall.ENOTSUP {
			return errNoAllThreads
		}
		return fmt.Errorf("capset: %w", e)
	}
	return nil
}

// dropBoundingAllThreads reduces the bounding set of every thread of the
// process to keptCaps; permitted and effective sets stay.
func dropBoundingAllThreads() error {
	last, kept := uintptr(lastCap()), keptMask()
	// The init is started with a bounding set of keptCaps already
	// (startReduced): one read of it usually shows nothing to drop, where
	// asking for each capability took 40 system calls. Every all-thread
	// syscall below stops the world.
	bnd, known := ownBoundingSet()
	for c := uintptr(0); c <= last; c++ {
		if kept&(1<<c) != 0 || (known && bnd&(1<<c) == 0) {
			continue
		}
		if !known {
			if in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, c, 0, 0, 0); err == nil && in == 0 {
				continue
			}
		}
		if _, _, e := syscall.AllThreadsSyscall(unix.SYS_PRCTL, unix.PR_CAPBSET_DROP, c, 0); e != 0 {
			if e == syscall.ENOTSUP {
				return errNoAllThreads
			}
			return fmt.Errorf("drop capability %d: %w", c, e)
		}
	}
	return nil
}

// ownBoundingSet returns the calling thread's capability bounding set, as
// /proc/thread-self/status gives it; ok is false when it cannot be read.
func ownBoundingSet() (bnd uint64, ok bool) {
	var buf [4096]byte
	n, err := readSmall("/proc/thread-self/status", buf[:])
	if err != nil {
		return 0, false
	}
	v, ok := statusField(buf[:n], "CapBnd")
	if !ok {
		return 0, false
	}
	bnd, err = strconv.ParseUint(string(v), 16, 64)
	return bnd, err == nil
}

func capData() [2]unix.CapUserData {
	var data [2]unix.CapUserData
	for _, c := range keptCaps {
		data[c/32].Permitted |= 1 << (c % 32)
		data[c/32].Effective |= 1 << (c % 32)
	}
	return data
}

// reexecReduced drops the calling (locked, main) thread's capabilities and
// re-executes the init with the control socket on ctlFD: after exec the
// process has one thread, with the reduced set, and every thread the
// runtime starts inherits it.
func reexecReduced(c *conn) error {
	var derr error
	if err := c.rc.Control(func(fd uintptr) {
		if int(fd) == ctlFD {
			_, derr = unix.FcntlInt(fd, unix.F_SETFD, 0)
		} else {
			derr = unix.Dup3(int(fd), ctlFD, 0)
		}
	}); err != nil {
		return fmt.Errorf("control fd: %w", err)
	}
	if derr != nil {
		return fmt.Errorf("control fd: %w", derr)
	}
	if err := dropBoundingSet(); err != nil {
		return err
	}
	data := capData()
	if err := unix.Capset(&unix.CapUserHeader{Version: unix.LINUX_CAPABILITY_VERSION_3}, &data[0]); err != nil {
		return fmt.Errorf("capset: %w", err)
	}
	err := syscall.Exec("/proc/self/exe", []string{"rewind-init"}, []string{initEnv + "=" + stageReexeced, "GOMAXPROCS=1"})
	return fmt.Errorf("re-execute init: %w", err)
}

// checkThreadCaps verifies that no thread has a capability beyond keptCaps.
func checkThreadCaps() error {
	d, err := os.Open("/proc/self/task")
	if err != nil {
		return fmt.Errorf("check capabilities: %w", err)
	}
	tids, err := d.Readdirnames(-1)
	d.Close()
	if err != nil {
		return fmt.Errorf("check capabilities: %w", err)
	}
	mask := keptMask()
	// One buffer for every thread's status (about 1.5 KiB each), read
	// with plain system calls: the init has two dozen threads, and a
	// fresh Go heap pays page faults for every allocation.
	buf := make([]byte, 8192)
	for _, tid := range tids {
		n, err := readSmall("/proc/self/task/"+tid+"/status", buf)
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ESRCH) {
			continue // thread gone
		}
		if err != nil {
			return fmt.Errorf("check capabilities of thread %s: %w", tid, err)
		}
		if err := statusCapsWithin(buf[:n], mask); err != nil {
			return fmt.Errorf("thread %s of the init %w", tid, err)
		}
	}
	return nil
}

// readSmall reads the file at path into buf, which must be large enough
// to hold it whole.
func readSmall(path string, buf []byte) (int, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	n := 0
	for {
		if n == len(buf) {
			return n, fmt.Errorf("%s: longer than %d bytes", path, len(buf))
		}
		m, err := unix.Read(fd, buf[n:])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return n, err
		}
		if m == 0 {
			return n, nil
		}
		n += m
	}
}

// statusCapsWithin checks the capability lines of a /proc/PID/status text
// (inheritable, permitted, effective, bounding and ambient sets): each must
// be there and within mask.
func statusCapsWithin(status []byte, mask uint64) error {
	for _, field := range [...]string{"CapInh", "CapPrm", "CapEff", "CapBnd", "CapAmb"} {
		v, ok := statusField(status, field)
		if !ok {
			return fmt.Errorf("has no %s line in its status", field)
		}
		n, err := strconv.ParseUint(string(v), 16, 64)
		if err != nil {
			return fmt.Errorf("has an unreadable %s %q", field, v)
		}
		if n&^mask != 0 {
			return fmt.Errorf("keeps capabilities %s %s", field, v)
		}
	}
	return nil
}

// statusField returns the value of a "Name:\tvalue" line of a
// /proc/PID/status text, trimmed.
func statusField(status []byte, name string) ([]byte, bool) {
	key := "\n" + name + ":"
	i := bytes.Index(status, []byte(key))
	if i < 0 {
		return nil, false
	}
	v := status[i+len(key):]
	if j := bytes.IndexByte(v, '\n'); j >= 0 {
		v = v[:j]
	}
	return bytes.TrimSpace(v), true
}

func lastCap() int {
	if b, err := os.ReadFile("/proc/sys/kernel/cap_last_cap"); err == nil {
		if n, err := strconv.Atoi(strings.TrimSpace(string(b))); err == nil {
			return n
		}
	}
	return 40
}

// setupCaps are the capabilities the init needs, on top of keptCaps, to
// build the sandbox (mounts, pivot_root, sethostname; device nodes;
// loopback up). The init is started with no others (startReduced).
var setupCaps = []uintptr{unix.CAP_SYS_ADMIN, unix.CAP_MKNOD, unix.CAP_NET_ADMIN}

// dropBoundingSet drops every capability but keptCaps from the calling
// thread's bounding set.
func dropBoundingSet() error {
	return dropBoundingExcept(keptMask())
}

// dropBoundingExcept drops every capability not in keep from the calling
// thread's bounding set.
func dropBoundingExcept(keep uint64) error {
	last := uintptr(lastCap())
	for c := uintptr(0); c <= last; c++ {
		if keep&(1<<c) != 0 {
			continue
		}
		if err := unix.Prctl(unix.PR_CAPBSET_DROP, c, 0, 0, 0); err != nil {
			return fmt.Errorf("drop capability %d: %w", c, err)
		}
	}
	return nil
}

// setupNamespace runs in the new mount namespace as PID 1. A spare
// (rootFD >= 0) gets its root and, with cfg.BindFDs, its binds' sources as
// detached mount trees the daemon cloned (open_tree): it waits in a tree
// of its own (enterSpareRoot), which has none of the host's paths.
func setupNamespace(cfg *setupConfig, rootFD int, sentBinds []int) error {
	if err := unix.Mount("", "/", "", unix.MS_REC|unix.MS_PRIVATE, ""); err != nil {
		return fmt.Errorf("make mounts private: %w", err)
	}
	root := cfg.Root
	if rootFD >= 0 {
		// Clones of the daemon's mounts keep their propagation (peers of
		// the host's shared ones): nothing the sandbox mounts may reach
		// the host.
		private := &unix.MountAttr{Propagation: unix.MS_PRIVATE}
		if err := unix.MountSetattr(rootFD, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, private); err != nil {
			return fmt.Errorf("root %s private: %w", cfg.Root, err)
		}
		root = spareRootDir
		if err := unix.MoveMount(rootFD, "", unix.AT_FDCWD, root, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
			return fmt.Errorf("attach root %s: %w", cfg.Root, err)
		}
	}
	// Clone bind sources on the host side (detached mount trees) before the
	// host disappears, unless they came cloned (the caller closes those);
	// they are attached after the root switch.
	bindFDs := sentBinds
	if !cfg.BindFDs {
		cloned := make([]int, 0, len(cfg.Binds))
		defer func() { closeFDs(cloned) }()
		for _, b := range cfg.Binds {
			fd, err := unix.OpenTree(unix.AT_FDCWD, b.Source, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC|unix.AT_RECURSIVE)
			if err != nil {
				return fmt.Errorf("bind source %s: %w", b.Source, err)
			}
			cloned = append(cloned, fd)
		}
		bindFDs = cloned
	}
	for i, b := range cfg.Binds {
		fd := bindFDs[i]
		attr := &unix.MountAttr{}
		if cfg.BindFDs {
			attr.Propagation = unix.MS_PRIVATE
		}
		if b.ReadOnly {
			attr.Attr_set = unix.MOUNT_ATTR_RDONLY | unix.MOUNT_ATTR_NOSUID | unix.MOUNT_ATTR_NODEV
		}
		if *attr != (unix.MountAttr{}) {
			if err := unix.MountSetattr(fd, "", unix.AT_EMPTY_PATH|unix.AT_RECURSIVE, attr); err != nil {
				return fmt.Errorf("bind %s attributes: %w", b.Source, err)
			}
		}
	}
	if err := unix.Mount(root, root, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
		return fmt.Errorf("bind root %s: %w", root, err)
	}
	if err := unix.Chdir(root); err != nil {
		return fmt.Errorf("chdir root: %w", err)
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return fmt.Errorf("pivot_root %s: %w", root, err)
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	if err := unix.Chdir("/"); err != nil {
		return err
	}
	// From here on every path resolves inside the sandbox root.
	if err := mountAt("/proc", "proc", "proc", unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
		return err
	}
	if err := setupDev(); err != nil {
		return err
	}
	if err := protectProc(); err != nil {
		return err
	}
	for i, b := range cfg.Binds {
		if err := bindAt(bindFDs[i], b); err != nil {
			return err
		}
	}
	if err := mountAt("/run/rewind", "tmpfs", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=0755,size=16m"); err != nil {
		return err
	}
	for _, p := range cfg.Tmpfs {
		if err := mountAt(p, "tmpfs", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777"); err != nil {
			return err
		}
	}
	for _, p := range cfg.Hide {
		st, err := os.Lstat(p)
		if err != nil || st.Mode()&os.ModeSymlink != 0 {
			continue // nothing to hide (a symlink shadows what was there)
		}
		if st.IsDir() {
			if err := unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0000,size=4k"); err != nil {
				return fmt.Errorf("hide %s: %w", p, err)
			}
		} else if err := unix.Mount("/dev/null", p, "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("hide %s: %w", p, err)
		}
	}
	if cfg.Hostname != "" {
		if err := unix.Sethostname([]byte(cfg.Hostname)); err != nil {
			return fmt.Errorf("sethostname: %w", err)
		}
	}
	if cfg.Net {
		if err := loopbackUp(); err != nil {
			return err
		}
	}
	return nil
}

func mountAt(target, source, fstype string, flags uintptr, data string) error {
	if err := os.MkdirAll(target, 0o755); err != nil {
		return fmt.Errorf("mkdir %s: %w", target, err)
	}
	if err := unix.Mount(source, target, fstype, flags, data); err != nil {
		return fmt.Errorf("mount %s on %s: %w", fstype, target, err)
	}
	return nil
}

func bindAt(fd int, b Bind) error {
	target := filepath.Join("/", b.Target)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return fmt.Errorf("bind %s: %w", b.Source, err)
	}
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		if err := os.MkdirAll(target, 0o755); err != nil {
			return fmt.Errorf("mkdir %s: %w", target, err)
		}
	} else if _, err := os.Lstat(target); err != nil {
		if err := os.MkdirAll(filepath.Dir(target), 0o755); err != nil {
			return fmt.Errorf("mkdir %s: %w", target, err)
		}
		f, err := os.OpenFile(target, os.O_CREATE|os.O_WRONLY, 0o644)
		if err != nil {
			return fmt.Errorf("bind target %s: %w", target, err)
		}
		f.Close()
	}
	if err := unix.MoveMount(fd, "", unix.AT_FDCWD, target, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("bind %s on %s: %w", b.Source, target, err)
	}
	return nil
}

// Kernel interfaces under /proc that a sandbox's root must not use (as in
// the OCI runtimes' defaults): masked entirely, or read-only.
var (
	procMasked   = []string{"/proc/kcore", "/proc/keys", "/proc/timer_list", "/proc/sched_debug", "/proc/acpi", "/proc/scsi", "/proc/latency_stats"}
	procReadOnly = []string{"/proc/sys", "/proc/sysrq-trigger", "/proc/bus", "/proc/fs", "/proc/irq"}
)

func protectProc() error {
	for _, p := range procMasked {
		st, err := os.Lstat(p)
		if err != nil {
			continue
		}
		if st.IsDir() {
			err = unix.Mount("tmpfs", p, "tmpfs", unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, "mode=0000,size=4k")
		} else {
			err = unix.Mount("/dev/null", p, "", unix.MS_BIND, "")
		}
		if err != nil {
			return fmt.Errorf("mask %s: %w", p, err)
		}
	}
	for _, p := range procReadOnly {
		if _, err := os.Lstat(p); err != nil {
			continue
		}
		if err := unix.Mount(p, p, "", unix.MS_BIND|unix.MS_REC, ""); err != nil {
			return fmt.Errorf("bind %s: %w", p, err)
		}
		if err := unix.Mount("", p, "", unix.MS_REMOUNT|unix.MS_BIND|unix.MS_RDONLY|unix.MS_NOSUID|unix.MS_NODEV|unix.MS_NOEXEC, ""); err != nil {
			return fmt.Errorf("remount %s read-only: %w", p, err)
		}
	}
	return nil
}

func setupDev() error {
	if err := mountAt("/dev", "tmpfs", "tmpfs", unix.MS_NOSUID|unix.MS_NOEXEC, "mode=0755,size=1m"); err != nil {
		return err
	}
	old := unix.Umask(0)
	defer unix.Umask(old)
	for _, d := range []struct {
		name         string
		major, minor uint32
	}{{"null", 1, 3}, {"zero", 1, 5}, {"full", 1, 7}, {"random", 1, 8}, {"urandom", 1, 9}, {"tty", 5, 0}} {
		if err := unix.Mknod("/dev/"+d.name, unix.S_IFCHR|0o666, int(unix.Mkdev(d.major, d.minor))); err != nil {
			return fmt.Errorf("mknod /dev/%s: %w", d.name, err)
		}
	}
	if err := mountAt("/dev/pts", "devpts", "devpts", unix.MS_NOSUID|unix.MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620"); err != nil {
		return err
	}
	if err := mountAt("/dev/shm", "shm", "tmpfs", unix.MS_NOSUID|unix.MS_NODEV, "mode=1777"); err != nil {
		return err
	}
	for name, target := range map[string]string{
		"ptmx": "pts/ptmx", "fd": "/proc/self/fd", "stdin": "/proc/self/fd/0",
		"stdout": "/proc/self/fd/1", "stderr": "/proc/self/fd/2",
	} {
		if err := os.Symlink(target, "/dev/"+name); err != nil {
			return fmt.Errorf("symlink /dev/%s: %w", name, err)
		}
	}
	return nil
}

func loopbackUp() error {
	fd, err := unix.Socket(unix.AF_INET, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	defer unix.Close(fd)
	ifr, err := unix.NewIfreq("lo")
	if err != nil {
		return fmt.Errorf("loopback: %w", err)
	}
	if err := unix.IoctlIfreq(fd, unix.SIOCGIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback flags: %w", err)
	}
	ifr.SetUint16(ifr.Uint16() | unix.IFF_UP)
	if err := unix.IoctlIfreq(fd, unix.SIOCSIFFLAGS, ifr); err != nil {
		return fmt.Errorf("loopback up: %w", err)
	}
	return nil
}

// initState is the running init.
type initState struct {
	c       *conn
	devNull int
	mu      sync.Mutex // serializes spawn replies with exit reports
	held    map[int]bool
	spawns  chan spawnReq
}

type spawnReq struct {
	m   *msg
	fds []int
}

// serve reads control messages; spawns go to the main thread.
func (st *initState) serve(buf, oob []byte) {
	for {
		m, fds, err := st.c.recv(buf, oob)
		if err != nil {
			var bad badMsgError
			if errors.As(err, &bad) {
				continue
			}
			// The daemon is gone: take the whole sandbox down with us.
			_ = unix.Kill(-1, unix.SIGKILL)
			os.Exit(0)
		}
		if m.Op == opSpawn {
			st.spawns <- spawnReq{m, fds}
			continue
		}
		st.handle(m, fds)
	}
}

func (st *initState) reply(m *msg, r *msg) {
	r.Op = opReply
	r.ID = m.ID
	_ = st.c.send(r)
}

func (st *initState) handle(m *msg, fds []int) {
	defer func() {
		if p := recover(); p != nil {
			st.reply(m, &msg{Err: fmt.Sprint("init: ", p)})
		}
	}()
	switch m.Op {
	case opPing:
		closeFDs(fds)
		st.reply(m, &msg{})
	case opKill:
		closeFDs(fds)
		pid := m.PID
		if pid <= 1 {
			st.reply(m, &msg{Err: "kill: bad pid"})
			return
		}
		if m.Group {
			pid = -pid
		}
		if err := unix.Kill(pid, syscall.Signal(m.Sig)); err != nil && err != unix.ESRCH {
			st.reply(m, &msg{Err: "kill: " + err.Error()})
			return
		}
		st.reply(m, &msg{})
	case opHold:
		st.mu.Lock()
		for _, fd := range fds {
			st.held[fd] = true
		}
		st.mu.Unlock()
		st.reply(m, &msg{FDs: fds})
	case opRelease:
		closeFDs(fds)
		st.mu.Lock()
		for _, fd := range m.FDs {
			if st.held[fd] {
				delete(st.held, fd)
				unix.Close(fd)
			}
		}
		st.mu.Unlock()
		st.reply(m, &msg{})
	default:
		closeFDs(fds)
		st.reply(m, &msg{Err: "unknown op " + m.Op})
	}
}

func (st *initState) spawn(m *msg, fds []int) {
	defer closeFDs(fds)
	defer func() {
		if p := recover(); p != nil {
			st.reply(m, &msg{Err: fmt.Sprint("init: ", p)})
		}
	}()
	if len(m.Argv) == 0 {
		st.reply(m, &msg{Err: "spawn: empty argv"})
		return
	}
	files := make([]uintptr, 3)
	for i := range files {
		files[i] = uintptr(st.devNull)
		if i < len(m.Stdio) && m.Stdio[i] >= 0 {
			if m.Stdio[i] >= len(fds) {
				st.reply(m, &msg{Err: "spawn: bad stdio index"})
				return
			}
			files[i] = uintptr(fds[m.Stdio[i]])
		}
	}
	dir := m.Dir
	if dir == "" {
		dir = "/"
	}
	path, err := lookPath(m.Argv[0], m.Env, dir)
	if err != nil {
		st.reply(m, &msg{Err: err.Error(), BadCommand: true})
		return
	}
	sys := &syscall.SysProcAttr{Setsid: true}
	master := -1
	if m.TTY {
		var slave int
		var err error
		master, slave, err = openTerminal(m.Rows, m.Cols)
		if err != nil {
			st.reply(m, &msg{Err: fmt.Sprintf("start %s: %v", m.Argv[0], err)})
			return
		}
		defer unix.Close(master)
		defer unix.Close(slave)
		files = []uintptr{uintptr(slave), uintptr(slave), uintptr(slave)}
		sys.Setctty = true
		sys.Ctty = 0
	}
	st.mu.Lock()
	defer st.mu.Unlock()
	pid, err := syscall.ForkExec(path, m.Argv, &syscall.ProcAttr{
		Dir:   dir,
		Env:   m.Env,
		Files: files,
		Sys:   sys,
	})
	if err != nil {
		// ForkExec's child reports its chdir's failure like exec's: say
		// which one failed.
		bad := errors.Is(err, syscall.ENOENT) || errors.Is(err, syscall.ENOTDIR) || errors.Is(err, syscall.EACCES) ||
			errors.Is(err, syscall.ENOEXEC) || errors.Is(err, syscall.EISDIR) || errors.Is(err, syscall.ENAMETOOLONG)
		if fi, serr := os.Stat(dir); serr != nil || !fi.IsDir() {
			if serr == nil {
				serr = syscall.ENOTDIR
			}
			err, bad = fmt.Errorf("working directory %s: %w", dir, serr), true
		}
		st.reply(m, &msg{Err: fmt.Sprintf("start %s: %v", m.Argv[0], err), BadCommand: bad})
		return
	}
	r := &msg{Op: opReply, ID: m.ID, PID: pid}
	if master >= 0 {
		_ = st.c.send(r, master)
		return
	}
	_ = st.c.send(r)
}

// openTerminal opens a new pseudo-terminal of the sandbox's devpts and
// returns its master and slave.
func openTerminal(rows, cols int) (master, slave int, err error) {
	master, err = unix.Open("/dev/ptmx", unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, -1, fmt.Errorf("open terminal: %w", err)
	}
	if err := unix.IoctlSetPointerInt(master, unix.TIOCSPTLCK, 0); err != nil {
		unix.Close(master)
		return -1, -1, fmt.Errorf("unlock terminal: %w", err)
	}
	n, err := unix.IoctlGetUint32(master, unix.TIOCGPTN)
	if err != nil {
		unix.Close(master)
		return -1, -1, fmt.Errorf("terminal number: %w", err)
	}
	if rows <= 0 {
		rows = 50
	}
	if cols <= 0 {
		cols = 200
	}
	_ = unix.IoctlSetWinsize(master, unix.TIOCSWINSZ, &unix.Winsize{Row: uint16(rows), Col: uint16(cols)})
	slave, err = unix.Open(fmt.Sprintf("/dev/pts/%d", n), unix.O_RDWR|unix.O_NOCTTY|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(master)
		return -1, -1, fmt.Errorf("open terminal %d: %w", n, err)
	}
	return master, slave, nil
}

// lookPath resolves argv0 like execvp, with the request's PATH.
func lookPath(name string, env []string, dir string) (string, error) {
	if strings.Contains(name, "/") {
		return name, nil
	}
	path := "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, "PATH="); ok {
			path = v
		}
	}
	for _, d := range filepath.SplitList(path) {
		if d == "" {
			d = "."
		}
		p := filepath.Join(d, name)
		if !filepath.IsAbs(p) {
			p = filepath.Join(dir, p)
		}
		if unix.Access(p, unix.X_OK) == nil {
			if st, err := os.Stat(p); err == nil && st.Mode().IsRegular() {
				return p, nil
			}
		}
	}
	return "", fmt.Errorf("start %s: executable file not found in PATH", name)
}

func (st *initState) reaper(chld <-chan os.Signal) {
	tick := time.NewTicker(time.Second)
	defer tick.Stop()
	for {
		select {
		case <-chld:
		case <-tick.C:
		}
		st.mu.Lock()
		for {
			var ws unix.WaitStatus
			pid, err := unix.Wait4(-1, &ws, unix.WNOHANG|unix.WALL, nil)
			if err == unix.EINTR {
				continue
			}
			if err != nil || pid <= 0 {
				break
			}
			_ = st.c.send(&msg{Op: opExit, PID: pid, Status: int(ws)})
		}
		st.mu.Unlock()
	}
}
