// Package criu drives CRIU (through go-criu) for rewind: dumps and restores
// of process subtrees that live inside a sandbox's PID and mount
// namespaces.
//
// CRIU refuses to dump a subtree of a foreign PID namespace ("Can't dump a
// pid namespace without the process init"), and run in that PID namespace
// with the host's /proc it cannot even read its targets. So criu runs
// inside the sandbox's PID and mount namespaces: the runner starts it from
// a thread that entered them (see swrk; go-criu has no hook to enter
// namespaces, so only its RPC types are used). Image directories are passed
// as inherited file descriptors, so they need not be visible inside the
// sandbox.
package criu

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"github.com/checkpoint-restore/go-criu/v8/rpc"
	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// DefaultPath is where scripts/deps.sh installs CRIU.
const DefaultPath = "/opt/rewind/criu/sbin/criu"

// Find returns the criu binary: explicit if set, else $REWIND_CRIU, else
// DefaultPath, else criu from PATH.
func Find(explicit string) (string, error) {
	for _, p := range []string{explicit, os.Getenv("REWIND_CRIU"), DefaultPath} {
		if p == "" {
			continue
		}
		if st, err := os.Stat(p); err == nil && !st.IsDir() && st.Mode()&0o111 != 0 {
			return p, nil
		} else if p == explicit || p == os.Getenv("REWIND_CRIU") {
			return "", fmt.Errorf("criu binary %s is not usable: %v", p, err)
		}
	}
	p, err := exec.LookPath("criu")
	if err != nil {
		return "", errors.New("criu not found (set REWIND_CRIU, install it to " + DefaultPath + " or put it on PATH)")
	}
	return p, nil
}

// Runner runs CRIU operations.
type Runner struct {
	// Path is the criu binary.
	Path string
	// RunRoot holds the runs' private directories (runDir).
	RunRoot string
	// libs are the host's loader and library directories criu runs with
	// inside a sandbox (nil for a static criu).
	libs *hostLibs
	// kdat is CRIU's kernel-feature cache (see Kdat).
	kdat kdatCache
	// cgMounts caches the cgroup hierarchies' mount points (cgroupMounts).
	cgMu     sync.Mutex
	cgMounts map[string]string
}

// NewRunner finds criu (see Find) and prepares a private directory for its
// runs: runRoot, emptied first (a killed process's runs left their
// directories there), or a new temp dir when runRoot is "".
func NewRunner(explicit, runRoot string) (*Runner, error) {
	p, err := Find(explicit)
	if err != nil {
		return nil, err
	}
	libs, err := openHostLibs(p)
	if err != nil {
		return nil, fmt.Errorf("criu runner: %w", err)
	}
	d := runRoot
	if d == "" {
		d, err = os.MkdirTemp("", "rewind-criu-")
	} else if err = os.RemoveAll(d); err == nil {
		err = os.MkdirAll(d, 0o700)
	}
	if err != nil {
		libs.close()
		return nil, fmt.Errorf("criu runner: %w", err)
	}
	return &Runner{Path: p, RunRoot: d, libs: libs}, nil
}

// Close removes the runs' directory.
func (r *Runner) Close() error {
	r.libs.close()
	return os.RemoveAll(r.RunRoot)
}

// Error is a failed CRIU operation with the path of its log.
type Error struct {
	Op  string
	Log string
	Err error
}

func (e *Error) Error() string {
	return fmt.Sprintf("criu %s failed: %v (log: %s%s)", e.Op, e.Err, e.Log, lastErrorLine(e.Log))
}

func (e *Error) Unwrap() error { return e.Err }

// MissingFile reports whether err is a CRIU restore that failed because a
// regular file the image's process held open does not exist at its path,
// and returns that path (absolute, as inside the restored process's root).
func MissingFile(err error) (string, bool) {
	var e *Error
	if !errors.As(err, &e) || e.Op != "restore" {
		return "", false
	}
	b, rerr := os.ReadFile(e.Log)
	if rerr != nil {
		return "", false
	}
	for _, l := range strings.Split(string(b), "\n") {
		// files-reg.c open_path: "Can't open file %s on restore".
		_, rest, ok := strings.Cut(l, "Can't open file ")
		if !ok || !strings.Contains(l, "Error") || !strings.HasSuffix(strings.TrimSpace(l), "No such file or directory") {
			continue
		}
		if path, _, ok := strings.Cut(rest, " on restore"); ok {
			return "/" + strings.TrimPrefix(path, "/"), true
		}
	}
	return "", false
}

// PidTaken reports whether err is a restore that failed because a pid or
// thread id of the image was in use when CRIU created that task (clone3
// with set_tid: EEXIST). A caller that made sure the pids were free before
// may retry: the kernel frees a reaped task's pid only after the task is
// gone from /proc and from its parent's children, so a check can see a
// pid free a moment before it is.
func PidTaken(err error) bool {
	var e *Error
	if !errors.As(err, &e) || e.Op != "restore" {
		return false
	}
	b, rerr := os.ReadFile(e.Log)
	if rerr != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if !strings.Contains(l, "Error") {
			continue
		}
		// cr-restore.c fork_with_pid and pie/restorer.c (threads, -EEXIST).
		if strings.Contains(l, "Can't fork for") && strings.HasSuffix(strings.TrimSpace(l), "File exists") ||
			strings.Contains(l, "Unable to create a thread: -17") {
			return true
		}
	}
	return false
}

func lastErrorLine(log string) string {
	b, err := os.ReadFile(log)
	if err != nil {
		return ""
	}
	return firstError(string(b))
}

// firstError returns the first error line of a criu log (the cause; the
// last one is "Dumping FAILED"), after the line logged before it: what
// criu was doing when, say, its timeout fired.
func firstError(log string) string {
	lines := strings.Split(log, "\n")
	for i, l := range lines {
		// Skip the errors CRIU logs on every run here: no CAP_SYS_RESOURCE
		// (RLIMIT_NOFILE) and no /dev/net/tun in the sandbox (feature probe).
		if strings.Contains(l, "Error") && !strings.Contains(l, "RLIMIT_NOFILE") && !strings.Contains(l, "tun: Unable to create tun") {
			out := "; " + strings.TrimSpace(l)
			if i > 0 && strings.TrimSpace(lines[i-1]) != "" {
				out = "; after " + strings.TrimSpace(lines[i-1]) + out
			}
			return out
		}
	}
	return ""
}

// DumpOptions describe one dump.
type DumpOptions struct {
	// NSInit is the host pid of the PID 1 whose PID and mount namespaces
	// criu must run in (0: run in the caller's namespaces).
	NSInit int
	// Pid is the root of the dumped subtree, as seen inside NSInit's PID
	// namespace (or the host pid when NSInit is 0).
	Pid int
	// Dir is the image directory (created if missing).
	Dir string
	// LeaveRunning leaves the processes running (or stopped, if they were)
	// after the dump; otherwise they are killed.
	LeaveRunning bool
	// External are files of the processes on mounts outside the namespace
	// (see Externals), dumped as criu externals and recorded in the image
	// directory; Restore opens them again by path in the sandbox's root.
	External map[string]string
}

// Log files criu writes into an image directory.
const (
	DumpLog = "dump.log"
	// RestoreLog is the log of the last successful restore; a failed
	// restore's log keeps a name of its own (Error.Log).
	RestoreLog = "restore.log"
	LazyLog    = "lazy-pages.log"
)

func ptr[T any](v T) *T { return &v }

// baseOpts: the image dir is criu's inherited fd 4, named through criu's own
// /proc/self (images_dir_fd would be resolved in the *caller's* /proc, which
// criu cannot see from inside the sandbox's PID namespace).
func baseOpts(log string) *rpc.CriuOpts {
	return &rpc.CriuOpts{
		ImagesDirFd:     ptr(int32(-1)),
		ImagesDir:       ptr("/proc/self/fd/4"),
		LogFile:         ptr(log),
		LogLevel:        ptr(int32(4)),
		ShellJob:        ptr(true),
		TcpEstablished:  ptr(true),
		ExtUnixSk:       ptr(true),
		FileLocks:       ptr(true),
		OrphanPtsMaster: ptr(false),
		// Only for where CRIU keeps its cache (see hardening).
		Unprivileged: ptr(true),
		// criu already runs in the sandbox's cgroups (see startSwrk).
		ManageCgroupsMode: ptr(rpc.CriuCgMode_IGNORE),
		// The sandbox's network namespace is private: nothing to lock,
		// and an iptables lock left behind by a failed dump would cut
		// the sandbox's loopback.
		NetworkLock: ptr(rpc.CriuNetworkLockMethod_SKIP),
	}
}

// GhostLimit is the largest file without a name (deleted, O_TMPFILE) a
// dump copies into its image; a process holding a larger one cannot be
// dumped.
const GhostLimit = 256 << 20

// Dump dumps the subtree rooted at o.Pid into o.Dir.
func (r *Runner) Dump(ctx context.Context, o DumpOptions) error {
	if err := os.MkdirAll(o.Dir, 0o700); err != nil {
		return fmt.Errorf("criu dump: %w", err)
	}
	dir, err := os.Open(o.Dir)
	if err != nil {
		return fmt.Errorf("criu dump: %w", err)
	}
	defer dir.Close()
	files, done, err := r.files(ctx, dir)
	if err != nil {
		return fmt.Errorf("criu dump: %w", err)
	}
	defer done()
	opts := baseOpts(DumpLog)
	opts.Pid = ptr(int32(o.Pid))
	// A file the processes hold without a name (deleted, O_TMPFILE, a
	// temporary file) has its content in the image: up to GhostLimit
	// instead of criu's 1 MiB.
	opts.GhostLimit = ptr(uint32(GhostLimit))
	opts.LeaveRunning = ptr(o.LeaveRunning)
	if err := writeExternals(o.Dir, o.External); err != nil {
		return fmt.Errorf("criu dump: %w", err)
	}
	for k := range o.External {
		opts.External = append(opts.External, k)
	}
	s, err := r.startSwrk(o.NSInit, false, files)
	if err != nil {
		return fmt.Errorf("criu dump: %w", err)
	}
	err = s.call(ctx, rpc.CriuReqType_DUMP, opts, nil)
	if cerr := s.close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return &Error{Op: "dump", Log: filepath.Join(o.Dir, DumpLog), Err: err}
	}
	return nil
}

// RestoreOptions describe one restore.
type RestoreOptions struct {
	// NSInit: as in DumpOptions. The restored root is reparented to it.
	NSInit int
	// Dir is the image directory.
	Dir string
	// Lazy restores memory on demand: a `criu lazy-pages` daemon (started
	// here, in the same namespaces) serves the pages through userfaultfd
	// and copies the rest in the background, so the restore returns before
	// the memory is in.
	Lazy bool
	// Inherit maps CRIU file keys (e.g. "pipe:[12345]") to files the
	// restored processes get in place of the dumped ones.
	Inherit map[string]*os.File
}

// Restore restores the images in o.Dir detached (the restored root becomes
// a child of NSInit's PID 1) and returns its pid as criu reports it (in the
// namespace of NSInit).
func (r *Runner) Restore(ctx context.Context, o RestoreOptions) (int, error) {
	if o.NSInit != 0 {
		if err := checkImagePaths(o.Dir, o.NSInit); err != nil {
			return 0, fmt.Errorf("criu restore: %w", err)
		}
	}
	dir, err := os.Open(o.Dir)
	if err != nil {
		return 0, fmt.Errorf("criu restore: %w", err)
	}
	defer dir.Close()
	files, done, err := r.files(ctx, dir)
	if err != nil {
		return 0, fmt.Errorf("criu restore: %w", err)
	}
	defer done()
	for k, f := range o.Inherit {
		files[k] = f
	}
	if o.NSInit != 0 {
		ext, err := openExternals(o.Dir, o.NSInit)
		if err != nil {
			return 0, fmt.Errorf("criu restore: %w", err)
		}
		for k, f := range ext {
			defer f.Close()
			if o.Inherit[k] == nil {
				files[k] = f
			}
		}
	}
	// A log of its own: restores of one image run in parallel (a fork
	// fans one checkpoint out into many sandboxes), and a shared log
	// would name another run's lines in this run's error (and in
	// PidTaken's decision). A successful run's log becomes RestoreLog.
	logName, err := runLogName()
	if err != nil {
		return 0, fmt.Errorf("criu restore: %w", err)
	}
	logPath := filepath.Join(o.Dir, logName)
	opts := baseOpts(logName)
	opts.RstSibling = ptr(false)
	if o.Lazy {
		stop, err := r.startLazyPages(ctx, o.NSInit, o.Dir)
		if err != nil {
			return 0, &Error{Op: "lazy-pages", Log: filepath.Join(o.Dir, LazyLog), Err: err}
		}
		defer stop()
		opts.LazyPages = ptr(true)
	}
	s, err := r.startSwrk(o.NSInit, true, files)
	if err != nil {
		return 0, fmt.Errorf("criu restore: %w", err)
	}
	var pid int32
	err = s.call(ctx, rpc.CriuReqType_RESTORE, opts, func(script string, p int32) error {
		if script == "post-restore" {
			pid = p
		}
		return nil
	})
	if cerr := s.close(); err == nil && cerr != nil {
		err = cerr
	}
	if err != nil {
		return 0, &Error{Op: "restore", Log: logPath, Err: err}
	}
	_ = os.Rename(logPath, filepath.Join(o.Dir, RestoreLog))
	return int(pid), nil
}

// runLogName returns a log file name no other run uses: "restore-" and 12
// random hex digits.
func runLogName() (string, error) {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		return "", err
	}
	return "restore-" + hex.EncodeToString(b[:]) + ".log", nil
}

// startLazyPages starts `criu lazy-pages` for dir (in the sandbox's
// namespaces, as command and startInNamespaces start criu, with the binary
// as fd 3 and the image dir as fd 4; not in its cgroups) and
// waits for its socket. go-criu has no request for this daemon, so it is
// run as a command. The returned stop reaps the daemon in the background:
// it exits by itself once every page is in, and must not be killed before
// (the restored process would fault on missing pages).
func (r *Runner) startLazyPages(ctx context.Context, nsPID int, dir string) (func(), error) {
	d, err := os.Open(dir)
	if err != nil {
		return nil, err
	}
	defer d.Close()
	files, filesDone, err := r.files(ctx, d)
	if err != nil {
		return nil, err
	}
	sock := filepath.Join(dir, "lazy-pages.socket")
	_ = os.Remove(sock)
	null, err := os.OpenFile(os.DevNull, os.O_RDWR, 0)
	if err != nil {
		filesDone()
		return nil, err
	}
	defer null.Close()
	cmd := r.command("lazy-pages", "--images-dir", "/proc/self/fd/4", "-o", LazyLog, "-v4")
	cmd.Stdin, cmd.Stdout, cmd.Stderr = null, null, null
	_, cmd.ExtraFiles = inOrder(files)
	if err := startInNamespaces(nsPID, cmd); err != nil {
		filesDone()
		return nil, err
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait(); filesDone() }()
	deadline := time.Now().Add(10 * time.Second)
	for {
		if _, err := os.Stat(sock); err == nil {
			break
		}
		select {
		case err := <-done:
			return nil, fmt.Errorf("lazy-pages exited early: %v", err)
		default:
		}
		if time.Now().After(deadline) {
			_ = cmd.Process.Kill()
			<-done
			return nil, errors.New("lazy-pages socket did not appear")
		}
		time.Sleep(200 * time.Microsecond)
	}
	return func() { go func() { <-done }() }, nil
}

// files are what criu inherits for a run on image directory dir, by key
// (startSwrk passes them as 3, 4, ... in key order): the criu binary fd 3,
// the image dir fd 4, the host's loader and libraries 5 and on, and the
// run's private directory (runDir) the next. done releases them once criu
// has exited.
func (r *Runner) files(ctx context.Context, dir *os.File) (files map[string]*os.File, done func(), err error) {
	bin, err := os.Open(r.Path)
	if err != nil {
		return nil, nil, err
	}
	run, runDone, err := r.runDir(ctx)
	if err != nil {
		bin.Close()
		return nil, nil, err
	}
	files = map[string]*os.File{"00-criu-binary": bin, "01-images-dir": dir, "03-criu-run": run}
	for i, f := range r.libs.files() {
		files[fmt.Sprintf("02-host-lib-%02d", i)] = f
	}
	return files, func() { bin.Close(); run.Close(); runDone() }, nil
}

// killedWait bounds how long a run waits for criu to exit once its session
// ends, and then once it is killed (swrk.close).
const killedWait = 10 * time.Second

// cgroupMounts returns the mount points of the cgroup hierarchies in this
// mount namespace (see parseCgroupMounts), read once and kept: every criu
// start needs them, and /proc/self/mountinfo grows with the daemon's
// sandboxes (its parse cost a first fork of 32 about 1 ms a child). With
// refresh it reads them again.
func (r *Runner) cgroupMounts(refresh bool) (map[string]string, error) {
	r.cgMu.Lock()
	defer r.cgMu.Unlock()
	if r.cgMounts != nil && !refresh {
		return r.cgMounts, nil
	}
	mi, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	r.cgMounts = parseCgroupMounts(mi)
	return r.cgMounts, nil
}

// parseCgroupMounts maps each cgroup hierarchy of mountinfo, by its
// controllers ("" for cgroup2, "cpu,cpuacct" for a v1 one), to the first
// mount point of its root.
func parseCgroupMounts(mountinfo []byte) map[string]string {
	mounts := map[string]string{}
	for _, l := range strings.Split(string(mountinfo), "\n") {
		pre, post, ok := strings.Cut(l, " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 3 || pf[3] != "/" {
			continue
		}
		switch qf[0] {
		case "cgroup2":
			if _, dup := mounts[""]; !dup {
				mounts[""] = pf[4]
			}
		case "cgroup":
			var ctrls []string
			for _, o := range strings.Split(qf[2], ",") {
				switch o {
				case "rw", "ro", "noprefix", "xattr", "clone_children", "cpuset_v2_mode":
					continue
				}
				if strings.HasPrefix(o, "release_agent=") {
					continue
				}
				ctrls = append(ctrls, o)
			}
			key := strings.Join(ctrls, ",")
			if _, dup := mounts[key]; !dup {
				mounts[key] = pf[4]
			}
		}
	}
	return mounts
}

// cgroupProcsFiles returns the cgroup.procs files of every cgroup pid is
// in (v1 hierarchies and cgroup2), as paths in this mount namespace. A
// hierarchy of pid's that the cached mounts lack makes it read them again.
func (r *Runner) cgroupProcsFiles(pid int, refresh bool) ([]string, error) {
	mounts, err := r.cgroupMounts(refresh)
	if err != nil {
		return nil, err
	}
	cg, err := procfs.ReadFile(procfs.PIDPath(pid, "cgroup"))
	if err != nil {
		return nil, err
	}
	out, missing := cgroupFilesOf(cg, mounts)
	if missing && !refresh {
		if mounts, err = r.cgroupMounts(true); err != nil {
			return nil, err
		}
		out, _ = cgroupFilesOf(cg, mounts)
	}
	return out, nil
}

// cgroupFilesOf maps the lines of a /proc/PID/cgroup to cgroup.procs paths
// under mounts; missing reports a hierarchy with no mount in mounts.
func cgroupFilesOf(cg []byte, mounts map[string]string) (out []string, missing bool) {
	for _, l := range strings.Split(strings.TrimSpace(string(cg)), "\n") {
		parts := strings.SplitN(l, ":", 3)
		if len(parts) != 3 {
			continue
		}
		mnt, ok := mounts[parts[1]]
		if !ok {
			missing = true
			continue
		}
		if strings.ContainsAny(parts[2], "'\n") {
			continue
		}
		out = append(out, filepath.Join(mnt, parts[2], "cgroup.procs"))
	}
	return out, missing
}
