// Package policy runs checkpoint policies: WASM modules that classify each
// turn's effect.Report as skip, fs or full (see ABI.md). The host is wazero;
// a module gets nothing beyond minimal WASI (no file system, no network, fake
// clocks, deterministic randomness, discarded stdio), bounded memory, and a
// deadline per call enforced by closing the instance. Any failure yields a
// full checkpoint, and a policy that keeps failing is disabled.
package policy

import (
	"context"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"runtime"
	"strings"
	"sync"
	"syscall"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/experimental"
	"github.com/tetratelabs/wazero/imports/wasi_snapshot_preview1"

	"github.com/rewind-sandbox/rewind/internal/wasmdata"
	"github.com/rewind-sandbox/rewind/policies"
)

// Defaults of Options.
const (
	DefaultMemoryLimit = 16 << 20
	DefaultTimeout     = 5 * time.Millisecond
	DefaultInitTimeout = 2 * time.Second
	DefaultMaxFailures = 5
)

// Options configure a Host. The zero value means every default.
type Options struct {
	// MemoryLimitBytes bounds each instance's linear memory (default 16 MiB,
	// rounded up to 64 KiB pages). Go guests need at least 8 MiB.
	MemoryLimitBytes uint64
	// Timeout is the CPU time one classify call may use (default 5 ms);
	// a call is also stopped after 20 times that in wall time, so that a
	// host that does not run the call's thread for a while does not fail
	// the policy unless the stall is that long. The instance is closed
	// when either expires.
	Timeout time.Duration
	// InitTimeout bounds instantiating a module, its _initialize included
	// (default 2 s).
	InitTimeout time.Duration
	// MaxFailures is the number of consecutive failures after which a policy
	// is disabled (default 5).
	MaxFailures int
	// MaxInstances bounds the instances of one policy (default
	// 2*GOMAXPROCS); Decide waits for a free one, honouring its context.
	MaxInstances int
	// CacheDir, if set, keeps compiled modules on disk across restarts;
	// otherwise compiled modules are cached in memory for the Host's life.
	CacheDir string
	// Logger receives failures (Warn) and disabled policies (Error). Default
	// slog.Default().
	Logger *slog.Logger
}

func (o Options) withDefaults() (Options, error) {
	if o.MemoryLimitBytes == 0 {
		o.MemoryLimitBytes = DefaultMemoryLimit
	}
	if o.MemoryLimitBytes > 4<<30 {
		return o, fmt.Errorf("policy memory limit %d bytes exceeds the 4 GiB of wasm32", o.MemoryLimitBytes)
	}
	if o.Timeout <= 0 {
		o.Timeout = DefaultTimeout
	}
	if o.InitTimeout <= 0 {
		o.InitTimeout = DefaultInitTimeout
	}
	if o.MaxFailures <= 0 {
		o.MaxFailures = DefaultMaxFailures
	}
	if o.MaxInstances <= 0 {
		o.MaxInstances = 2 * runtime.GOMAXPROCS(0)
	}
	if o.Logger == nil {
		o.Logger = slog.Default()
	}
	return o, nil
}

// Host compiles, caches and runs policy modules. It is safe for concurrent
// use; Close releases everything it loaded.
type Host struct {
	opts    Options
	rt      wazero.Runtime
	cache   wazero.CompilationCache
	metrics *metrics
	memory  experimental.MemoryAllocator // of instances (nil: wazero's)

	mu       sync.Mutex
	compiled map[string]wazero.CompiledModule // by builtin name or sha256
	policies map[*Policy]struct{}
	closed   bool
}

// NewHost creates a Host.
func NewHost(ctx context.Context, opts Options) (*Host, error) {
	opts, err := opts.withDefaults()
	if err != nil {
		return nil, err
	}
	var cache wazero.CompilationCache
	if opts.CacheDir != "" {
		if cache, err = wazero.NewCompilationCacheWithDir(opts.CacheDir); err != nil {
			return nil, fmt.Errorf("policy compilation cache %s: %w", opts.CacheDir, err)
		}
	} else {
		cache = wazero.NewCompilationCache()
	}
	pages := (opts.MemoryLimitBytes + 65535) / 65536
	cfg := wazero.NewRuntimeConfig().
		WithCloseOnContextDone(true).
		WithMemoryLimitPages(uint32(pages)).
		WithCompilationCache(cache)
	rt := wazero.NewRuntimeWithConfig(ctx, cfg)
	if _, err := wasi_snapshot_preview1.Instantiate(ctx, rt); err != nil {
		_ = rt.Close(ctx)
		_ = cache.Close(ctx)
		return nil, fmt.Errorf("policy host: instantiate WASI: %w", err)
	}
	return &Host{
		opts: opts, rt: rt, cache: cache, metrics: newMetrics(), memory: memoryAllocator{},
		compiled: map[string]wazero.CompiledModule{},
		policies: map[*Policy]struct{}{},
	}, nil
}

// Collector returns the Host's Prometheus metrics for the caller to register
// (they are never registered globally).
func (h *Host) Collector() prometheus.Collector { return h.metrics }

// Options returns the effective options (defaults filled in).
func (h *Host) Options() Options { return h.opts }

// Close closes every policy and releases the runtime and compiled modules.
func (h *Host) Close(ctx context.Context) error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	ps := make([]*Policy, 0, len(h.policies))
	for p := range h.policies {
		ps = append(ps, p)
	}
	h.mu.Unlock()
	for _, p := range ps {
		p.Close(ctx)
	}
	err := h.rt.Close(ctx)
	return errors.Join(err, h.cache.Close(ctx))
}

// BuiltinNames lists the built-in policies, the default ("effects") first.
func BuiltinNames() []string { return policies.Names() }

// LoadBuiltin loads a built-in policy by name (see BuiltinNames). Like Load,
// it always returns a usable Policy.
func (h *Host) LoadBuiltin(ctx context.Context, name string) (*Policy, error) {
	key := "builtin:" + name
	h.mu.Lock()
	_, cached := h.compiled[key]
	h.mu.Unlock()
	var b []byte
	ok := true
	if !cached { // reading the embedded module copies 2 MB: only when compiling
		b, ok = policies.WASM(name)
	}
	if !ok {
		err := fmt.Errorf("unknown built-in policy %q (built-ins: %v)", name, policies.Names())
		return h.disabledPolicy(name, err), err
	}
	return h.load(ctx, name, key, b)
}

// MaxModuleBytes bounds a policy module file (the built-ins are about
// 2 MB).
const MaxModuleBytes = 64 << 20

// LoadFile loads a policy module from a file; the policy is named after it.
// The file must be a regular file of at most MaxModuleBytes: a device
// (/dev/zero) or a FIFO would be read without end, or wait for a writer.
func (h *Host) LoadFile(ctx context.Context, path string) (*Policy, error) {
	b, err := readModule(path)
	if err != nil {
		err = fmt.Errorf("load policy: %w", err)
		return h.disabledPolicy(path, err), err
	}
	return h.Load(ctx, path, b)
}

// readModule reads the module file at path (see LoadFile). It is opened
// without blocking, so that a FIFO is refused rather than waited on.
func readModule(path string) ([]byte, error) {
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	if !st.Mode().IsRegular() {
		return nil, fmt.Errorf("%s is not a regular file (%v)", path, st.Mode().Type())
	}
	if st.Size() > MaxModuleBytes {
		return nil, fmt.Errorf("%s is %d bytes, more than a policy module may be (%d)", path, st.Size(), MaxModuleBytes)
	}
	b, err := io.ReadAll(io.LimitReader(f, MaxModuleBytes+1))
	if err != nil {
		return nil, err
	}
	if len(b) > MaxModuleBytes {
		return nil, fmt.Errorf("%s grew past %d bytes while read", path, MaxModuleBytes)
	}
	return b, nil
}

// LoadRef loads a built-in policy when ref is one of BuiltinNames, and the
// module file ref otherwise.
func (h *Host) LoadRef(ctx context.Context, ref string) (*Policy, error) {
	if _, ok := policies.WASM(ref); ok {
		return h.LoadBuiltin(ctx, ref)
	}
	if !strings.Contains(ref, "/") && !strings.HasSuffix(ref, ".wasm") {
		if _, err := os.Stat(ref); err != nil {
			// Neither a built-in nor a module file: say what there is.
			err = fmt.Errorf("load policy: no built-in policy %q (built-ins: %s) and no module file of that name", ref, strings.Join(BuiltinNames(), ", "))
			return h.disabledPolicy(ref, err), err
		}
	}
	return h.LoadFile(ctx, ref)
}

// Load compiles (or fetches from the cache) and validates a policy module,
// and instantiates its first instance, checking its ABI version.
//
// Load always returns a usable *Policy. When err is non-nil the module is
// unusable and the returned policy is disabled: it decides Full for every
// turn, so a caller may log err and go on with full checkpoints.
func (h *Host) Load(ctx context.Context, name string, wasm []byte) (*Policy, error) {
	sum := sha256.Sum256(wasm)
	return h.load(ctx, name, string(sum[:]), wasm)
}

// load is Load with the compiled-module cache key: the sha256 of the bytes,
// or a built-in's name (its bytes are embedded and immutable, and hashing
// 2 MB on every load would cost a millisecond).
func (h *Host) load(ctx context.Context, name, key string, wasm []byte) (*Policy, error) {
	start := time.Now()
	h.mu.Lock()
	_, reused := h.compiled[key]
	h.mu.Unlock()
	cm, err := h.compile(ctx, key, wasm)
	if err != nil {
		err = fmt.Errorf("load policy %s: %w", name, err)
		return h.disabledPolicy(name, err), err
	}
	p := h.newPolicy(name, cm)
	p.tokens <- struct{}{} // the first instance's token; the pool is empty
	inst, err := p.instantiate(ctx)
	if err != nil {
		<-p.tokens
		err = fmt.Errorf("load policy %s: %w", name, err)
		p.disable(err.Error(), "load")
		return p, err
	}
	p.put(inst)
	source := "compile"
	if reused {
		source = "host"
	}
	h.metrics.load.WithLabelValues(name, source).Observe(time.Since(start).Seconds())
	return p, nil
}

// compile returns the compiled module for wasm, from the Host's cache when
// the same bytes were compiled before, and validates its imports and exports.
func (h *Host) compile(ctx context.Context, key string, wasm []byte) (wazero.CompiledModule, error) {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil, errors.New("policy host is closed")
	}
	cm, ok := h.compiled[key]
	h.mu.Unlock()
	if ok {
		return cm, nil
	}
	if len(wasm) < 8 || string(wasm[:4]) != "\x00asm" {
		return nil, errors.New("not a WASM module (bad magic)")
	}
	// Fewer data segments make every instantiation cheaper (2-3 ms less
	// per instance for a Go guest); the built-ins are merged already.
	wasm, _ = wasmdata.Merge(wasm, wasmdata.DefaultGap)
	cctx, cancel := context.WithTimeout(ctx, 4*h.opts.InitTimeout+30*time.Second)
	defer cancel()
	cm, err := h.rt.CompileModule(cctx, wasm)
	if err != nil {
		return nil, fmt.Errorf("compile: %w", err)
	}
	if err := validate(cm); err != nil {
		_ = cm.Close(ctx)
		return nil, err
	}
	h.mu.Lock()
	defer h.mu.Unlock()
	if prev, ok := h.compiled[key]; ok {
		_ = cm.Close(ctx)
		return prev, nil
	}
	h.compiled[key] = cm
	return cm, nil
}
