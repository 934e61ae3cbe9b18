package cr

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"strconv"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// CRIU keeps its kernel-feature cache in /run/criu.kdat of the mount
// namespace it runs in, the sandbox's, and saves it only when /run is a
// tmpfs: in a sandbox it never does, so every CRIU run detects the kernel's
// features anew, which is most of a restore's time here. The engine makes
// the cache once, by running `criu check` in new PID, network, UTS, IPC and
// mount namespaces with a private tmpfs on /run (nothing of any sandbox is
// involved), and puts it into a fresh fork child's /run for the restore
// into it (no process of the child runs yet), removing it afterwards. A
// sandbox that has a /run/criu.kdat of its own keeps it untouched.

// kdatPath is CRIU's cache file, relative to the sandbox root.
const kdatPath = "run/criu.kdat"

// maxKdat bounds the cache file the engine keeps.
const maxKdat = 1 << 20

// kdatCache is CRIU's cache as makeKdat made it.
type kdatCache struct {
	once sync.Once
	mu   sync.Mutex
	data []byte
}

// kdatResolve keeps every path inside the sandbox root's own mount, with
// no symlink followed.
const kdatResolve = unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV

func sandboxRoot(init int) (int, error) {
	return unix.Open("/proc/"+strconv.Itoa(init)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

// seedKdat writes the cache into the sandbox of init, a fresh fork child
// none of whose processes runs yet, unless it has a cache file of its own.
// It returns true when it wrote the file (see unseedKdat).
func (e *Engine) seedKdat(init int) bool {
	root, err := sandboxRoot(init)
	if err != nil {
		return false
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, kdatPath, &unix.OpenHow{Flags: unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: kdatResolve})
	if err == nil {
		unix.Close(fd)
		return false
	}
	if !errors.Is(err, unix.ENOENT) {
		return false
	}
	e.kdat.mu.Lock()
	data := e.kdat.data
	e.kdat.mu.Unlock()
	if data == nil {
		return false
	}
	fd, err = unix.Openat2(root, kdatPath, &unix.OpenHow{
		Flags: unix.O_WRONLY | unix.O_CREAT | unix.O_EXCL | unix.O_NOFOLLOW | unix.O_CLOEXEC, Mode: 0o600, Resolve: kdatResolve,
	})
	if err != nil {
		return false
	}
	f := os.NewFile(uintptr(fd), kdatPath)
	_, werr := f.Write(data)
	cerr := f.Close()
	if werr != nil || cerr != nil {
		e.log.Debug("seed criu kdat", "init", init, "err", errors.Join(werr, cerr))
	}
	return true
}

// startKdat makes the cache in the background, once per engine.
func (e *Engine) startKdat() {
	e.kdat.once.Do(func() {
		e.mu.Lock()
		if e.closing {
			e.mu.Unlock()
			return
		}
		e.bg.Add(1)
		e.mu.Unlock()
		go func() {
			defer e.bg.Done()
			data, err := e.makeKdat()
			if err != nil {
				e.log.Info("no criu kernel-feature cache for fork children", "err", err)
				return
			}
			e.kdat.mu.Lock()
			e.kdat.data = data
			e.kdat.mu.Unlock()
		}()
	})
}

// makeKdat runs `criu check` where it can save its cache and returns it.
func (e *Engine) makeKdat() ([]byte, error) {
	r, err := e.criuRunner()
	if err != nil {
		return nil, err
	}
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	// criu check exits non-zero when an optional feature is missing: only
	// the cache matters. Loopback is up, as in a sandbox (CRIU probes TCP
	// repair on it).
	script := `mount -t tmpfs -o size=1m,mode=0700 rewind-kdat /run || exit 1; ip link set lo up || exit 1; "$0" check >/dev/null 2>&1; exec cat /run/criu.kdat`
	cmd := exec.CommandContext(ctx, "unshare", "--mount", "--propagation", "private", "--pid", "--fork", "--mount-proc", "--net", "--uts", "--ipc", "sh", "-c", script, r.Path)
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

// unseedKdat removes the cache seedKdat put into the sandbox of init.
func unseedKdat(init int) {
	root, err := sandboxRoot(init)
	if err != nil {
		return
	}
	defer unix.Close(root)
	dir, err := unix.Openat2(root, "run", &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_NOFOLLOW | unix.O_CLOEXEC, Resolve: kdatResolve})
	if err != nil {
		return
	}
	defer unix.Close(dir)
	_ = unix.Unlinkat(dir, "criu.kdat", 0)
}
