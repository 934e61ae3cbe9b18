package policy

import (
	"context"
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/tetratelabs/wazero"
	"github.com/tetratelabs/wazero/api"
	"github.com/tetratelabs/wazero/experimental"
	"github.com/tetratelabs/wazero/sys"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

// wasiModule is the only import namespace a policy may use.
const wasiModule = "wasi_snapshot_preview1"

// validate checks a compiled module against the ABI before any instance
// runs: imports from WASI only, and the required exports with their exact
// signatures.
func validate(cm wazero.CompiledModule) error {
	for _, f := range cm.ImportedFunctions() {
		mod, name, _ := f.Import()
		if mod != wasiModule {
			return fmt.Errorf("imports host function %s.%s: a policy may import %s only", mod, name, wasiModule)
		}
	}
	for _, m := range cm.ImportedMemories() {
		mod, name, _ := m.Import()
		return fmt.Errorf("imports memory %s.%s: a policy must define and export its own memory", mod, name)
	}
	if _, ok := cm.ExportedMemories()[guest.ExportMemory]; !ok {
		return fmt.Errorf("does not export its memory as %q", guest.ExportMemory)
	}
	want := []struct {
		name            string
		params, results []api.ValueType
	}{
		{guest.ExportABIVersion, nil, []api.ValueType{api.ValueTypeI32}},
		{guest.ExportAlloc, []api.ValueType{api.ValueTypeI32}, []api.ValueType{api.ValueTypeI32}},
		{guest.ExportClassify, []api.ValueType{api.ValueTypeI32, api.ValueTypeI32}, []api.ValueType{api.ValueTypeI64}},
	}
	fns := cm.ExportedFunctions()
	for _, w := range want {
		f, ok := fns[w.name]
		if !ok {
			return fmt.Errorf("missing export %q", w.name)
		}
		if !sameTypes(f.ParamTypes(), w.params) || !sameTypes(f.ResultTypes(), w.results) {
			return fmt.Errorf("export %q has signature %s -> %s, want %s -> %s", w.name,
				typeNames(f.ParamTypes()), typeNames(f.ResultTypes()), typeNames(w.params), typeNames(w.results))
		}
	}
	return nil
}

func sameTypes(a, b []api.ValueType) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func typeNames(ts []api.ValueType) string {
	s := make([]string, len(ts))
	for i, t := range ts {
		s[i] = api.ValueTypeName(t)
	}
	return "(" + strings.Join(s, ",") + ")"
}

// Policy is a loaded policy: a compiled module and a pool of its instances.
// Decide is safe for concurrent use.
type Policy struct {
	h    *Host
	name string
	cm   wazero.CompiledModule // nil for a policy that failed to load
	pm   *policyMetrics

	idle   chan *instance
	tokens chan struct{} // one per live instance

	failures atomic.Int32 // consecutive
	// lastFailure is when the last counted failure was recorded (unix ns).
	lastFailure atomic.Int64
	disabled    atomic.Bool
	closed      atomic.Bool

	mu             sync.Mutex
	disabledReason string
	// loadFailed: the module could not be loaded (disable with kind
	// "load"); Close then drops its metric series.
	loadFailed atomic.Bool
}

// instance is one instantiated module with its buffers.
type instance struct {
	mod      api.Module
	mem      api.Memory
	alloc    api.Function
	classify api.Function
	inPtr    uint32
	inCap    uint32
	buf      []byte
	stack    [2]uint64
}

func (h *Host) newPolicy(name string, cm wazero.CompiledModule) *Policy {
	p := &Policy{h: h, name: name, cm: cm, pm: h.metrics.forPolicy(name),
		idle:   make(chan *instance, h.opts.MaxInstances),
		tokens: make(chan struct{}, h.opts.MaxInstances),
	}
	h.mu.Lock()
	h.policies[p] = struct{}{}
	h.mu.Unlock()
	return p
}

func (h *Host) disabledPolicy(name string, err error) *Policy {
	p := h.newPolicy(name, nil)
	p.disable(err.Error(), "load")
	return p
}

// Name returns the policy's name (a built-in name or the module's path).
func (p *Policy) Name() string { return p.name }

// Disabled reports whether the policy is disabled, and why.
func (p *Policy) Disabled() (bool, string) {
	if !p.disabled.Load() {
		return false, ""
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return true, p.disabledReason
}

// Close releases the policy's instances. Decide on a closed policy returns
// an error.
func (p *Policy) Close(ctx context.Context) {
	if p.closed.Swap(true) {
		return
	}
	for {
		select {
		case inst := <-p.idle:
			p.drop(ctx, inst)
		default:
			p.h.mu.Lock()
			delete(p.h.policies, p)
			other := false
			for q := range p.h.policies {
				other = other || q.name == p.name
			}
			p.h.mu.Unlock()
			if p.loadFailed.Load() && !other {
				// A module that never ran keeps no series: its name may be
				// any path a client sent.
				p.h.metrics.forget(p.name)
			}
			return
		}
	}
}

func (p *Policy) disable(reason, kind string) {
	p.mu.Lock()
	if p.disabled.Load() {
		p.mu.Unlock()
		return
	}
	p.disabledReason = reason
	p.disabled.Store(true)
	p.mu.Unlock()
	p.pm.disabled.Set(1)
	if kind != "" {
		p.pm.failure(kind)
	}
	if kind == "load" {
		p.loadFailed.Store(true)
		// Its caller decides what follows (a create is refused, a
		// sandbox brought back takes full checkpoints and says so).
		p.h.opts.Logger.Warn("policy could not be loaded", "policy", p.name, "reason", reason)
		return
	}
	p.h.opts.Logger.Error("policy disabled: every turn now gets a full checkpoint",
		"policy", p.name, "reason", reason)
}

// instantiate creates a new instance and checks its ABI version.
func (p *Policy) instantiate(ctx context.Context) (*instance, error) {
	ictx, cancel := context.WithTimeout(ctx, p.h.opts.InitTimeout)
	defer cancel()
	cfg := wazero.NewModuleConfig().WithName("").WithStartFunctions("_initialize")
	if p.h.memory != nil {
		ictx = experimental.WithMemoryAllocator(ictx, p.h.memory)
	}
	mod, err := p.h.rt.InstantiateModule(ictx, p.cm, cfg)
	if err != nil {
		return nil, fmt.Errorf("instantiate: %w", err)
	}
	inst := &instance{mod: mod, mem: mod.Memory(),
		alloc: mod.ExportedFunction(guest.ExportAlloc), classify: mod.ExportedFunction(guest.ExportClassify)}
	if inst.mem == nil || inst.alloc == nil || inst.classify == nil {
		_ = mod.Close(ctx)
		return nil, errors.New("instance lacks the ABI exports")
	}
	res, err := mod.ExportedFunction(guest.ExportABIVersion).Call(ictx)
	if err != nil {
		_ = mod.Close(ctx)
		return nil, fmt.Errorf("%s: %w", guest.ExportABIVersion, err)
	}
	if v := uint32(res[0]); v != guest.ABIVersion {
		_ = mod.Close(ctx)
		return nil, fmt.Errorf("unsupported policy ABI version %d (this host speaks %d)", v, guest.ABIVersion)
	}
	return inst, nil
}

// get returns an idle instance or a new one, waiting while MaxInstances are
// busy.
func (p *Policy) get(ctx context.Context) (*instance, error) {
	select {
	case inst := <-p.idle:
		return inst, nil
	default:
	}
	select {
	case inst := <-p.idle:
		return inst, nil
	case p.tokens <- struct{}{}:
		inst, err := p.instantiate(ctx)
		if err != nil {
			<-p.tokens
			return nil, err
		}
		return inst, nil
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// put returns a healthy instance to the pool. The first instance (from Load)
// takes its token here.
func (p *Policy) put(inst *instance) {
	if p.closed.Load() {
		p.drop(context.Background(), inst)
		return
	}
	select {
	case p.idle <- inst:
	default:
		p.drop(context.Background(), inst)
	}
}

// drop closes an instance and frees its token.
func (p *Policy) drop(ctx context.Context, inst *instance) {
	_ = inst.mod.Close(ctx)
	select {
	case <-p.tokens:
	default:
	}
}

// failure is a classification that did not produce a decision.
type failure struct {
	kind  string // metric label
	err   error
	start time.Time // when the failed Decide started
}

func (f *failure) Error() string { return f.kind + ": " + f.err.Error() }

// Decide classifies one turn. Policy failures never return an error: they
// yield Decision{Mode: Full, Fallback: true} with the reason, are logged
// and counted, and MaxFailures consecutive ones disable the policy. err is
// non-nil only for caller mistakes (nil report, closed policy). A report with
// LostEvents > 0 never yields Skip.
func (p *Policy) Decide(ctx context.Context, r *effect.Report) (Decision, error) {
	start := time.Now()
	if r == nil {
		return Decision{Mode: Full, Fallback: true, Reason: "no report"}, errors.New("policy decide: nil report")
	}
	if p.closed.Load() {
		return Decision{Mode: Full, Fallback: true, Reason: "policy closed"}, fmt.Errorf("policy %s is closed", p.name)
	}
	var d Decision
	if p.disabled.Load() {
		_, why := p.Disabled()
		d = Decision{Mode: Full, Fallback: true, Reason: "policy " + p.name + " disabled: " + why}
	} else {
		var f *failure
		d, f = p.run(ctx, r)
		if f != nil {
			f.start = start
			d = p.fail(ctx, f)
		} else {
			p.failures.Store(0)
		}
	}
	if d.Mode == Skip && r.LostEvents > 0 {
		d = Decision{Mode: Full, Fallback: true,
			Reason: "probe lost " + strconv.FormatUint(r.LostEvents, 10) + " events: skip overridden (policy said: " + d.Reason + ")"}
	}
	d.Latency = time.Since(start)
	p.pm.decisions[d.Mode].Inc()
	p.pm.latency.Observe(d.Latency.Seconds())
	return d, nil
}

// firstLine is s up to its first newline: a trap's error carries the
// guest's stack trace on the lines after it, which the log keeps and a
// decision's reason (turn answers, rewind log) does not.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// fail accounts for one failure and returns the fallback decision.
func (p *Policy) fail(ctx context.Context, f *failure) Decision {
	if ctx.Err() != nil && f.kind != "guest_error" && f.kind != "malformed" {
		// The caller gave up (cancelled or its own deadline): not the
		// policy's fault, so it does not count towards disabling.
		p.pm.failure("caller_cancelled")
		return Decision{Mode: Full, Fallback: true, Reason: "policy " + p.name + " interrupted: " + ctx.Err().Error()}
	}
	p.pm.failure(f.kind)
	// The wall cap also expires when the host stalls long enough (see
	// watchCPU): calls that were already running when the previous
	// failure was counted overlap the same stall and count once, so one
	// stall cannot disable a policy shared by many sandboxes.
	if f.kind == "deadline" && !f.start.IsZero() && f.start.UnixNano() < p.lastFailure.Load() {
		p.h.opts.Logger.Warn("policy failed; full checkpoint instead", "policy", p.name, "kind", f.kind,
			"err", f.err, "overlapping", true)
		return Decision{Mode: Full, Fallback: true, Reason: "policy " + p.name + " failed: " + firstLine(f.Error())}
	}
	p.lastFailure.Store(time.Now().UnixNano())
	n := p.failures.Add(1)
	p.h.opts.Logger.Warn("policy failed; full checkpoint instead", "policy", p.name, "kind", f.kind,
		"err", f.err, "consecutive", n)
	if int(n) >= p.h.opts.MaxFailures {
		p.disable(fmt.Sprintf("%d consecutive failures, last: %s", n, firstLine(f.Error())), "")
	}
	return Decision{Mode: Full, Fallback: true, Reason: "policy " + p.name + " failed: " + firstLine(f.Error())}
}

// run performs one classification on a pooled instance.
func (p *Policy) run(ctx context.Context, r *effect.Report) (Decision, *failure) {
	inst, err := p.get(ctx)
	if err != nil {
		return Decision{}, &failure{kind: "instantiate", err: err}
	}
	d, f := p.call(ctx, inst, r)
	if f != nil {
		p.drop(ctx, inst)
		return d, f
	}
	p.put(inst)
	return d, nil
}

func (p *Policy) call(ctx context.Context, inst *instance, r *effect.Report) (Decision, *failure) {
	inst.buf = r.AppendWire(inst.buf[:0])
	n := uint32(len(inst.buf))
	// The guest runs on this goroutine: its thread's CPU time is the
	// call's (see watchCPU).
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()
	cctx, cancel := context.WithCancelCause(ctx)
	defer cancel(nil)
	stop := watchCPU(p.h.opts.Timeout, wallCapFactor*p.h.opts.Timeout, func() { cancel(errDeadline) })
	defer stop()
	if n > inst.inCap {
		want := max(n, 4096)
		inst.stack[0] = uint64(want)
		if err := inst.alloc.CallWithStack(cctx, inst.stack[:]); err != nil {
			return Decision{}, classifyErr(cctx, guest.ExportAlloc, err)
		}
		ptr := uint32(inst.stack[0])
		if uint64(ptr)+uint64(want) > uint64(inst.mem.Size()) || ptr == 0 {
			return Decision{}, &failure{kind: "malformed", err: fmt.Errorf("%s(%d) returned %#x, outside memory of %d bytes",
				guest.ExportAlloc, want, ptr, inst.mem.Size())}
		}
		inst.inPtr, inst.inCap = ptr, want
	}
	if !inst.mem.Write(inst.inPtr, inst.buf) {
		return Decision{}, &failure{kind: "malformed", err: errors.New("input buffer outside memory")}
	}
	inst.stack[0], inst.stack[1] = uint64(inst.inPtr), uint64(n)
	if err := inst.classify.CallWithStack(cctx, inst.stack[:]); err != nil {
		return Decision{}, classifyErr(cctx, guest.ExportClassify, err)
	}
	res := inst.stack[0]
	ptr, size := uint32(res>>32), uint32(res)
	if size == 0 || size > 1+guest.MaxReason {
		return Decision{}, &failure{kind: "malformed", err: fmt.Errorf("output length %d outside [1, %d]", size, 1+guest.MaxReason)}
	}
	out, ok := inst.mem.Read(ptr, size)
	if !ok {
		return Decision{}, &failure{kind: "malformed", err: fmt.Errorf("output [%#x, +%d) outside memory of %d bytes", ptr, size, inst.mem.Size())}
	}
	var d Decision
	switch guest.Decision(out[0]) {
	case guest.Skip:
		d.Mode = Skip
	case guest.FS:
		d.Mode = FS
	case guest.Full:
		d.Mode = Full
	case guest.Error:
		return Decision{}, &failure{kind: "guest_error", err: fmt.Errorf("policy reported: %s", sanitize(out[1:]))}
	default:
		return Decision{}, &failure{kind: "malformed", err: fmt.Errorf("unknown decision code %d", out[0])}
	}
	if len(out) > 1 {
		d.Reason = sanitize(out[1:])
	}
	return d, nil
}

// sanitize turns guest bytes into a printable single-line string.
func sanitize(b []byte) string {
	s := strings.ToValidUTF8(string(b), "\uFFFD")
	if strings.IndexFunc(s, func(r rune) bool { return r < 0x20 || r == 0x7f }) < 0 {
		return s
	}
	return strings.Map(func(r rune) rune {
		if r < 0x20 || r == 0x7f {
			return ' '
		}
		return r
	}, s)
}

// errDeadline ends a classify call that used up its time (watchCPU).
var errDeadline = fmt.Errorf("policy call out of time: %w", context.DeadlineExceeded)

// wallCapFactor bounds a classify call's wall time, in multiples of its
// CPU-time deadline (Options.Timeout).
const wallCapFactor = 20

// watchCPU calls expire once the calling thread (locked by the caller) has
// used limit of CPU time since the call, or once wallCap of wall time has
// passed, whichever comes first. A wall-clock deadline alone also expired
// when the host merely did not run the thread (an overloaded machine
// deschedules threads for several ms), which failed the policy, and a few
// such stalls in a row disabled it. The returned stop ends the watch.
func watchCPU(limit, wallCap time.Duration, expire func()) (stop func()) {
	read := threadClock()
	start, ok := read()
	t0 := time.Now()
	var mu sync.Mutex
	stopped := false
	var timer *time.Timer
	check := func() {
		mu.Lock()
		defer mu.Unlock()
		if stopped {
			return
		}
		used := limit // unreadable: the deadline is wall time
		if now, ok2 := read(); ok && ok2 {
			used = now - start
		}
		wall := time.Since(t0)
		if used >= limit || wall >= wallCap {
			stopped = true
			expire()
			return
		}
		timer.Reset(min(max(limit-used, 100*time.Microsecond), wallCap-wall))
	}
	mu.Lock()
	timer = time.AfterFunc(limit, check)
	mu.Unlock()
	return func() {
		mu.Lock()
		stopped = true
		timer.Stop()
		mu.Unlock()
	}
}

// classifyErr names the failure of a call into the module.
func classifyErr(ctx context.Context, fn string, err error) *failure {
	var exit *sys.ExitError
	switch {
	case errors.Is(ctx.Err(), context.DeadlineExceeded) || errors.Is(context.Cause(ctx), errDeadline) || (errors.As(err, &exit) && exit.ExitCode() == sys.ExitCodeDeadlineExceeded):
		return &failure{kind: "deadline", err: fmt.Errorf("%s exceeded its deadline", fn)}
	case errors.As(err, &exit):
		return &failure{kind: "exit", err: fmt.Errorf("%s: module exited with code %d (a Go guest exits 2 on panic or out of memory)", fn, exit.ExitCode())}
	}
	return &failure{kind: "trap", err: fmt.Errorf("%s: %w", fn, err)}
}
