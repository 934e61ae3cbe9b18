package criu

import (
	"bytes"
	"context"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"time"
)

// criu runs inside a sandbox's mount namespace, where every path it opens
// for itself is the sandbox's, and the sandbox is hostile. Left alone, a
// CRIU 4.1.1 there reads its configuration from /etc/criu/default.conf and
// $HOME/.criu/default.conf (an action-script then runs agent code as root
// with every capability), loads plugins from /usr/lib/criu/, trusts a
// kernel-feature cache at /run/criu.kdat (forged features, or a symlink to a
// FIFO that blocks it), and, without a valid cache, probes the kernel by
// exec'ing "sh -c iptables ..." through $PATH. So every criu the runner
// starts gets:
//
//   - --no-default-config, and no CRIU_CONFIG_FILE: no configuration file;
//   - --libdir, $PATH, $HOME and $XDG_RUNTIME_DIR naming a private
//     directory of this process (a per-run copy made by runDir, passed as an
//     inherited descriptor and named through criu's own /proc/self/fd), so
//     no plugin, no program and no user file is found in the sandbox;
//   - --unprivileged, whose only use here is that CRIU then reads and saves
//     its cache in $XDG_RUNTIME_DIR, that private directory, instead of
//     /run: it loads the cache Kdat made (by a privileged `criu check` in
//     namespaces of its own, nothing of any sandbox involved). Otherwise
//     --unprivileged only skips cgroup dumps (cgroups are ignored here
//     anyway), time namespaces (none here) and a chroot into a root that is
//     already criu's own; rewind runs criu as root, so every capability
//     check still passes.
//
// A missing or stale cache now only costs a slow probe that finds no
// programs to run; the sandbox's own /run/criu.kdat, whatever it is, is
// never opened.

// kdatName is CRIU's cache file name.
const kdatName = "criu.kdat"

// maxKdat bounds the cache file the runner keeps.
const maxKdat = 1 << 20

// kdatCache is CRIU's cache as Kdat made it.
type kdatCache struct {
	mu   sync.Mutex
	done bool
	data []byte
	err  error
}

// Kdat returns CRIU's kernel-feature cache, made once per runner by `criu
// check` in new PID, network, UTS, IPC and mount namespaces with a private
// tmpfs on /run, and copied into every run's private directory. The first
// caller makes it (about a second); a failure is kept, and runs then probe
// the kernel themselves.
func (r *Runner) Kdat(ctx context.Context) ([]byte, error) {
	r.kdat.mu.Lock()
	defer r.kdat.mu.Unlock()
	if !r.kdat.done {
		r.kdat.data, r.kdat.err = r.makeKdat(ctx)
		r.kdat.done = true
	}
	return r.kdat.data, r.kdat.err
}

// makeKdat runs `criu check` where it can save its cache and returns it.
func (r *Runner) makeKdat(ctx context.Context) ([]byte, error) {
	ctx, cancel := context.WithTimeout(ctx, time.Minute)
	defer cancel()
	// criu check exits non-zero when an optional feature is missing: only
	// the cache matters. Loopback is up, as in a sandbox (CRIU probes TCP
	// repair on it). This runs in the host's file system: its programs
	// and files are the host's.
	script := `mount -t tmpfs -o size=1m,mode=0700 rewind-kdat /run || exit 1; ip link set lo up || exit 1; "$0" --no-default-config check >/dev/null 2>&1; exec cat /run/criu.kdat`
	// --kill-child: when the context ends and unshare is killed, the
	// namespace's init dies with it, and with the init every process of
	// the namespace (a criu stuck in a check, its helpers), which closes
	// the output pipe Run waits for.
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--kill-child", "--mount-proc", "--net", "--uts", "--ipc", "sh", "-c", script, r.Path)
	cmd.WaitDelay = 10 * time.Second
	var out bytes.Buffer
	cmd.Stdout = &limitedWriter{w: &out, n: maxKdat}
	if err := cmd.Run(); err != nil {
		return nil, fmt.Errorf("criu check in private namespaces: %w", err)
	}
	if out.Len() == 0 || out.Len() >= maxKdat {
		return nil, fmt.Errorf("criu check left a cache of %d bytes", out.Len())
	}
	return out.Bytes(), nil
}

// limitedWriter keeps at most n bytes.
type limitedWriter struct {
	w io.Writer
	n int
}

func (l *limitedWriter) Write(p []byte) (int, error) {
	k := len(p)
	if k > l.n {
		p = p[:l.n]
	}
	l.n -= len(p)
	if _, err := l.w.Write(p); err != nil {
		return 0, err
	}
	return k, nil
}

// runDir makes the private directory of one criu run: empty but for a copy
// of the cache (criu may replace or remove its copy; no other run sees
// that). The caller closes the returned directory and calls done once criu
// has exited.
func (r *Runner) runDir(ctx context.Context) (*os.File, func(), error) {
	data, _ := r.Kdat(ctx) // without a cache criu probes (see above)
	d, err := os.MkdirTemp(r.RunRoot, "run-")
	if err != nil {
		return nil, nil, fmt.Errorf("criu run directory: %w", err)
	}
	done := func() { _ = os.RemoveAll(d) }
	if data != nil {
		if err := os.WriteFile(filepath.Join(d, kdatName), data, 0o600); err != nil {
			done()
			return nil, nil, fmt.Errorf("criu run directory: %w", err)
		}
	}
	f, err := os.Open(d)
	if err != nil {
		done()
		return nil, nil, fmt.Errorf("criu run directory: %w", err)
	}
	return f, done, nil
}

// runFD is the descriptor number of the run directory in criu: after the
// binary (3), the image directory (4) and the host's loader and libraries.
func (r *Runner) runFD() int { return 5 + len(r.libs.files()) }

// noBreakpoints is CRIU's fault-injection code FI_NO_BREAKPOINTS (130),
// its supported mode for hosts without usable hardware breakpoints. After
// the parasite, CRIU lets each task run to its rt_sigreturn and stops it
// there with an x86 debug-register breakpoint. On some hosts the task is
// not stopped there: on one VM type of this kernel (6.18) every dump of a
// stopped python or bash copy failed so (the task ran on from its restored
// registers and exited: "Task N is in unexpected state: 0", or blocked and
// criu waited for it forever), and so did every image restore of the cr
// tests, though a debug-register breakpoint set by a small ptrace test
// fires on that host. With the code set, compel
// reaches the sigreturn by PTRACE_SYSCALL stops instead (two more ptrace
// stops per task), in dumps and restores alike.
const noBreakpoints = "130"

// Env is the environment a criu started outside a Runner needs on every
// host (a baseline's own criu, say): CRIU_FAULT=130, see noBreakpoints.
func Env() []string { return []string{"CRIU_FAULT=" + noBreakpoints} }

// command is criu run with args, as the runner runs it in a sandbox
// (startInNamespaces). Inside the sandbox's mount namespace criu's path may
// not exist: it is exec'd through the inherited descriptor 3, by the host's
// loader with the host's libraries (descriptors 5 and on, see hostLibs), so
// nothing it runs comes from the sandbox's files. The arguments before args
// and the environment, which is nothing of the caller's, are the hardening
// described above: no configuration file is read, helpers and caches live
// in the run's private directory (runFD), and CRIU_FAULT is set (see
// noBreakpoints). The caller sets the standard streams and ExtraFiles (fd
// 3 the binary, 4 the image directory, then hostLibs' files and the run
// directory).
func (r *Runner) command(args ...string) *exec.Cmd {
	run := "/proc/self/fd/" + strconv.Itoa(r.runFD())
	argv := []string{"/proc/self/fd/3"}
	if r.libs != nil {
		argv = r.libs.argv()
	}
	argv = append(argv, "--no-default-config", "--unprivileged", "--libdir", run)
	argv = append(argv, args...)
	return &exec.Cmd{
		Path: argv[0],
		Args: argv,
		Env:  []string{"CRIU_FAULT=" + noBreakpoints, "PATH=" + run, "HOME=" + run, "XDG_RUNTIME_DIR=" + run},
	}
}
