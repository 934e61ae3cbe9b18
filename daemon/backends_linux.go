package daemon

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"maps"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/compat"
	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/internal/pause"
	"github.com/rewind-sandbox/rewind/internal/procfs"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/layer"
	"github.com/rewind-sandbox/rewind/policy"
	"github.com/rewind-sandbox/rewind/probe"
	"github.com/rewind-sandbox/rewind/sandbox"
	"github.com/rewind-sandbox/rewind/state"
)

// realBackends wires the FUSE file system (fs, layer), the sandbox process
// model (sandbox), process checkpoint/restore (cr), the effect probe
// (probe) and WASM policies (policy) into the state manager's interfaces.
func realBackends(ctx context.Context, cfg *Config, log *slog.Logger) (*backendSet, error) {
	if os.Geteuid() != 0 {
		return nil, errors.New("the daemon needs root (namespaces, FUSE, cgroups)")
	}
	dir := cfg.StateDir
	// Before anything waits on what a dead daemon's process may hold.
	abortStaleFUSE(filepath.Join(dir, "mnt"), log)
	var closers []func()
	fail := func(err error) (*backendSet, error) {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
		return nil, err
	}
	st, err := layer.OpenStore(filepath.Join(dir, "layers"))
	if err != nil {
		return fail(err)
	}
	hostRoot, err := bindHostRoot(filepath.Join(dir, "hostroot"))
	if err != nil {
		return fail(fmt.Errorf("host root: %w", err))
	}
	closers = append(closers, func() { unix.Unmount(hostRoot, unix.MNT_DETACH) })
	// --fs auto: native overlayfs where the state dir's file system can
	// hold its layers and a short self-test there shows it wins
	// (compat.DecideFS: the patched kernel's ioctl, or on a stock kernel a
	// reflink state dir whose measured turn beats FUSE's), FUSE otherwise.
	choice := compat.ChooseFS(st.Dir())
	log.Info("fs backend for --fs auto", "backend", choice.Backend, "reason", choice.Reason)
	fsb := &fsBackend{st: st, mnt: filepath.Join(dir, "mnt"), hostRoot: hostRoot, log: log, compactDepth: cfg.CompactDepth, auto: choice.Backend,
		lowerCache: fs.NewLowerCache()}
	if fsb.compactDepth == 0 {
		fsb.compactDepth = DefaultCompactDepth
	}
	fsb.startGC()
	closers = append(closers, fsb.stopGC)

	eng, err := cr.New(cr.Config{ImagesDir: filepath.Join(dir, "images"), CRIURunDir: filepath.Join(dir, "criu-run"), Warm: true, Logger: log,
		MaxTemplates: cfg.MaxTemplates, MaxTemplateBytes: cfg.MaxTemplateBytes, NoCollapse: cfg.NoHugePages})
	if err != nil {
		return fail(fmt.Errorf("cr: %w", err))
	}
	closers = append(closers, func() { eng.Close() })
	initPath, why, err := resolveInit(cfg.InitPath)
	if err != nil {
		return fail(err)
	}
	if why != "" {
		log.Warn("sandbox init: "+InitName+" beside the daemon is not used; the daemon's own binary is", "why", why)
	}
	log.Info("sandbox init", "path", initPath)
	pb := &procBackend{eng: eng, log: log, hide: hidden(*cfg), images: map[string]bool{}, fsb: fsb, initPath: initPath, memoryMax: cfg.MemoryMax, pidsMax: cfg.PidsMax}
	// Spares of a daemon that was killed left their cgroups.
	if n := sandbox.RemoveStaleSpares(spareIDPrefix, time.Minute); n > 0 {
		log.Info("removed the cgroups of spare inits left by an earlier daemon", "cgroups", n)
	}
	if cfg.SpareInits > 0 {
		pb.spares = sandbox.NewSpares(cfg.SpareInits, initPath, spareIDPrefix, log)
		closers = append(closers, pb.spares.Close)
	}
	// Checkpoints whose CRIU images survived the previous daemon (or host)
	// stay restorable: the engine re-registers them from ImagesDir.
	if cks, err := eng.LoadImages(); err != nil {
		log.Warn("process images from an earlier run not loaded", "err", err)
	} else {
		for _, ck := range cks {
			pb.images[ck.ID] = true
		}
		if len(cks) > 0 {
			log.Info("process images from an earlier run", "checkpoints", len(cks))
		}
	}

	be := &backendSet{fs: fsb, proc: pb, names: map[string]string{"fs": fsb.auto, "proc": "sandbox+cr"}}
	be.collectors = append(be.collectors,
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_template_pool_templates", Help: "Template processes held by the process checkpoint engine."},
			func() float64 { return float64(eng.Stats().Templates) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_template_pool_checkpoints", Help: "Process checkpoints held by the engine."},
			func() float64 { return float64(eng.Stats().Checkpoints) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_template_pool_private_dirty_bytes", Help: "Private dirty memory of templates and spares."},
			func() float64 { return float64(eng.Stats().PrivateDirty) }),
	)
	if p, err := probe.Open(probe.Options{Logger: log}); err != nil {
		log.Warn("no effect probe: auto turns take full checkpoints", "err", err)
		be.names["probe"] = "none"
	} else {
		closers = append(closers, func() { p.Close() })
		be.probe = &probeAdapter{p: p, eng: eng}
		be.names["probe"] = p.Backend()
	}
	h, err := policy.NewHost(ctx, policy.Options{CacheDir: filepath.Join(dir, "wasm-cache"), Logger: log})
	if err != nil {
		log.Warn("no policy host: auto turns take full checkpoints", "err", err)
		be.names["policy"] = "none"
	} else {
		closers = append(closers, func() { h.Close(context.Background()) })
		pl := &policyLoader{h: h, log: log, cache: map[string]*loadingPolicy{}}
		// The default policy compiles (or is read from the compilation
		// cache: 25-40 ms after a restart, 1.5-2 s the first time) while
		// the daemon starts, not in the first create's request.
		pl.preload(cfg.DefaultPolicy)
		closers = append(closers, pl.wait)
		be.policies = pl
		be.collectors = append(be.collectors, h.Collector())
		be.names["policy"] = "wasm"
	}
	be.close = func() {
		for i := len(closers) - 1; i >= 0; i-- {
			closers[i]()
		}
	}
	return be, nil
}

// mountStore mounts the state dir's image (rewind init-store) when the
// store config names this state dir and it is not mounted yet.
func mountStore(cfg Config, log *slog.Logger) error {
	path := cfg.StoreConfig
	if path == "" {
		path = kernelpath.DefaultStoreConfig
	}
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		return nil
	}
	sc, err := kernelpath.LoadStoreConfig(path)
	if err != nil {
		return err
	}
	if filepath.Clean(sc.StateDir) != cfg.StateDir {
		log.Debug("store config is for another state dir", "config", path, "state_dir", sc.StateDir)
		return nil
	}
	if err := kernelpath.EnsureStore(sc); err != nil {
		return fmt.Errorf("store config %s: %w", path, err)
	}
	log.Info("state dir on its store image", "state", cfg.StateDir, "image", sc.Image, "fs", sc.FS)
	return nil
}

// storeImage returns the file the state dir's file system is read from
// when it is a loop device's (`rewind init-store`, or any image an operator
// mounted there), else "".
func storeImage(stateDir string) string {
	var st unix.Stat_t
	if err := unix.Stat(stateDir, &st); err != nil {
		return ""
	}
	b, err := os.ReadFile(fmt.Sprintf("/sys/dev/block/%d:%d/loop/backing_file", unix.Major(st.Dev), unix.Minor(st.Dev)))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(strings.TrimSpace(string(b)), " (deleted)")
}

// bindHostRoot bind-mounts the host's root file system (not its submounts:
// no /proc, /sys, /dev, /run and no sandbox mounts, so a sandbox root built
// on it can never recurse into itself) read-only at dir.
func bindHostRoot(dir string) (string, error) {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return "", err
	}
	// A bind left by a daemon that died goes first (it may be stacked).
	for i := 0; i < 8 && unix.Unmount(dir, unix.MNT_DETACH) == nil; i++ {
	}
	if err := unix.Mount("/", dir, "", unix.MS_BIND, ""); err != nil {
		return "", fmt.Errorf("bind / on %s: %w", dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_BIND|unix.MS_REMOUNT|unix.MS_RDONLY, ""); err != nil {
		unix.Unmount(dir, unix.MNT_DETACH)
		return "", fmt.Errorf("read-only %s: %w", dir, err)
	}
	if err := unix.Mount("", dir, "", unix.MS_PRIVATE, ""); err != nil {
		unix.Unmount(dir, unix.MNT_DETACH)
		return "", fmt.Errorf("private %s: %w", dir, err)
	}
	return dir, nil
}

// fsBackend implements state.FSBackend with FUSE mounts over one layer store.
type fsBackend struct {
	st       *layer.Store
	mnt      string
	hostRoot string
	log      *slog.Logger
	// compactDepth: frozen layers that start a background compaction
	// (<= 0: never).
	compactDepth int
	// auto is the backend --fs auto means on this host ("fuse" or
	// "kernel", from compat.ChooseFS at daemon start).
	auto string
	// lowerCache is shared by every FUSE mount: they have the host's
	// root (read-only) and the base images as lowers in common.
	lowerCache *fs.LowerCache

	mu    sync.Mutex
	dirty bool
	stop  chan struct{}
	done  chan struct{}
	// views are the stock-kernel native mounts by mountpoint, for the
	// sandbox started on each (see fsMount.replaces).
	views map[string]*fsMount
}

func (b *fsBackend) lowers(spec state.FSSpec) []string {
	if len(spec.Bases) == 0 {
		return []string{b.hostRoot}
	}
	l := slices.Clone(spec.Bases)
	slices.Reverse(l) // the layer store wants topmost first
	return l
}

func (b *fsBackend) mount(id string, spec state.FSSpec, from string) (m state.FSMount, err error) {
	mp := filepath.Join(b.mnt, id)
	if err := os.MkdirAll(mp, 0o700); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			// A failed create or fork child leaves no mount point (nothing
			// is mounted on it; a non-empty one stays).
			_ = os.Remove(mp)
		}
	}()
	// A record left by a dead daemon is replaced: the sandbox comes back
	// from a checkpoint, not from its last upper.
	kernel := b.ResolveKind(spec.Kind) == "kernel"
	if kernel {
		// An overlay on the sandbox's own mount point is a dead daemon's:
		// this one holds the state dir's lock. Its record may be gone
		// already (removed below by a daemon that then died too), so it
		// is detached here rather than by the record (kernelpath.Mount).
		if err := unix.Unmount(mp, unix.MNT_DETACH); err == nil {
			b.log.Warn("detached an overlay a dead daemon left on a sandbox's mount point", "sandbox", id, "mountpoint", mp)
		}
	}
	if _, err := b.st.Mount(id); err == nil {
		b.st.RemoveMount(id)
	}
	if kernel {
		return b.mountKernel(id, mp, spec, from)
	}
	// A sandbox's mount is unmounted once its processes are dead: what
	// still holds the connection then is a copy of the mount in a mount
	// namespace made elsewhere on the host meanwhile.
	opts := fs.Options{MountID: id, From: from, Lowers: b.lowers(spec), LowerCache: b.lowerCache, NoOpen: true, Logger: b.log, UnmountGrace: sandboxUnmountGrace}
	if from != "" {
		opts.MaxIO = forkMaxIO
	}
	f, err := fs.Mount(b.st, mp, opts)
	if err != nil {
		return nil, err
	}
	return &fsMount{f: f, b: b}, nil
}

// mountKernel mounts the native overlayfs path. A sandbox's processes see
// its root through their own mount namespace, so a switch must reach it:
// the patched kernel's switch ioctl changes the mounted overlay in place;
// on a stock kernel Switch mounts a new overlay over the target stack and
// makes it the root of the sandbox's mount namespace (fsMount.Switch),
// and every restore re-creates the processes on it (the template-forked
// copies re-enter their working directory and files by path, CRIU opens
// everything by path).
func (b *fsBackend) mountKernel(id, mp string, spec state.FSSpec, from string) (state.FSMount, error) {
	lowers := b.lowers(spec)
	if err := b.layersOutside(lowers); err != nil {
		return nil, err
	}
	f, err := kernelpath.Mount(b.st, mp, kernelpath.Options{MountID: id, From: from, Lowers: lowers, Logger: b.log})
	if err != nil {
		return nil, err
	}
	m := &fsMount{f: f, b: b, replaces: f.FreezeMode() != kernelpath.FreezeIoctl}
	if m.replaces {
		b.mu.Lock()
		if b.views == nil {
			b.views = map[string]*fsMount{}
		}
		b.views[f.Mountpoint()] = m
		b.mu.Unlock()
	}
	return m, nil
}

// layersOutside checks that the layer store is not inside one of the
// base directories: overlayfs refuses a layer inside another (ELOOP) as
// soon as a frozen layer joins the stack. The host root base is a
// non-recursive bind of /, so a state dir on its own file system (rewind
// init-store) is outside it.
func (b *fsBackend) layersOutside(lowers []string) error {
	dir := b.st.Dir()
	var st unix.Stat_t
	if err := unix.Stat(dir, &st); err != nil {
		return fmt.Errorf("--fs kernel: state dir: %w", err)
	}
	for _, l := range lowers {
		src := l
		if l == b.hostRoot {
			src = "/"
		}
		var ls unix.Stat_t
		if err := unix.Stat(l, &ls); err != nil {
			return fmt.Errorf("--fs kernel: base %s: %w", l, err)
		}
		if ls.Dev == st.Dev && (src == "/" || strings.HasPrefix(dir, strings.TrimRight(src, "/")+"/")) {
			// The request cannot succeed on this daemon: the caller's
			// choice of backend, not a fault (400, not 500).
			return &state.Error{Code: state.CodeBadRequest, Msg: fmt.Sprintf("--fs kernel: the state dir %s is inside the sandbox's base %s on the same file system, and overlayfs refuses a layer inside another: put the state dir on its own file system (rewind init-store) or use --fs fuse", dir, src)}
		}
	}
	return nil
}

// replacingView returns the stock-kernel native mount whose mountpoint is
// root, if any.
func (b *fsBackend) replacingView(root string) *fsMount {
	b.mu.Lock()
	defer b.mu.Unlock()
	return b.views[root]
}

// ResolveKind implements state.FSKindResolver: "auto" (or "") is the
// backend chosen at daemon start.
func (b *fsBackend) ResolveKind(kind string) string {
	if kind == "" || kind == "auto" {
		if b.auto == "" {
			return "fuse"
		}
		return b.auto
	}
	return kind
}

func (b *fsBackend) Mount(_ context.Context, id string, spec state.FSSpec) (state.FSMount, error) {
	return b.mount(id, spec, "")
}

// forkMaxIO is fs.Options.MaxIO for the mounts of sandboxes made from a
// checkpoint (fork children, many made at once): a quarter of the
// default. Each such mount reads its base image into a page cache of its
// own and keeps go-fuse's request buffers of this size per reader; with
// 256 KiB a first fork of 16 of a bash checkpoint took 6% less time and
// CPU than with 1 MiB on this project's 2-core VM (1045 against 1116 ms,
// medians of five alternating runs; the daemon read 1.5 MiB per child
// instead of 3.2 and its resident size after the fork was 84-90 MiB
// instead of 104-113).
const forkMaxIO = 256 << 10

// sandboxUnmountGrace is fs.Options.UnmountGrace for sandbox mounts.
const sandboxUnmountGrace = 2 * time.Second

func (b *fsBackend) MountFrom(_ context.Context, id string, spec state.FSSpec, ckpt string) (state.FSMount, error) {
	return b.mount(id, spec, ckpt)
}

func (b *fsBackend) Delete(_ context.Context, ckpt string) error {
	if err := b.st.DeleteCheckpoint(ckpt); err != nil && !errors.Is(err, layer.ErrNotFound) {
		return err
	}
	b.mu.Lock()
	b.dirty = true
	b.mu.Unlock()
	return nil
}

// AwaitCheckpoint implements state.FSWaiter: a kernel-path checkpoint's
// layer and record are written after its freeze window.
func (b *fsBackend) AwaitCheckpoint(_ context.Context, ckpt string) error {
	return b.st.AwaitCheckpoint(ckpt)
}

// Lost implements state.FSChecker: a checkpoint with neither a record nor
// a journal entry (a kernel-path checkpoint whose layer was still being
// written when the previous daemon died), or deleted.
func (b *fsBackend) Lost(_ context.Context, ckpt string) bool {
	if _, err := b.st.Record(ckpt); err == nil || !errors.Is(err, layer.ErrNotFound) {
		return false
	}
	_, err := b.st.Checkpoint(ckpt) // the FUSE back end's journals
	return errors.Is(err, layer.ErrNotFound)
}

// Size implements state.FSSizer: the bytes of the layer fs checkpoint ckpt
// froze (0 when it froze none: nothing had changed since its parent).
//
// It reads materialized records only (a journal scan costs more with every
// checkpoint): the FUSE back end writes a checkpoint's record in the
// background within milliseconds, so Size waits for it a little.
func (b *fsBackend) Size(ctx context.Context, ckpt string) (int64, error) {
	var c layer.Checkpoint
	var err error
	for wait := time.Millisecond; ; wait *= 2 {
		if c, err = b.st.Record(ckpt); err == nil || !errors.Is(err, layer.ErrNotFound) || wait > time.Second {
			break
		}
		select {
		case <-ctx.Done():
			return 0, ctx.Err()
		case <-time.After(wait):
		}
	}
	if err != nil {
		return 0, err
	}
	if len(c.Layers) == 0 {
		return 0, nil
	}
	top := c.Layers[len(c.Layers)-1]
	if c.Parent != "" {
		if p, err := b.st.Record(c.Parent); err == nil && len(p.Layers) > 0 && p.Layers[len(p.Layers)-1] == top {
			return 0, nil
		}
	}
	return layer.DirSize(b.st.LayerPath(top))
}

// startGC frees unreferenced layers in the background after deletions.
func (b *fsBackend) startGC() {
	b.stop, b.done = make(chan struct{}), make(chan struct{})
	go func() {
		defer close(b.done)
		t := time.NewTicker(5 * time.Second)
		defer t.Stop()
		const minAge = time.Minute
		// again: a GC a deletion asked for keeps the layers younger than
		// minAge, which nothing may ask to free later: one more GC runs
		// once they are old enough.
		var again time.Time
		for {
			select {
			case <-b.stop:
				return
			case <-t.C:
			}
			b.mu.Lock()
			d := b.dirty
			b.dirty = false
			b.mu.Unlock()
			switch {
			case d:
				again = time.Now().Add(minAge)
			case !again.IsZero() && time.Now().After(again):
				d, again = true, time.Time{}
			}
			if d {
				if ids, err := b.st.GC(minAge); err != nil {
					b.log.Warn("layer gc", "err", err)
				} else if len(ids) > 0 {
					b.log.Info("layer gc", "freed_layers", len(ids))
				}
			}
		}
	}()
}

func (b *fsBackend) stopGC() {
	close(b.stop)
	<-b.done
}

func (b *fsBackend) Cleanup(_ context.Context, id string) error {
	mp := filepath.Join(b.mnt, id)
	// Every mount stacked there (a kernel-path view may sit beneath
	// another), until none is left.
	for i := 0; ; i++ {
		err := unix.Unmount(mp, unix.MNT_DETACH)
		if errors.Is(err, unix.EINVAL) || errors.Is(err, unix.ENOENT) {
			break
		}
		if err != nil {
			return fmt.Errorf("unmount stale %s: %w", mp, err)
		}
		if i == 64 {
			return fmt.Errorf("unmount stale %s: still mounted after %d unmounts", mp, i+1)
		}
	}
	if err := os.Remove(mp); err != nil && !errors.Is(err, os.ErrNotExist) {
		b.log.Debug("remove stale mount point", "path", mp, "err", err)
	}
	if _, err := b.st.Mount(id); err == nil {
		return b.st.RemoveMount(id)
	}
	return nil
}

// Leftovers implements state.LeftoverLister: the sandboxes with a mount
// point under STATE/mnt or a mount record in the layer store.
func (b *fsBackend) Leftovers(context.Context) ([]string, error) {
	seen := map[string]bool{}
	var ids []string
	add := func(id string) {
		if !seen[id] {
			seen[id] = true
			ids = append(ids, id)
		}
	}
	ents, err := os.ReadDir(b.mnt)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("list mount points: %w", err)
	}
	for _, e := range ents {
		add(e.Name())
	}
	recs, err := b.st.Mounts()
	if err != nil {
		return nil, fmt.Errorf("list mount records: %w", err)
	}
	for _, r := range recs {
		add(r.ID)
	}
	return ids, nil
}

type fsMount struct {
	f layer.FS
	b *fsBackend
	// replaces: a stock-kernel native overlay, whose Switch replaces the
	// mount rather than its content; the switch then also replaces the
	// root of the mount namespace of sb, the sandbox started on it.
	replaces bool
	sbMu     sync.Mutex
	sb       *sandbox.Sandbox

	compacting atomic.Bool
	wg         sync.WaitGroup // a running compaction

	// flushFD is a descriptor of the FUSE mount's root for Flush (-1
	// before the first, and after Unmount), kept open so that a flush
	// costs no OPENDIR; flushMu guards it.
	flushMu sync.Mutex
	flushFD int
	flushed bool // flushFD was opened (or Unmount ran)
}

// Flush implements state.FSFlusher for the FUSE overlay (syncfs): its
// page cache's only dirty pages are those of shared file mappings (FUSE
// writes through: no writeback cache), and when none is dirty the flush
// is one system call. The kernel path's mounts are left alone: a stock
// kernel's switch replaces the view (the old processes' pages go to the
// old one).
func (m *fsMount) Flush(ctx context.Context) error {
	if _, ok := m.f.(*fs.FS); !ok || m.replaces {
		return nil
	}
	m.flushMu.Lock()
	defer m.flushMu.Unlock()
	if !m.flushed {
		fd, err := unix.Open(m.f.Mountpoint(), unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("flush %s: %w", m.f.MountID(), err)
		}
		m.flushFD, m.flushed = fd, true
	}
	if m.flushFD < 0 {
		return nil // unmounted
	}
	if err := unix.Syncfs(m.flushFD); err != nil {
		return fmt.Errorf("flush %s: %w", m.f.MountID(), err)
	}
	// syncfs does not wait for a FUSE mount's write-back (fs.WaitIdle).
	// A request that stays in flight (a lock wait of a process that is
	// not one of the killed) must not fail the restore: the wait is
	// bounded and its end is not an error.
	wctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	if err := m.f.(*fs.FS).WaitIdle(wctx); err != nil && !errors.Is(err, context.DeadlineExceeded) {
		return fmt.Errorf("flush %s: %w", m.f.MountID(), err)
	}
	return nil
}

// depther is implemented by back ends whose stack depth grows: with every
// checkpoint (the FUSE path), with every restore (the kernel path, which
// merges its own delta chains but stacks a new one per switch).
type depther interface{ Depth() int }

func (m *fsMount) Root() string { return m.f.Mountpoint() }

func (m *fsMount) Checkpoint(context.Context) (string, int64, error) {
	id, err := m.f.Checkpoint()
	if err == nil {
		m.maybeCompact()
	}
	return id, 0, err
}

// maybeCompact merges the mount's frozen layers into one in the background
// once the stack is compactDepth deep, one compaction at a time per mount.
// It runs outside the sandbox's freeze window; the view and every
// checkpoint keep their content, so the sandbox never waits for it.
func (m *fsMount) maybeCompact() {
	d, ok := m.f.(depther)
	if !ok || m.b.compactDepth <= 0 || d.Depth() < m.b.compactDepth || !m.compacting.CompareAndSwap(false, true) {
		return
	}
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		defer m.compacting.Store(false)
		start, before := time.Now(), d.Depth()
		if err := m.f.Compact(); err != nil {
			m.b.log.Warn("compaction", "mount", m.f.MountID(), "depth", before, "err", err)
			return
		}
		m.b.log.Info("compacted", "mount", m.f.MountID(), "depth_before", before, "depth_after", d.Depth(), "took", time.Since(start))
	}()
}

func (m *fsMount) Switch(_ context.Context, ckpt string) error {
	if err := m.f.Switch(ckpt); err != nil {
		return err
	}
	if !m.replaces {
		return nil
	}
	m.sbMu.Lock()
	sb := m.sb
	m.sbMu.Unlock()
	if sb == nil {
		return nil
	}
	// The daemon's mount point shows the new overlay now: a clone of it
	// becomes the sandbox's root.
	mfd, err := unix.OpenTree(unix.AT_FDCWD, m.f.Mountpoint(), unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("switch %s: clone the new view: %w", m.f.MountID(), err)
	}
	defer unix.Close(mfd)
	if err := sb.ReplaceRoot(mfd); err != nil {
		return fmt.Errorf("switch %s: %w", m.f.MountID(), err)
	}
	return nil
}

// ReplacesView implements state.ViewReplacer: a stock-kernel native
// overlay's switch leaves running processes on the old view.
func (m *fsMount) ReplacesView() bool { return m.replaces }

// setSandbox records (or, with nil, forgets) the sandbox whose root the
// mount is.
func (m *fsMount) setSandbox(sb *sandbox.Sandbox) {
	m.sbMu.Lock()
	m.sb = sb
	m.sbMu.Unlock()
}

func (m *fsMount) Unmount() error {
	m.wg.Wait()
	m.flushMu.Lock()
	if m.flushed && m.flushFD >= 0 {
		unix.Close(m.flushFD) // or the unmount finds the mount busy
	}
	m.flushFD, m.flushed = -1, true
	m.flushMu.Unlock()
	if m.replaces {
		m.b.mu.Lock()
		if m.b.views[m.f.Mountpoint()] == m {
			delete(m.b.views, m.f.Mountpoint())
		}
		m.b.mu.Unlock()
		m.setSandbox(nil)
	}
	err := m.f.Unmount()
	os.Remove(m.f.Mountpoint())
	return err
}

// procBackend implements state.ProcBackend with sandbox and cr.
type procBackend struct {
	eng    *cr.Engine
	log    *slog.Logger
	hide   []string
	images map[string]bool // cr checkpoints re-registered from disk at start
	fsb    *fsBackend      // for the stock-kernel native mounts (nil in tests)
	spares *sandbox.Spares // inits started ahead (nil: none)
	// initPath is the sandboxes' init binary ("": the daemon's own).
	initPath string
	// memoryMax and pidsMax are every sandbox's limits (Config.MemoryMax,
	// Config.PidsMax).
	memoryMax int64
	pidsMax   int

	digestMu sync.Mutex
	digests  map[tmplKey]string // shell digests of templates (see templateDigest)
}

// tmplKey names one template: a cr checkpoint and the pid its process had.
type tmplKey struct {
	ck   string
	orig int
}

func (b *procBackend) Start(ctx context.Context, id, root string) (state.ProcSandbox, error) {
	return b.start(ctx, sandbox.Config{ID: id, Root: root, Hide: b.hide, Logger: b.log, InitPath: b.initPath, MemoryMax: b.memoryMax, PidsMax: b.pidsMax})
}

// StartFor implements state.ProcStarterFor: the new sandbox's init moves
// its pid counter past the pids of part's image while it sets up, so the
// restore of part through that image starts no process in the sandbox to
// do it (cr.PIDCounterTaker).
func (b *procBackend) StartFor(ctx context.Context, id, root string, part *state.ProcPart) (state.ProcSandbox, error) {
	cfg := sandbox.Config{ID: id, Root: root, Hide: b.hide, Logger: b.log, InitPath: b.initPath, MemoryMax: b.memoryMax, PidsMax: b.pidsMax}
	if ck := part.Data["cr"]; ck != "" {
		if top, err := b.eng.ImageTopPID(ck); err == nil {
			cfg.PIDCounterMin = top
		}
	}
	return b.start(ctx, cfg)
}

func (b *procBackend) start(ctx context.Context, cfg sandbox.Config) (state.ProcSandbox, error) {
	var sb *sandbox.Sandbox
	var err error
	if b.spares != nil {
		sb, err = b.spares.Start(ctx, cfg)
	} else {
		sb, err = sandbox.Start(ctx, cfg)
	}
	if err != nil {
		return nil, err
	}
	ps := &procSandbox{b: b, sb: sb, ckpts: map[string]bool{}}
	if b.fsb != nil {
		if m := b.fsb.replacingView(sb.Root()); m != nil {
			m.setSandbox(sb)
			ps.view = m
		}
	}
	return ps, nil
}

func (b *procBackend) Release(_ context.Context, part *state.ProcPart) error {
	if id := part.Data["cr"]; id != "" {
		b.eng.Drop(id)
		b.forgetDigests(id)
	}
	return nil
}

// templateDigest returns the shell digest (digest and $?) of the template
// of process orig in cr checkpoint ck, computed once: a template never
// runs, so its state never changes.
func (b *procBackend) templateDigest(ctx context.Context, ck string, orig int) (string, error) {
	k := tmplKey{ck, orig}
	b.digestMu.Lock()
	d, ok := b.digests[k]
	b.digestMu.Unlock()
	if ok {
		return d, nil
	}
	st, err := b.eng.TemplateShellDigest(ctx, ck, orig)
	if err != nil {
		return "", err
	}
	d = st.Digest + " " + strconv.Itoa(st.Status)
	b.digestMu.Lock()
	if b.digests == nil {
		b.digests = map[tmplKey]string{}
	}
	b.digests[k] = d
	b.digestMu.Unlock()
	return d, nil
}

func (b *procBackend) forgetDigests(ck string) {
	b.digestMu.Lock()
	defer b.digestMu.Unlock()
	for k := range b.digests {
		if k.ck == ck {
			delete(b.digests, k)
		}
	}
}

// TemplateUsage implements state.ProcMeter.
func (b *procBackend) TemplateUsage(parts []*state.ProcPart) (int, int64) {
	var ids []string
	for _, p := range parts {
		if id := p.Data["cr"]; id != "" {
			ids = append(ids, id)
		}
	}
	return b.eng.TemplateUsage(ids)
}

// Recover: templates die with the daemon; a part with no processes needs
// nothing to come back, and a part whose image the engine re-registered
// from disk comes back through CRIU.
func (b *procBackend) Recover(_ context.Context, part *state.ProcPart) *state.ProcPart {
	np := *part
	np.TemplateReady = false
	np.ImageReady = part.Data["mode"] == string(cr.ModeEmpty) || b.images[part.Data["cr"]]
	return &np
}

// Cleanup kills what a dead daemon left in sandbox id's cgroups.
func (b *procBackend) Cleanup(_ context.Context, id string) error {
	return sandbox.CleanupStale(id)
}

type procSandbox struct {
	b  *procBackend
	sb *sandbox.Sandbox
	// view is the stock-kernel native mount the sandbox runs on (nil
	// otherwise): its switches replace the sandbox's root, so restored
	// copies must move onto it (cr.RestoreOptions.Reroot).
	view *fsMount

	mu    sync.Mutex
	ckpts map[string]bool // cr checkpoints taken here
	// restored, when restoredOK, are the pids of the processes the last
	// restore left alive (every one of the agent's: it killed the rest;
	// cr.RestoreResult.Live), or that the last checkpoint took (not an undo point or a
	// parked one), for the probe window opened next (takeRestored). A
	// probe window's End and Watch forget them.
	restored   []int
	restoredOK bool
	// origin maps each live process the daemon knows the origin of to
	// the cr checkpoint process it is (the one checkpointed last) or was
	// restored from.
	origin map[int]procOrigin
}

// procOrigin is where a live process comes from: process orig of cr
// checkpoint ck. start is the live process's start time, so that a reused
// pid is never taken for it.
type procOrigin struct {
	ck    string
	orig  int
	start string
}

// procStart returns field 22 of /proc/pid/stat (the start time in ticks).
func procStart(pid int) string {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "stat"))
	if err != nil {
		return ""
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return ""
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return ""
	}
	return f[19]
}

// setOrigins records the origin of the live processes after a checkpoint
// or a restore (pairs of live pid and checkpointed pid).
func (p *procSandbox) setOrigins(ck string, pairs [][2]int) {
	o := make(map[int]procOrigin, len(pairs))
	for _, pr := range pairs {
		if st := procStart(pr[0]); st != "" {
			o[pr[0]] = procOrigin{ck: ck, orig: pr[1], start: st}
		}
	}
	p.mu.Lock()
	p.origin = o
	p.mu.Unlock()
}

// shellDigest digests live shell pid, waiting a little for a shell that is
// busy: the session's answer is read as soon as the shell has written it,
// when the shell may not have returned to reading its next command yet.
func (p *procSandbox) shellDigest(ctx context.Context, pid int) (*cr.ShellState, error) {
	deadline := time.Now().Add(50 * time.Millisecond)
	for wait := 100 * time.Microsecond; ; wait = min(2*wait, 5*time.Millisecond) {
		st, err := p.b.eng.ShellDigest(ctx, p.sb, pid)
		if err == nil || !errors.Is(err, cr.ErrShellBusy) || time.Now().After(deadline) {
			return st, err
		}
		time.Sleep(wait)
	}
}

// Unchanged implements state.UnchangedChecker for sandboxes whose every
// process is a persistent bash: each live process must be the one the
// part's template of it was taken from, or a restored copy of that
// template (same start time since), the part must have no template left
// without its live process, and each shell's state digest and $? (see
// cr.Engine.ShellDigest) must equal its template's. Any other process, a
// busy shell or any error says no.
func (p *procSandbox) Unchanged(ctx context.Context, part *state.ProcPart) (bool, string) {
	ck := part.Data["cr"]
	if part.Data["mode"] != string(cr.ModeTemplate) || ck == "" {
		return false, "the part has no templates"
	}
	rec, err := p.b.eng.Record(ck)
	if err != nil {
		return false, err.Error()
	}
	live, err := p.b.eng.Processes(p.sb)
	if err != nil {
		return false, err.Error()
	}
	if len(live) != len(rec.Procs) {
		return false, fmt.Sprintf("%d live processes, %d in the part", len(live), len(rec.Procs))
	}
	want := map[int]bool{}
	for _, pr := range rec.Procs {
		want[pr.PID] = true
	}
	p.mu.Lock()
	origin := maps.Clone(p.origin)
	p.mu.Unlock()
	for _, lp := range live {
		o, ok := origin[lp.PID]
		if !ok || o.ck != ck || !want[o.orig] || o.start != procStart(lp.PID) {
			return false, fmt.Sprintf("process %d (%s) is not from the part", lp.PID, lp.Comm)
		}
		delete(want, o.orig)
	}
	for _, lp := range live {
		o := origin[lp.PID]
		td, err := p.b.templateDigest(ctx, ck, o.orig)
		if err != nil {
			return false, err.Error()
		}
		st, err := p.shellDigest(ctx, lp.PID)
		if err != nil {
			return false, err.Error()
		}
		if st.Digest+" "+strconv.Itoa(st.Status) != td {
			return false, fmt.Sprintf("the state of shell %d changed", lp.PID)
		}
	}
	return true, fmt.Sprintf("%d shell digests equal", len(live))
}

// cachedDigest returns the template digest of process orig of cr
// checkpoint ck if it was computed before: a restore's critical path does
// not run a shell copy to find it out.
func (b *procBackend) cachedDigest(ck string, orig int) (string, bool) {
	b.digestMu.Lock()
	defer b.digestMu.Unlock()
	d, ok := b.digests[tmplKey{ck, orig}]
	return d, ok
}

// AdoptPart implements state.PartAdopter for a sandbox whose one process
// is a persistent bash, known by the caller to be in the state of part
// from: it holds when to also holds one process, a template of a bash
// attached to the same session, and both templates' shell digests and $?
// (computed earlier, see templateDigest) are equal — the state the harness
// can observe of the shell (variables, functions, options, traps, jobs,
// cwd, umask, descriptors, limits) is then the same in from, to and the
// live shell. The live shell is then recorded as to's process, so later
// checkpoints can share to's part (Unchanged). Any doubt is a "no".
func (p *procSandbox) AdoptPart(ctx context.Context, from, to *state.ProcPart) (bool, string) {
	fck, fp, fsid, why := p.shellPart(from)
	if why != "" {
		return false, why
	}
	tck, tp, tsid, why := p.shellPart(to)
	if why != "" {
		return false, why
	}
	if fsid != tsid {
		return false, "the parts' shells belong to different sessions"
	}
	fd, ok1 := p.b.cachedDigest(fck, fp.PID)
	td, ok2 := p.b.cachedDigest(tck, tp.PID)
	if !ok1 || !ok2 {
		return false, "a template's digest is not known yet"
	}
	if fd != td {
		return false, "the shells' states differ"
	}
	live, err := p.b.eng.Processes(p.sb)
	if err != nil {
		return false, err.Error()
	}
	if len(live) != 1 {
		return false, fmt.Sprintf("%d live processes", len(live))
	}
	lp := live[0].PID
	p.mu.Lock()
	o, ok := p.origin[lp]
	p.mu.Unlock()
	if !ok || o.ck != fck || o.orig != fp.PID || o.start != procStart(lp) {
		return false, fmt.Sprintf("process %d is not from the part", lp)
	}
	if !p.ownSession(fsid, lp) {
		return false, "the live shell is not its session's process"
	}
	p.setOrigins(tck, [][2]int{{lp, tp.PID}})
	return true, "shell digests equal"
}

func (p *procSandbox) Exec(ctx context.Context, req state.ExecRequest) (int, error) {
	code, err := p.sb.Exec(ctx, sandbox.ExecRequest{Argv: req.Argv, Env: req.Env, Dir: req.Dir, Stdin: req.Stdin, Stdout: req.Stdout, Stderr: req.Stderr})
	return code, badCommand(err)
}

func (p *procSandbox) StartSession(ctx context.Context, id string, argv, env []string) error {
	_, err := p.sb.StartSession(ctx, sandbox.SessionConfig{ID: id, Argv: argv, Env: env})
	return badCommand(err)
}

// badCommand makes a command that cannot start as given (a program or a
// working directory the sandbox does not have) the caller's mistake, a bad
// request, rather than a failure of the daemon.
func badCommand(err error) error {
	if errors.Is(err, sandbox.ErrBadCommand) {
		return &state.Error{Code: state.CodeBadRequest, Msg: err.Error()}
	}
	return err
}

func (p *procSandbox) Send(ctx context.Context, req state.SendRequest) (state.SendAnswer, error) {
	ss := p.sb.Session(req.Session)
	if ss == nil {
		return state.SendAnswer{}, &state.Error{Code: state.CodeNotFound, Msg: "no session " + strconv.Quote(req.Session)}
	}
	opts := sandbox.SendOptions{Idle: req.Idle}
	if req.Until != "" {
		re, err := regexp.Compile(req.Until)
		if err != nil {
			return state.SendAnswer{}, err
		}
		opts.Until = re
	}
	sctx := ctx
	if req.Timeout > 0 {
		var cancel context.CancelFunc
		sctx, cancel = context.WithTimeout(ctx, req.Timeout)
		defer cancel()
	}
	ans, err := ss.SendAnswer(sctx, req.Text, opts)
	a := state.SendAnswer{Output: ans.Output}
	switch {
	case errors.Is(err, context.DeadlineExceeded) && ctx.Err() == nil:
		// The answer so far; the process is still busy.
		a.Ended, err = state.EndedTimeout, nil
	case err != nil:
	case ans.Matched:
		a.Ended = state.EndedUntil
	case exited(ss):
		a.Ended = state.EndedExit
		code := ss.ExitCode()
		a.Exit = &code
	default:
		a.Ended = state.EndedIdle
	}
	return a, err
}

// exited reports whether the session's process has exited, waiting a
// moment for its status: the end of its output (its pipe's close) can
// come just before the init reports the exit.
func exited(ss *sandbox.Session) bool {
	select {
	case <-ss.Done():
		return true
	default:
	}
	if !ss.OutputClosed() {
		return false
	}
	t := time.NewTimer(time.Second)
	defer t.Stop()
	select {
	case <-ss.Done():
		return true
	case <-t.C:
		return false
	}
}

func (p *procSandbox) WriteRunFile(name string, data []byte) error {
	return p.sb.WriteRunFile(name, data)
}

// StopSession implements state.SessionStopper.
func (p *procSandbox) StopSession(_ context.Context, id string) error {
	ss := p.sb.Session(id)
	if ss == nil {
		return fmt.Errorf("no session %s", id)
	}
	return ss.Close()
}

func (p *procSandbox) Sessions() []string {
	var ids []string
	for _, s := range p.sb.Sessions() {
		select {
		case <-s.Done():
		default:
			ids = append(ids, s.ID())
		}
	}
	return ids
}

func newCRID() string {
	var b [6]byte
	rand.Read(b[:])
	return "p-" + hex.EncodeToString(b[:])
}

func (p *procSandbox) Checkpoint(ctx context.Context, barrier func() error) (*state.ProcPart, error) {
	return p.checkpoint(ctx, barrier, false, false)
}

// CheckpointUndo implements state.UndoCheckpointer: no image and no warm
// spare (the undo point of a restore is dropped, or restored, as soon as
// the restore ends), and, when the restore goes to target without needing
// the live processes' pids (canPark), the live processes themselves,
// stopped (cr.ModeParked), for any process tree: no template fork and no
// CRIU dump of a tree.
func (p *procSandbox) CheckpointUndo(ctx context.Context, target *state.ProcPart, barrier func() error) (*state.ProcPart, error) {
	park := p.canPark(target)
	if !park && target != nil {
		// The undo point's templates, forked now, must not take a pid
		// the target's image recreates (a restore from the image
		// would fail on them). The target may be a checkpoint an
		// earlier daemon took, of the sandbox as it was then.
		if id := target.Data["cr"]; id != "" {
			if err := p.b.eng.MakeRoomForImage(p.sb, id); err != nil {
				p.b.log.Debug("make room for an image's pids", "checkpoint", id, "err", err)
			}
		}
	}
	return p.checkpoint(ctx, barrier, true, park)
}

// NeedsExactPids implements state.ExactPidsRestorer: a restore of part
// goes through its CRIU image.
func (p *procSandbox) NeedsExactPids(part *state.ProcPart) bool {
	id := part.Data["cr"]
	return id != "" && p.b.eng.RestoresFromImage(p.sb, id)
}

// canPark reports whether a restore to target leaves the pids of the
// sandbox's processes alone, so they can be parked meanwhile: target is a
// checkpoint of this sandbox that restores from its templates (or holds
// no processes), or from its image when no process of the sandbox holds a
// pid the image recreates (cr.Engine.ImagePidsFree: a CRIU restore needs
// exact pids; the live processes of a later branch rarely hold them, the
// ones just checkpointed always do). An empty part of another sandbox
// kills through the sandbox, which knows nothing parked.
// On a stock-kernel native mount (view) a switch replaces the root mount:
// parked processes resumed after a second switch would run on the first
// mount, detached, so they are never parked there.
func (p *procSandbox) canPark(target *state.ProcPart) bool {
	if target == nil || p.view != nil {
		return false
	}
	id := target.Data["cr"]
	p.mu.Lock()
	mine := p.ckpts[id]
	p.mu.Unlock()
	if !mine {
		return false
	}
	switch cr.Mode(target.Data["mode"]) {
	case cr.ModeEmpty:
		return true
	case cr.ModeTemplate, cr.ModeCRIU:
		parts, err := p.b.eng.Parts(id)
		if err != nil {
			return false
		}
		if parts.Template {
			return true
		}
		// A shell with a background job (a tree: a CRIU checkpoint),
		// restored to from a later branch: the restore's undo point
		// took 3.8-4.7 ms parked against 84-99 ms as a CRIU dump, the
		// whole restore 92-103 against 185-201 ms p50.
		return parts.Image && p.b.eng.ImagePidsFree(p.sb, id)
	}
	return false
}

func (p *procSandbox) checkpoint(ctx context.Context, barrier func() error, undo, park bool) (*state.ProcPart, error) {
	// Which session each process serves, to give restored copies their
	// session's stdio back.
	sessions := map[string]string{}
	var shells []int
	for _, s := range p.sb.Sessions() {
		if pid := s.PID(); pid > 0 {
			sessions[strconv.Itoa(pid)] = s.ID()
			shells = append(shells, pid)
		}
	}
	// A session's answer is read as soon as its process has written it,
	// maybe before it is back in its read of the next command: give it a
	// moment, so the checkpoint holds it waiting (and a shell's template
	// can be asked for its state), not in the middle of that write.
	settle(shells, settleTimeout)
	id := newCRID()
	ck, err := p.b.eng.Checkpoint(ctx, p.sb, cr.CheckpointOptions{ID: id, Barrier: barrier, Ephemeral: undo, Park: park})
	if err != nil {
		return nil, err
	}
	if ck.Mode != cr.ModeParked {
		// The processes were stopped for their templates: let the shells
		// get back into their read before the next probe window opens.
		// (Parked ones stay stopped.)
		settle(shells, settleTimeout)
	}
	p.mu.Lock()
	p.ckpts[id] = true
	if ck.Mode != cr.ModeParked && !undo {
		// These are all of the agent's processes, as checkpointed
		// (templates of each, or a CRIU dump of every tree, or none):
		// the next probe window starts from them (takeRestored) rather
		// than from a listing of the cgroup, so a process one of them
		// started after it resumed is new in that window instead of
		// hiding in its first snapshot. Parked processes stay stopped.
		live := make([]int, 0, len(ck.Procs))
		for _, pr := range ck.Procs {
			live = append(live, pr.PID)
		}
		p.restored, p.restoredOK = live, true
	}
	p.mu.Unlock()
	if !undo {
		pairs := make([][2]int, 0, len(ck.Procs))
		for _, pr := range ck.Procs {
			pairs = append(pairs, [2]int{pr.PID, pr.PID})
		}
		p.setOrigins(id, pairs)
	}
	sj, _ := json.Marshal(sessions)
	part := &state.ProcPart{
		Templates: []string{id}, Processes: len(ck.Procs), FrozenUS: ck.Frozen.Microseconds(),
		Data: map[string]string{"cr": id, "mode": string(ck.Mode), "reason": ck.Reason, "sessions": string(sj)},
	}
	p.fillParts(part)
	return part, nil
}

// shellPart returns the cr checkpoint, the one process and the session of
// a template part of one process that serves a session (a shell the live
// one can be compared with), or why part is not one.
func (p *procSandbox) shellPart(part *state.ProcPart) (ck string, pr cr.Proc, sid string, why string) {
	ck = part.Data["cr"]
	if part.Data["mode"] != string(cr.ModeTemplate) || ck == "" {
		return "", pr, "", "a part has no templates"
	}
	rec, err := p.b.eng.Record(ck)
	if err != nil {
		return "", pr, "", err.Error()
	}
	if len(rec.Procs) != 1 {
		return "", pr, "", fmt.Sprintf("a part holds %d processes", len(rec.Procs))
	}
	var sessions map[string]string
	if err := json.Unmarshal([]byte(part.Data["sessions"]), &sessions); err != nil {
		return "", pr, "", "a part has no session map"
	}
	sid = sessions[strconv.Itoa(rec.Procs[0].PID)]
	if sid == "" {
		return "", pr, "", "a part's process is no session's"
	}
	return ck, rec.Procs[0], sid, ""
}

// templateDigestTimeout bounds a template digest taken ahead (Persist).
const templateDigestTimeout = 2 * time.Second

// shellTemplate reports whether part is a shell's (shellPart) whose
// template digest is not known yet, and that process's pid.
func (p *procSandbox) shellTemplate(part *state.ProcPart) (int, bool) {
	ck, pr, _, why := p.shellPart(part)
	if why != "" {
		return 0, false
	}
	if _, ok := p.b.cachedDigest(ck, pr.PID); ok {
		return 0, false
	}
	return pr.PID, true
}

func (p *procSandbox) fillParts(part *state.ProcPart) {
	if part.Data["mode"] == string(cr.ModeEmpty) {
		part.TemplateReady, part.ImageReady = true, true
		return
	}
	parts, err := p.b.eng.Parts(part.Data["cr"])
	if err != nil {
		part.TemplateReady, part.ImageReady = false, false
		return
	}
	part.TemplateReady, part.ImageReady, part.ImageDir = parts.Template, parts.Image, parts.ImageDir
}

func (p *procSandbox) Persist(ctx context.Context, part *state.ProcPart) (*state.ProcPart, error) {
	np := *part
	if orig, ok := p.shellTemplate(part); ok {
		// A later restore between this part and another can keep the
		// live shell only when both templates' digests are known
		// (AdoptPart), and a turn's Unchanged asks for this one's: take
		// it now, while the image is written and the agent waits for
		// its model, not on a restore's path.
		done := make(chan struct{})
		go func() {
			defer close(done)
			dctx, cancel := context.WithTimeout(context.Background(), templateDigestTimeout)
			defer cancel()
			if _, err := p.b.templateDigest(dctx, part.Data["cr"], orig); err != nil {
				p.b.log.Debug("template digest", "cr", part.Data["cr"], "pid", orig, "err", err)
			}
		}()
		defer func() { <-done }()
	}
	if part.Data["mode"] != string(cr.ModeEmpty) {
		if err := p.b.eng.WaitImage(ctx, part.Data["cr"]); err != nil {
			p.fillParts(&np)
			return &np, err
		}
	}
	p.fillParts(&np)
	if np.ImageReady && np.ImageDir != "" {
		// What the part holds for as long as it lives: its image (on the
		// images dir's file system, tmpfs or disk). Templates are bounded
		// by the engine's pool and evicted once the image exists.
		if n, err := layer.DirSize(np.ImageDir); err == nil {
			np.Bytes = n
		}
	}
	return &np, nil
}

func (p *procSandbox) Restore(ctx context.Context, part *state.ProcPart, switchFS func() error) (string, error) {
	var sessions map[string]string
	json.Unmarshal([]byte(part.Data["sessions"]), &sessions)
	id := part.Data["cr"]
	p.mu.Lock()
	mine := p.ckpts[id]
	p.restored, p.restoredOK = nil, false
	p.mu.Unlock()
	if !mine && part.Data["mode"] == string(cr.ModeEmpty) {
		// Nothing to recreate: kill what runs and switch.
		if err := p.sb.KillProcesses(ctx, nil); err != nil {
			return "", err
		}
		p.setOrigins(id, nil)
		return "template", switchFS()
	}
	var chMu sync.Mutex
	var opened []*sandbox.Channels
	opts := cr.RestoreOptions{
		SwitchFS: switchFS,
		Reroot:   p.view != nil,
		// A template copy gets pipes made inside it: no round trip to
		// the sandbox's init on the restore's path.
		Pipes: func(proc cr.Proc) func(pid int, stdin, output *os.File) error {
			sid, ok := sessions[strconv.Itoa(proc.PID)]
			if !ok {
				return nil
			}
			return func(pid int, stdin, output *os.File) error {
				_, err := p.sb.AdoptPipes(sid, pid, stdin, output)
				return err
			}
		},
		Stdio: func(proc cr.Proc) (*cr.Stdio, error) {
			sid, ok := sessions[strconv.Itoa(proc.PID)]
			if !ok {
				return nil, nil
			}
			if part.Data["mode"] == string(cr.ModeParked) && p.ownSession(sid, proc.PID) {
				return nil, nil // the parked shell runs on with its session
			}
			ch, err := p.sb.NewChannels()
			if err != nil {
				return nil, err
			}
			in, out, err := ch.InitFDs(ctx)
			if err != nil {
				ch.Close()
				return nil, err
			}
			chMu.Lock()
			opened = append(opened, ch)
			chMu.Unlock()
			fin, fout := ch.ChildFiles()
			return &cr.Stdio{
				Stdin:  "/proc/1/fd/" + strconv.Itoa(in),
				Stdout: "/proc/1/fd/" + strconv.Itoa(out),
				Stderr: "/proc/1/fd/" + strconv.Itoa(out),
				Files:  [3]*os.File{fin, fout, fout},
				Started: func(pid int) error {
					_, err := p.sb.AdoptSession(sid, pid, ch)
					if err == nil {
						chMu.Lock()
						opened = slices.DeleteFunc(opened, func(c *sandbox.Channels) bool { return c == ch })
						chMu.Unlock()
					}
					return err
				},
			}, nil
		},
	}
	res, err := p.b.eng.Restore(ctx, p.sb, id, opts)
	if err == nil && p.b.log.Enabled(ctx, slog.LevelDebug) {
		attrs := []any{"sandbox", p.sb.ID(), "path", res.Path}
		for _, ph := range res.Phases {
			attrs = append(attrs, ph.Name+"_us", ph.D.Microseconds())
		}
		p.b.log.Debug("cr restore", attrs...)
	}
	chMu.Lock()
	for _, ch := range opened {
		ch.Close()
	}
	chMu.Unlock()
	if err != nil {
		p.setOrigins(id, nil) // what runs now is not known
		return "", err
	}
	pairs := make([][2]int, 0, len(res.Procs))
	for _, r := range res.Procs {
		pairs = append(pairs, [2]int{r.PID, r.Orig.PID})
	}
	p.setOrigins(id, pairs)
	var shells []int
	for _, r := range res.Procs {
		if _, ok := sessions[strconv.Itoa(r.Orig.PID)]; ok {
			shells = append(shells, r.PID)
		}
	}
	// A restore from an image (a fork child, a sandbox brought back) has a
	// fresh mount whose page cache is empty: the released shell first
	// waits for pages of its program through the daemon's FUSE server,
	// and may wait longer than a template restore's copy, beside the
	// other children of a fan-out.
	wait := settleTimeout
	if res.Path != "template" {
		wait = settleImageTimeout
	}
	settle(shells, wait)
	if res.Live != nil {
		// Every process the restore left (a template restore's copies or
		// parked processes, a CRIU restore's trees as restored): one that
		// any of them starts before the next window opens is new in it.
		p.mu.Lock()
		p.restored, p.restoredOK = res.Live, true
		p.mu.Unlock()
	}
	return res.Path, nil
}

// takeRestored returns, once, the pids the last restore or checkpoint
// left alive, if no probe window ended since.
func (p *procSandbox) takeRestored() ([]int, bool) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pids, ok := p.restored, p.restoredOK
	p.restored, p.restoredOK = nil, false
	return pids, ok
}

// ownSession reports whether session sid is still served by process pid
// (no restore gave it to another process since).
func (p *procSandbox) ownSession(sid string, pid int) bool {
	ss := p.sb.Session(sid)
	if ss == nil || ss.PID() != pid {
		return false
	}
	select {
	case <-ss.Done():
		return false
	default:
		return true
	}
}

// settleTimeout bounds how long a checkpoint or a template restore waits
// for the shells to settle; settleImageTimeout a restore from an image.
const (
	settleTimeout      = 5 * time.Millisecond
	settleImageTimeout = 200 * time.Millisecond
)

// settle waits, briefly, until none of pids is running, stopped or in an
// uninterruptible wait: each has blocked in a system call. A copy
// released from its template resumes the system call it was checkpointed
// in (a shell's read of its next command) only once it is scheduled, and
// after a restore into a fresh mount first waits for its program's pages
// (state D, a FUSE read the daemon serves); had it not run before the next
// probe window opens, that window would count it as having run (written
// memory, for the probe's estimate), and the sandbox would no longer be
// exactly its head: a fork child's first turn came out full instead of
// skip (1 to 5 of 16 children, every run), each such shell last woken by
// a FUSE page read after its release. A process that keeps running past
// the deadline is simply left to run.
func settle(pids []int, timeout time.Duration) {
	deadline := time.Now().Add(timeout)
	for _, pid := range pids {
		for time.Now().Before(deadline) {
			st, err := procStateOf(pid)
			if err != nil || (st != 'R' && st != 'D' && st != 't' && st != 'T') {
				break
			}
			pause.For(20 * time.Microsecond) // time.Sleep would take a millisecond
		}
	}
}

// procStateOf returns the state letter of /proc/pid/stat.
func procStateOf(pid int) (byte, error) {
	st, err := readProcStat(pid)
	return st.state, err
}

// prefetchLimit bounds what PrefetchMapped reads per sandbox: a shell's
// program and libraries are a few megabytes; a sandbox's process mapping
// a huge file must not make the daemon read all of it.
const prefetchLimit = 64 << 20

// PrefetchMapped implements state.MappedPrefetcher.
func (p *procSandbox) PrefetchMapped(ctx context.Context) error {
	got, err := p.sb.PrefetchMapped(ctx, prefetchLimit)
	if err == nil && p.b.log.Enabled(ctx, slog.LevelDebug) {
		p.b.log.Debug("prefetched mapped files", "sandbox", p.sb.ID(), "files", got.Files, "bytes", got.Bytes)
	}
	return err
}

func (p *procSandbox) Close() error {
	p.mu.Lock()
	ids := make([]string, 0, len(p.ckpts))
	for id := range p.ckpts {
		ids = append(ids, id)
	}
	p.mu.Unlock()
	for _, id := range ids {
		p.b.eng.Evict(id) // templates die with the sandbox; images stay
	}
	if p.view != nil {
		p.view.setSandbox(nil)
	}
	return p.sb.Close()
}

// probeAdapter implements state.Probe with package probe: one window per
// sandbox, closed and reopened at every turn.
type probeAdapter struct {
	p   probe.Probe
	eng *cr.Engine
}

func (a *probeAdapter) Watch(_ context.Context, _ string, mount state.FSMount, proc state.ProcSandbox) (state.ProbeWindow, error) {
	ps, ok := proc.(*procSandbox)
	if !ok {
		return nil, errors.New("probe: not a real sandbox")
	}
	pw := &probeWindow{p: a.p, eng: a.eng, sb: ps.sb, ps: ps}
	ps.takeRestored() // this window's snapshot lists the cgroup
	// cr's templates and warm spares are rewind's processes, not effects
	// of the agent's turn.
	t := probe.Target{Sandbox: ps.sb.ID(), CgroupV2Dir: ps.sb.CgroupV2Dir(), CgroupID: ps.sb.CgroupID(), InitPID: ps.sb.InitPID(),
		ExcludeStat: pw.excludeStat, Files: probe.NewFiles()}
	if fm, ok := mount.(*fsMount); ok {
		t.FS = fm.f
	}
	pw.t = t
	w, err := a.p.Begin(t)
	if err != nil {
		t.Files.Close()
		return nil, err
	}
	pw.w = w
	return pw, nil
}

type probeWindow struct {
	mu  sync.Mutex
	p   probe.Probe
	eng *cr.Engine
	sb  *sandbox.Sandbox
	ps  *procSandbox
	t   probe.Target
	w   probe.Window
	// next is the window End opened at once (probe.Window.Next), for
	// Resume to adopt; Begin drops it and opens a fresh one.
	next probe.Window

	// agents are the processes exclude found to be the agent's, by pid,
	// with their start times.
	agentsMu sync.Mutex
	agents   map[int]uint64
}

// exclude hides from the probe what is not the agent's: the sandbox's
// init, cr's helper processes (templates, spares, parked processes,
// copies being dumped: IsTemplate), a copy cr is making right now (traced
// by this daemon before cr lists it as a helper: a fork in progress), a
// process already exiting (a restore's killed processes tear down their
// memory for a while), and any process that does not descend from the
// init (CRIU, and the host shell that joined the sandbox's cgroups to run
// it). It reads /proc only, and takes none of cr's locks: a listing of the
// live processes through cr at every window boundary waited for the
// sandbox's spare forks and cost more than the probe's own snapshot.
//
// A process found to be the agent's is remembered (pid and start time):
// the next snapshots read only its stat (exiting?) and skip its status
// and its ancestors. Nothing turns an agent's process into one to leave
// out but cr making it a helper (parked), which IsTemplate answers first,
// or its exit; a process cr is forking is a new pid, traced from birth.
func (w *probeWindow) exclude(pid int) bool { return w.excludeStat(pid, nil) }

// excludeStat is exclude for probe.Target.ExcludeStat: stat, if not nil,
// reads pid's own stat (the snapshot's copy, which the snapshot parses
// again instead of reading it a second time).
func (w *probeWindow) excludeStat(pid int, stat func() ([]byte, error)) bool {
	init := w.t.InitPID
	if pid == init || w.eng.IsTemplate(pid) {
		return true
	}
	p := pid
	var start uint64
	for depth := 0; depth < 64; depth++ {
		var st procStat
		var err error
		if p == pid && stat != nil {
			var b []byte
			if b, err = stat(); err == nil {
				st, err = parseProcStat(pid, b)
			}
		} else {
			st, err = readProcStat(p)
		}
		if err != nil {
			return true // gone (or an ancestor went: it is being reparented)
		}
		if p == pid {
			if st.exiting() {
				return true
			}
			if w.isAgent(pid, st.start) {
				return false
			}
			if tracedByUs(pid) {
				return true
			}
			start = st.start
		}
		if st.ppid == init {
			w.rememberAgent(pid, start)
			return false
		}
		if st.ppid <= 1 {
			return true
		}
		p = st.ppid
	}
	return true
}

// maxAgents bounds probeWindow.agents; when full it starts over.
const maxAgents = 4096

// isAgent reports whether exclude found process pid, started at start, to
// be the agent's before.
func (w *probeWindow) isAgent(pid int, start uint64) bool {
	w.agentsMu.Lock()
	defer w.agentsMu.Unlock()
	s, ok := w.agents[pid]
	return ok && s == start
}

func (w *probeWindow) rememberAgent(pid int, start uint64) {
	w.agentsMu.Lock()
	defer w.agentsMu.Unlock()
	if w.agents == nil || len(w.agents) >= maxAgents {
		w.agents = map[int]uint64{}
	}
	w.agents[pid] = start
}

// procStat is what exclude reads of /proc/PID/stat.
type procStat struct {
	state byte
	ppid  int
	flags uint64
	start uint64 // start time, in clock ticks after boot
}

// pfExiting is the kernel's PF_EXITING task flag.
const pfExiting = 0x4

func (s procStat) exiting() bool {
	return s.flags&pfExiting != 0 || s.state == 'Z' || s.state == 'X' || s.state == 'x'
}

// readProcStat reads the state, parent and flags of pid.
func readProcStat(pid int) (procStat, error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "stat"))
	if err != nil {
		return procStat{}, err
	}
	return parseProcStat(pid, b)
}

// parseProcStat parses b, the content of pid's /proc/PID/stat.
func parseProcStat(pid int, b []byte) (st procStat, err error) {
	i := bytes.LastIndexByte(b, ')')
	if i < 0 {
		return procStat{}, fmt.Errorf("bad stat of %d", pid)
	}
	// After the comm: state ppid pgrp session tty_nr tpgid flags ...
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 || len(f[0]) != 1 {
		return procStat{}, fmt.Errorf("bad stat of %d", pid)
	}
	st.state = f[0][0]
	if st.ppid, err = strconv.Atoi(f[1]); err != nil {
		return procStat{}, fmt.Errorf("bad stat of %d: %w", pid, err)
	}
	if st.flags, err = strconv.ParseUint(f[6], 10, 64); err != nil {
		return procStat{}, fmt.Errorf("bad stat of %d: %w", pid, err)
	}
	// starttime is the stat's 22nd field, the 20th after the comm.
	if st.start, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return procStat{}, fmt.Errorf("bad stat of %d: %w", pid, err)
	}
	return st, nil
}

// tracedByUs reports whether pid is traced by a thread of this process
// (TracerPid names the tracing thread, cr's tracer thread).
func tracedByUs(pid int) bool {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "status"))
	if err != nil {
		return false
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "TracerPid:"); ok {
			tid := strings.TrimSpace(v)
			if tid == "" || tid == "0" {
				return false
			}
			_, err := os.Stat("/proc/self/task/" + tid)
			return err == nil
		}
	}
	return false
}

func (w *probeWindow) End(context.Context) (*effect.Report, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	w.ps.takeRestored() // what a restore left alive may change from now on
	if w.w == nil {
		return nil, errors.New("no probe window open")
	}
	rep, next, err := w.w.Next()
	w.w, w.next = nil, next
	if rep != nil {
		discountCRIUTemp(rep)
	}
	return rep, err
}

// criuTempDir is the directory CRIU creates and removes again in /tmp of
// the mount namespace it runs in, the sandbox's, on every run that has no
// kernel-feature cache (kerndat's MOVE_MOUNT_SET_GROUP check): the
// engine's asynchronous image dumps run while the sandbox's next probe
// window is open.
var criuTempDir = sync.OnceValue(func() *regexp.Regexp {
	return regexp.MustCompile(`^/tmp/\.criu\.move_mount_set_group\.[A-Za-z0-9]{6}$`)
})

// discountCRIUTemp removes from rep the file effects of CRIU's own
// temporary directory: each path created and deleted again in the window,
// and nothing else done to it. It changes nothing unless the report's
// samples are complete (fewer than effect.MaxSamples), so that every
// change the counters count is known; what remains of the report is the
// agent's. The sandbox's /tmp itself is left with a new mtime, as after
// any create and delete.
func discountCRIUTemp(rep *effect.Report) {
	f := &rep.FS
	if len(f.Samples) == 0 || len(f.Samples) >= effect.MaxSamples {
		return
	}
	ops := map[string][]string{}
	for _, s := range f.Samples {
		ops[s.Path] = append(ops[s.Path], s.Op)
	}
	var n uint64
	own := map[string]bool{}
	for p, o := range ops {
		if criuTempDir().MatchString(p) && len(o) == 2 && o[0] == "create" && o[1] == "delete" {
			own[p] = true
			n++
		}
	}
	if n == 0 || f.Created < n || f.Deleted < n {
		return
	}
	f.Created -= n
	f.Deleted -= n
	f.Samples = slices.DeleteFunc(f.Samples, func(s effect.PathSample) bool { return own[s.Path] })
	if len(f.Samples) == 0 {
		f.Samples = nil
	}
}

func (w *probeWindow) Begin(context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.w != nil {
		return nil
	}
	if w.next != nil {
		w.next.Abort() // what ran since End may be rewind's own work
		w.next = nil
	}
	var nw probe.Window
	var err error
	if pids, ok := w.ps.takeRestored(); ok {
		if kb, can := w.p.(probe.KnownBeginner); can {
			// A restore or checkpoint just left these processes: the
			// window starts from them, without a listing of the cgroup.
			nw, err = kb.BeginKnown(w.t, pids)
		} else {
			nw, err = w.p.Begin(w.t)
		}
	} else {
		nw, err = w.p.Begin(w.t)
	}
	if err != nil {
		return err
	}
	w.w = nw
	return nil
}

// Resume implements state.ProbeResumer with the window End opened.
func (w *probeWindow) Resume(context.Context) error {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.w != nil {
		return nil
	}
	if w.next == nil {
		return errors.New("no window to resume")
	}
	w.w, w.next = w.next, nil
	return nil
}

func (w *probeWindow) Close() error {
	w.mu.Lock()
	defer w.mu.Unlock()
	for _, x := range []probe.Window{w.w, w.next} {
		if x != nil {
			x.Abort()
		}
	}
	w.w, w.next = nil, nil
	return w.t.Files.Close()
}

// policyLoader implements state.PolicyLoader with the WASM policy host;
// each policy is compiled once, and loads of different policies run in
// parallel.
type policyLoader struct {
	h     *policy.Host
	log   *slog.Logger
	wg    sync.WaitGroup // preloads
	mu    sync.Mutex
	cache map[string]*loadingPolicy
}

// loadingPolicy is a policy being loaded (done open) or loaded.
type loadingPolicy struct {
	done chan struct{}
	p    *policy.Policy // set when done closes, nil on error
	err  error
}

// preload starts loading a policy in the background.
func (l *policyLoader) preload(name string) {
	if name == "" {
		return
	}
	l.wg.Add(1)
	go func() {
		defer l.wg.Done()
		if _, err := l.Load(context.Background(), name); err != nil {
			l.log.Warn("policy preload", "policy", name, "err", err)
		}
	}()
}

// wait waits for the preloads (before the host closes).
func (l *policyLoader) wait() { l.wg.Wait() }

func (l *policyLoader) Load(ctx context.Context, name string) (state.Policy, error) {
	l.mu.Lock()
	e := l.cache[name]
	mine := e == nil
	if mine {
		e = &loadingPolicy{done: make(chan struct{})}
		l.cache[name] = e
	}
	l.mu.Unlock()
	if mine {
		p, err := l.h.LoadRef(context.WithoutCancel(ctx), name)
		if err != nil {
			if p != nil {
				p.Close(ctx)
			}
			l.mu.Lock()
			delete(l.cache, name) // the next load tries again
			l.mu.Unlock()
			e.err = err
		} else {
			e.p = p
		}
		close(e.done)
	}
	select {
	case <-e.done:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	if e.err != nil {
		return nil, e.err
	}
	return policyAdapter{e.p}, nil
}

type policyAdapter struct{ p *policy.Policy }

func (a policyAdapter) Decide(ctx context.Context, r *effect.Report) (state.Decision, error) {
	d, err := a.p.Decide(ctx, r)
	if err != nil {
		return state.Decision{}, err
	}
	return state.Decision{Mode: state.Mode(d.Mode.String()), Reason: d.Reason, Fallback: d.Fallback}, nil
}

// spareIDPrefix starts the ids of the daemon's spare inits (and so the
// names of their cgroups).
const spareIDPrefix = "spare-"
