// Package daemon is rewind's daemon: it owns every sandbox and checkpoint
// on a host through a state.Manager and serves the v1 HTTP/JSON API (see
// package api) on a root-only unix socket, with Prometheus metrics at
// /metrics.
package daemon

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// Config configures a daemon.
type Config struct {
	// StateDir holds the metadata store and the back ends' data.
	StateDir string
	// Socket is the unix socket path of the API.
	Socket string
	// Backend is "real" (the default: FUSE fs, namespaces, cr, probe and
	// WASM policies) or "fake" (in-memory back ends, for tests and
	// machines without root).
	Backend string
	// DefaultPolicy is the policy of sandboxes created without one.
	DefaultPolicy string
	// Budget triggers automatic GC.
	Budget state.Budget
	// MaxTemplates and MaxTemplateBytes bound the process checkpoint
	// engine's template pool (checkpoints holding live templates, and
	// their private dirty memory); 0 keeps the engine's defaults (64,
	// 4 GiB). Over the bound, least recently used templates whose CRIU
	// image exists are evicted: their checkpoints restore from the image.
	MaxTemplates     int
	MaxTemplateBytes int64
	// NoHugePages keeps sandbox processes' checkpointed memory in 4 KiB
	// pages (cr.Config.NoCollapse): less copying and template memory for
	// processes that write all over their memory, at the price of forks,
	// restores and frozen time that grow with memory size.
	NoHugePages bool
	// CompactDepth: when a sandbox's file system has this many frozen
	// layers after a checkpoint, they are merged into one in the
	// background (no checkpoint's content changes). 0 means
	// DefaultCompactDepth; a negative value never compacts.
	CompactDepth int
	// WarmForks bounds the fork children prepared ahead of a repeated
	// fork (state.Config.WarmForks); 0 prepares none.
	WarmForks int
	// MemoryMax bounds each sandbox's memory in bytes (its processes'
	// memory and page cache, swap included; the kernel's OOM killer acts
	// inside the sandbox past it). 0 leaves it unbounded.
	MemoryMax int64
	// PidsMax bounds each sandbox's tasks (processes and threads); 0
	// means sandbox.DefaultPidsMax.
	PidsMax int
	// SpareInits is how many sandbox inits the real backend keeps started
	// ahead of time (sandbox.Spares): a new sandbox or fork child on one
	// skips the init's exec and runtime start. 0 keeps none.
	SpareInits int
	// InitPath is the binary every sandbox runs as its init. Empty means
	// InitName (cmd/rewind-init) beside the daemon's executable when it is
	// there and from the same build, else the daemon's own binary; the
	// small one starts faster (every new sandbox and fork child waits for
	// its init's start).
	InitPath string
	// StoreConfig is the store config `rewind init-store` writes ("" =
	// kernelpath.DefaultStoreConfig). If it names this daemon's state dir,
	// the real backend mounts its image there before using the state dir
	// (after a reboot, for example). A missing file means no image.
	StoreConfig string
	// Version is reported by GET /v1/version.
	Version string
	Logger  *slog.Logger
	// Ready, if set, is called once the socket accepts connections.
	Ready func()

	// storeImage is the image file the state dir is mounted from (a loop
	// device's backing file, as `rewind init-store` makes it), if any: it
	// holds every checkpoint's data, so sandboxes must not see it.
	storeImage string
}

// InitName is the sandbox init binary the daemon looks for beside its own
// (cmd/rewind-init; `make build` puts both in bin/).
const InitName = "rewind-init"

// DefaultCompactDepth is Config.CompactDepth's default: deep enough that
// compaction is rare (a tree search of 100 expansions triggers it about
// once per sandbox), shallow enough that a long session's stack, its
// in-memory layer caches and its journal stay small.
const DefaultCompactDepth = 64

// backendSet is what a daemon runs on.
type backendSet struct {
	fs       state.FSBackend
	proc     state.ProcBackend
	probe    state.Probe
	policies state.PolicyLoader
	names    map[string]string
	// collectors are extra metrics from the back ends.
	collectors []prometheus.Collector
	close      func()
}

func fakeBackends(cfg *Config) *backendSet {
	b := statefake.New(nil)
	return &backendSet{
		fs: b.FS, proc: b.Proc, probe: statefake.Probe{}, policies: statefake.Policies{},
		names: map[string]string{"fs": "fake", "proc": "fake", "probe": "fake", "policy": "fake"},
		close: func() {},
	}
}

// Run serves until ctx ends, then shuts down gracefully: in-flight calls
// finish, pending checkpoints complete, sandboxes are stopped and stay
// recoverable in the store.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = slog.Default()
	}
	if cfg.StateDir == "" {
		cfg.StateDir = api.DefaultStateDir
	}
	if cfg.Socket == "" {
		cfg.Socket = api.DefaultSocket
	}
	if cfg.Version == "" {
		cfg.Version = "dev"
	}
	stateDir, err := filepath.Abs(cfg.StateDir)
	if err != nil {
		return err
	}
	cfg.StateDir = stateDir
	if cfg.Backend == "" || cfg.Backend == "real" {
		if err := mountStore(cfg, log); err != nil {
			return err
		}
		cfg.storeImage = storeImage(cfg.StateDir)
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	lock, err := lockStateDir(cfg.StateDir)
	if err != nil && breakDeadLock(cfg.StateDir, log) {
		lock, err = lockStateDir(cfg.StateDir)
	}
	if err != nil {
		return err
	}
	defer lock.Close()
	var be *backendSet
	switch cfg.Backend {
	case "fake":
		be = fakeBackends(&cfg)
	case "", "real":
		be, err = realBackends(ctx, &cfg, log)
		if err != nil {
			return fmt.Errorf("back ends: %w (run `rewind doctor`; `rewind daemon --backend fake` runs without them)", err)
		}
	default:
		return fmt.Errorf("unknown --backend %q (want real or fake)", cfg.Backend)
	}
	defer be.close()

	reg := prometheus.NewRegistry()
	reg.MustRegister(collectors.NewGoCollector(), collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	for _, c := range be.collectors {
		reg.MustRegister(c)
	}
	met := newMetrics(reg)
	mgr, err := state.Open(ctx, state.Config{
		Dir: filepath.Join(cfg.StateDir, "meta"), FS: be.fs, Proc: be.proc, Probe: be.probe, Policies: be.policies,
		DefaultPolicy: cfg.DefaultPolicy, Hide: hidden(cfg),
		BootID: bootID(), Budget: cfg.Budget, WarmForks: cfg.WarmForks, Observer: met, Logger: log,
	})
	if err != nil {
		return err
	}
	gauges(reg, mgr)

	ln, err := listen(cfg.Socket)
	if err != nil {
		mgr.Close(context.Background())
		return err
	}
	if abs, err := filepath.Abs(cfg.StateDir); err == nil {
		if err := writeStateRecord(cfg.Socket, abs); err != nil {
			log.Warn("record the state dir beside the socket", "err", err)
		}
	}
	info := api.VersionInfo{Version: cfg.Version, API: api.Version, PID: os.Getpid(), Backends: be.names, StateDir: cfg.StateDir}
	srv := newServer(mgr, met, reg, log, info)
	hs := &http.Server{Handler: srv.handler, ReadHeaderTimeout: 10 * time.Second, ErrorLog: slog.NewLogLogger(log.Handler(), slog.LevelWarn)}
	errc := make(chan error, 1)
	go func() { errc <- hs.Serve(ln) }()
	log.Info("rewind daemon listening", "socket", cfg.Socket, "state", cfg.StateDir, "backends", be.names, "pid", os.Getpid())
	if cfg.Ready != nil {
		cfg.Ready()
	}
	select {
	case <-ctx.Done():
	case err = <-errc:
		log.Error("server stopped", "err", err)
	}
	log.Info("shutting down")
	sctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hs.Shutdown(sctx)
	os.Remove(cfg.Socket)
	if cerr := mgr.Close(sctx); cerr != nil {
		log.Error("close state", "err", cerr)
	}
	log.Info("stopped")
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	return err
}

// listen opens the API socket, 0600 from its creation on (made under a
// umask that leaves no one else any access). A socket directory that does
// not exist is made root-only (0700); one that exists is left as it is,
// so that a socket in a shared directory (/tmp) does not change that
// directory's mode. A stale socket from a dead daemon is replaced; a live
// one is an error.
func listen(path string) (net.Listener, error) {
	dir := filepath.Dir(path)
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return nil, fmt.Errorf("socket dir: %w", err)
	}
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("a daemon already listens on %s", path)
	}
	os.Remove(path)
	old := syscall.Umask(0o177)
	ln, err := net.Listen("unix", path)
	syscall.Umask(old)
	if err != nil {
		return nil, fmt.Errorf("listen %s: %w", path, err)
	}
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("socket %s: %w", path, err)
	}
	return ln, nil
}

// writeStateRecord records the state dir beside the socket (see
// api.StateRecord): through a new file renamed into place, so that a link
// someone else put at the record's name in a shared directory is replaced,
// never followed.
func writeStateRecord(socket, stateDir string) error {
	path := api.StateRecord(socket)
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*")
	if err != nil {
		return err
	}
	defer os.Remove(f.Name())
	if _, err := f.WriteString(stateDir + "\n"); err != nil {
		f.Close()
		return err
	}
	if err := f.Close(); err != nil {
		return err
	}
	return os.Rename(f.Name(), path)
}

// hidden lists the host paths a sandbox must not see: the state dir, the
// image file it is mounted from (if any), and
// the socket's directory when it is the daemon's own (root-only, or about
// to be made so), else only the socket and its state record (a socket in
// a shared directory such as /tmp must not hide that directory from every
// sandbox). /run/rewind is every sandbox's own tmpfs already.
func hidden(cfg Config) []string {
	h := []string{cfg.StateDir}
	if cfg.storeImage != "" {
		h = append(h, cfg.storeImage)
	}
	d := filepath.Dir(cfg.Socket)
	switch {
	case d == "/run/rewind":
	case privateDir(d):
		h = append(h, d)
	default:
		h = append(h, cfg.Socket, api.StateRecord(cfg.Socket))
	}
	return h
}

// privateDir reports whether dir is the daemon's own: missing (listen makes
// it 0700), or owned by the daemon's user with no access for anyone else.
func privateDir(dir string) bool {
	st, err := os.Stat(dir)
	if errors.Is(err, os.ErrNotExist) {
		return true
	}
	if err != nil {
		return false
	}
	sys, ok := st.Sys().(*syscall.Stat_t)
	return ok && st.IsDir() && st.Mode().Perm()&0o077 == 0 && int(sys.Uid) == os.Geteuid()
}

// lockStateDir makes sure one daemon at a time uses a state dir.
func lockStateDir(dir string) (*os.File, error) {
	f, err := os.OpenFile(filepath.Join(dir, "daemon.lock"), os.O_CREATE|os.O_RDWR, 0o600)
	if err != nil {
		return nil, fmt.Errorf("state dir lock: %w", err)
	}
	if err := syscall.Flock(int(f.Fd()), syscall.LOCK_EX|syscall.LOCK_NB); err != nil {
		f.Close()
		return nil, fmt.Errorf("another daemon uses the state dir %s", dir)
	}
	return f, nil
}

func bootID() string {
	b, err := os.ReadFile("/proc/sys/kernel/random/boot_id")
	if err != nil {
		return ""
	}
	return strings.TrimSpace(string(b))
}
