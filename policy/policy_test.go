package policy

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

// newTestHost returns a Host whose logs go to a buffer the test can inspect.
func newTestHost(t *testing.T, opts Options) (*Host, *syncBuffer) {
	t.Helper()
	logs := &syncBuffer{}
	if opts.Logger == nil {
		opts.Logger = slog.New(slog.NewTextHandler(logs, nil))
	}
	h, err := NewHost(context.Background(), opts)
	if err != nil {
		t.Fatalf("NewHost: %v", err)
	}
	t.Cleanup(func() { _ = h.Close(context.Background()) })
	return h, logs
}

type syncBuffer struct {
	mu sync.Mutex
	b  bytes.Buffer
}

func (s *syncBuffer) Write(p []byte) (int, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.Write(p)
}

func (s *syncBuffer) String() string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.b.String()
}

func hostile(t *testing.T, name string) []byte {
	t.Helper()
	b, err := os.ReadFile(filepath.Join("testdata", "hostile", name+".wasm"))
	if err != nil {
		t.Fatal(err)
	}
	return b
}

var sampleReports = []effect.Report{
	{Version: 1, Turn: 1},
	{Version: 1, Turn: 2, FS: effect.FS{Modified: 3, BytesWritten: 100}},
	{Version: 1, Turn: 3, Proc: effect.Proc{Forked: 1, Exited: 1}},
	{Version: 1, Turn: 4, Mem: effect.Mem{PagesWritten: 12}},
	{Version: 1, Turn: 5, Net: effect.Net{RemoteConnects: 1}},
	{Version: 1, Turn: 6, LostEvents: 5},
	{Version: 1, Turn: 7, Proc: effect.Proc{CwdChanges: 1}, FS: effect.FS{Samples: []effect.PathSample{{Op: "create", Path: "/x"}}}},
}

// checkHealthy verifies that the host still runs a well-behaved policy.
func checkHealthy(t *testing.T, h *Host) {
	t.Helper()
	ctx := context.Background()
	p, err := h.LoadBuiltin(ctx, "effects")
	if err != nil {
		t.Fatalf("host unhealthy: load effects: %v", err)
	}
	defer p.Close(ctx)
	for i := range sampleReports {
		r := &sampleReports[i]
		d, err := p.Decide(ctx, r)
		want, _ := rules.Effects(r)
		if err != nil || d.Fallback || d.Mode != fromGuest(want) {
			t.Fatalf("host unhealthy: turn %d: %+v, %v (want %v)", r.Turn, d, err, fromGuest(want))
		}
	}
}

func fromGuest(d guest.Decision) Mode {
	switch d {
	case guest.Skip:
		return Skip
	case guest.FS:
		return FS
	}
	return Full
}

func TestHostileModules(t *testing.T) {
	tests := []struct {
		module  string
		loadErr string // substring of the Load error, "" if Load succeeds
		reason  string // substring of the Decide reason
	}{
		{"loop", "", "deadline"},
		{"grow", "", "deadline"},
		{"trap", "", "trap"},
		{"recurse", "", "failed: "}, // stack overflow, or the deadline on a slow machine
		{"exit", "", "module exited with code 2"},
		{"bigout", "", "output length 1073741824"},
		{"oob", "", "outside memory"},
		{"badcode", "", "unknown decision code 7"},
		{"guesterr", "", "cannot parse"},
		{"badalloc", "", "outside memory"},
		{"import", "imports host function env.open_host_file", "disabled"},
		{"notwasm", "not a WASM module", "disabled"},
		{"abi99", "unsupported policy ABI version 99", "disabled"},
		{"noexport", `missing export "rewind_classify"`, "disabled"},
		{"initloop", "instantiate", "disabled"},
		{"hugemem", "", "disabled"}, // rejected at compile or instantiate
	}
	// Calls get 500 ms, not 5 ms: a trap must be reported as a trap even if
	// a loaded CI machine stalls the call (TestDefaultDeadline covers 5 ms).
	h, logs := newTestHost(t, Options{Timeout: 500 * time.Millisecond, InitTimeout: 2 * time.Second, MaxFailures: 3})
	ctx := context.Background()
	for _, tt := range tests {
		t.Run(tt.module, func(t *testing.T) {
			p, err := h.Load(ctx, tt.module, hostile(t, tt.module))
			if p == nil {
				t.Fatal("Load returned a nil policy")
			}
			defer p.Close(ctx)
			switch {
			case tt.loadErr != "" && (err == nil || !strings.Contains(err.Error(), tt.loadErr)):
				t.Fatalf("Load error = %v, want it to contain %q", err, tt.loadErr)
			case tt.loadErr == "" && tt.module != "hugemem" && err != nil:
				t.Fatalf("Load: %v", err)
			}
			for i := range sampleReports {
				start := time.Now()
				d, err := p.Decide(ctx, &sampleReports[i])
				if err != nil {
					t.Fatalf("Decide returned an error: %v", err)
				}
				if d.Mode != Full || !d.Fallback {
					t.Fatalf("turn %d: decision %+v, want a full fallback", i+1, d)
				}
				if i == 0 && !strings.Contains(d.Reason, tt.reason) {
					t.Fatalf("reason %q, want it to contain %q", d.Reason, tt.reason)
				}
				if strings.Contains(d.Reason, "\n") {
					t.Fatalf("reason spans lines (a guest stack trace belongs in the log): %q", d.Reason)
				}
				t.Logf("turn %d: %v in %v: %s", i+1, d.Mode, time.Since(start), d.Reason)
			}
			disabled, why := p.Disabled()
			if !disabled {
				t.Fatalf("policy not disabled after %d failures", len(sampleReports))
			}
			if err == nil && !strings.Contains(why, "3 consecutive failures") {
				t.Fatalf("disabled reason %q", why)
			}
		})
	}
	if !strings.Contains(logs.String(), "policy disabled") {
		t.Fatalf("no 'policy disabled' log line:\n%s", logs.String())
	}
	// Every failure kind was counted, per policy. (A module that could not
	// be loaded keeps no series once closed: TestFailedLoadLeavesNoSeries.)
	reg := prometheus.NewRegistry()
	reg.MustRegister(h.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	kinds := map[string]bool{}
	disabled := 0.0
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			labels := map[string]string{}
			for _, l := range m.GetLabel() {
				labels[l.GetName()] = l.GetValue()
			}
			switch mf.GetName() {
			case "rewind_policy_failures_total":
				kinds[labels["kind"]] = true
			case "rewind_policy_disabled":
				disabled += m.GetGauge().GetValue()
			}
		}
	}
	for _, k := range []string{"deadline", "trap", "exit", "malformed", "guest_error"} {
		if !kinds[k] {
			t.Errorf("no failure of kind %q counted (got %v)", k, kinds)
		}
	}
	if kinds["load"] {
		t.Errorf("failures of kind load still counted after their policies were closed")
	}
	loaded := 0
	for _, tt := range tests {
		if tt.loadErr == "" && tt.module != "hugemem" {
			loaded++
		}
	}
	if int(disabled) != loaded {
		t.Errorf("rewind_policy_disabled sums to %v, want %d (the modules that loaded)", disabled, loaded)
	}
	checkHealthy(t, h)
}

func TestLostEventsNeverSkip(t *testing.T) {
	h, _ := newTestHost(t, Options{Timeout: 10 * time.Second})
	ctx := context.Background()
	p, err := h.Load(ctx, "skip", hostile(t, "skip"))
	if err != nil {
		t.Fatal(err)
	}
	d, _ := p.Decide(ctx, &effect.Report{Turn: 1})
	if d.Mode != Skip || d.Reason != "ok" || d.Fallback {
		t.Fatalf("without lost events: %+v", d)
	}
	d, _ = p.Decide(ctx, &effect.Report{Turn: 2, LostEvents: 1})
	if d.Mode != Full || !d.Fallback || !strings.Contains(d.Reason, "lost 1 events") {
		t.Fatalf("with lost events: %+v", d)
	}
	if dis, _ := p.Disabled(); dis {
		t.Fatal("an override must not count as a failure")
	}
}

func TestFailuresResetOnSuccess(t *testing.T) {
	// A policy that fails on every other call is never disabled: only
	// consecutive failures count. guesterr fails always; alternate it with
	// successes by sharing the counter through a tiny wrapper.
	h, _ := newTestHost(t, Options{MaxFailures: 2, Timeout: 10 * time.Second})
	ctx := context.Background()
	p, err := h.LoadBuiltin(ctx, "effects")
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < 5; i++ {
		p.fail(ctx, &failure{kind: "trap", err: os.ErrInvalid})
		if _, err := p.Decide(ctx, &effect.Report{}); err != nil {
			t.Fatal(err)
		}
	}
	if dis, why := p.Disabled(); dis {
		t.Fatalf("disabled: %s", why)
	}
	p.fail(ctx, &failure{kind: "trap", err: os.ErrInvalid})
	p.fail(ctx, &failure{kind: "trap", err: os.ErrInvalid})
	if dis, _ := p.Disabled(); !dis {
		t.Fatal("not disabled after 2 consecutive failures")
	}
	d, _ := p.Decide(ctx, &effect.Report{})
	if d.Mode != Full || !d.Fallback || !strings.Contains(d.Reason, "disabled") {
		t.Fatalf("disabled policy decided %+v", d)
	}
}

func TestBadInputs(t *testing.T) {
	h, _ := newTestHost(t, Options{})
	ctx := context.Background()
	p, err := h.LoadRef(ctx, "no-such-policy.wasm")
	if err == nil || p == nil {
		t.Fatalf("LoadRef of a missing file: %v, %v", p, err)
	}
	if d, _ := p.Decide(ctx, &effect.Report{}); d.Mode != Full || !d.Fallback {
		t.Fatalf("missing file policy decided %+v", d)
	}
	if _, err := h.LoadBuiltin(ctx, "nope"); err == nil || !strings.Contains(err.Error(), "unknown built-in policy") {
		t.Fatalf("unknown builtin: %v", err)
	}
	good, err := h.LoadRef(ctx, "always")
	if err != nil {
		t.Fatal(err)
	}
	if _, err := good.Decide(ctx, nil); err == nil {
		t.Fatal("nil report accepted")
	}
	good.Close(ctx)
	if d, err := good.Decide(ctx, &effect.Report{}); err == nil || d.Mode != Full {
		t.Fatalf("closed policy: %+v, %v", d, err)
	}
	if _, err := NewHost(ctx, Options{MemoryLimitBytes: 8 << 30}); err == nil {
		t.Fatal("8 GiB memory limit accepted")
	}
}

func TestCallerCancelDoesNotDisable(t *testing.T) {
	h, _ := newTestHost(t, Options{MaxFailures: 1, MaxInstances: 1})
	p, err := h.Load(context.Background(), "loop", hostile(t, "loop"))
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithCancel(context.Background())
	cancel()
	d, _ := p.Decide(ctx, &effect.Report{})
	if d.Mode != Full || !d.Fallback {
		t.Fatalf("%+v", d)
	}
	if dis, why := p.Disabled(); dis {
		t.Fatalf("a caller's cancellation disabled the policy: %s", why)
	}
}

func TestConcurrentDecisions(t *testing.T) {
	// The wall-clock deadline is generous here: this test is about races and
	// pooling, and a loaded 2-core CI machine may deschedule a call for
	// longer than 5 ms.
	h, _ := newTestHost(t, Options{Timeout: 10 * time.Second})
	ctx := context.Background()
	ps := map[string]*Policy{}
	for _, n := range BuiltinNames() {
		p, err := h.LoadBuiltin(ctx, n)
		if err != nil {
			t.Fatal(err)
		}
		ps[n] = p
	}
	const total, workers = 10000, 32
	var wg sync.WaitGroup
	errs := make(chan string, workers)
	for w := 0; w < workers; w++ {
		wg.Add(1)
		go func(w int) {
			defer wg.Done()
			names := BuiltinNames()
			for i := w; i < total; i += workers {
				r := sampleReports[i%len(sampleReports)]
				r.Turn = uint64(i)
				name := names[i%len(names)]
				rule, _ := rules.ByName(name)
				want, wantReason := rule(&r)
				d, err := ps[name].Decide(ctx, &r)
				if err != nil || d.Fallback || d.Mode != fromGuest(want) || d.Reason != wantReason {
					errs <- name + ": " + d.Mode.String() + " " + d.Reason
					return
				}
			}
		}(w)
	}
	wg.Wait()
	close(errs)
	for e := range errs {
		t.Error(e)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(h.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	var decisions float64
	for _, mf := range mfs {
		if mf.GetName() == "rewind_policy_decisions_total" {
			for _, m := range mf.GetMetric() {
				decisions += m.GetCounter().GetValue()
			}
		}
	}
	if decisions != total {
		t.Fatalf("decisions_total = %v, want %d", decisions, total)
	}
}

func TestOverlappingDeadlinesCountOnce(t *testing.T) {
	h, _ := newTestHost(t, Options{MaxFailures: 2})
	ctx := context.Background()
	p, err := h.LoadBuiltin(ctx, "always")
	if err != nil {
		t.Fatal(err)
	}
	// Three calls that all started before the first failure was counted
	// (one host stall): they count once.
	start := time.Now()
	for i := 0; i < 3; i++ {
		p.fail(ctx, &failure{kind: "deadline", err: os.ErrDeadlineExceeded, start: start})
	}
	if dis, why := p.Disabled(); dis {
		t.Fatalf("one stall disabled the policy: %s", why)
	}
	// A later call that fails by deadline again is a second failure.
	p.fail(ctx, &failure{kind: "deadline", err: os.ErrDeadlineExceeded, start: time.Now()})
	if dis, _ := p.Disabled(); !dis {
		t.Fatal("not disabled after two sequential deadline failures")
	}
}

func TestMemoryLimit(t *testing.T) {
	for _, tt := range []struct {
		limit uint64
		want  Mode
	}{{0, Skip}, {8 << 20, FS}} { // default 16 MiB = 256 pages; 8 MiB = 128
		h, _ := newTestHost(t, Options{MemoryLimitBytes: tt.limit, Timeout: 10 * time.Second})
		p, err := h.Load(context.Background(), "memlimit", hostile(t, "memlimit"))
		if err != nil {
			t.Fatal(err)
		}
		d, _ := p.Decide(context.Background(), &effect.Report{})
		if d.Mode != tt.want || d.Fallback {
			t.Errorf("limit %d: %+v, want %v", tt.limit, d, tt.want)
		}
	}
}

// TestDefaultDeadline runs an infinite loop under the default 5 ms deadline:
// the call is stopped, the decision is a full fallback, and the host goes on.
func TestDefaultDeadline(t *testing.T) {
	h, _ := newTestHost(t, Options{})
	ctx := context.Background()
	p, err := h.Load(ctx, "loop", hostile(t, "loop"))
	if err != nil {
		t.Fatal(err)
	}
	for i := 0; i < DefaultMaxFailures+1; i++ {
		d, err := p.Decide(ctx, &effect.Report{Turn: uint64(i)})
		if err != nil || d.Mode != Full || !d.Fallback {
			t.Fatalf("call %d: %+v, %v", i, d, err)
		}
		if i == 0 && !strings.Contains(d.Reason, "deadline") {
			t.Fatalf("reason %q", d.Reason)
		}
		t.Logf("call %d: %v: %s", i, d.Latency, d.Reason)
	}
	if dis, why := p.Disabled(); !dis || !strings.Contains(why, "5 consecutive failures") {
		t.Fatalf("disabled %v: %q", dis, why)
	}
}

// TestFailedLoadLeavesNoSeries: a module that could not be loaded, once
// closed, leaves no metric series behind under its name (any path a client
// sent, so the series would grow without bound), nor reads as a disabled
// policy; a loaded policy of another name keeps its own.
func TestFailedLoadLeavesNoSeries(t *testing.T) {
	h, _ := newTestHost(t, Options{})
	ctx := context.Background()
	good, err := h.LoadRef(ctx, "effects")
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close(ctx)
	for _, ref := range []string{"/no/such/policy.wasm", filepath.Join(t.TempDir(), "garbage.wasm")} {
		if strings.HasSuffix(ref, "garbage.wasm") {
			if err := os.WriteFile(ref, []byte("not wasm"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		p, err := h.LoadRef(ctx, ref)
		if err == nil {
			t.Fatalf("%s loaded", ref)
		}
		p.Close(ctx)
	}
	reg := prometheus.NewRegistry()
	reg.MustRegister(h.Collector())
	mfs, err := reg.Gather()
	if err != nil {
		t.Fatal(err)
	}
	seen := map[string]bool{}
	for _, mf := range mfs {
		for _, m := range mf.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "policy" {
					seen[l.GetValue()] = true
				}
			}
		}
	}
	if !seen["effects"] {
		t.Errorf("the loaded policy has no series (series of %v)", seen)
	}
	for name := range seen {
		if name != "effects" {
			t.Errorf("a series is left for %q, which never loaded", name)
		}
	}
}

// TestLoadRefUnknownNameListsBuiltins: a name that is neither a built-in
// nor a file says which built-ins there are.
func TestLoadRefUnknownNameListsBuiltins(t *testing.T) {
	h, _ := newTestHost(t, Options{})
	p, err := h.LoadRef(context.Background(), "nope")
	if err == nil {
		t.Fatal("an unknown policy name loaded")
	}
	p.Close(context.Background())
	for _, name := range BuiltinNames() {
		if !strings.Contains(err.Error(), name) {
			t.Errorf("error %q does not name the built-in %q", err, name)
		}
	}
}

// TestLoadFileRefusesNonRegular: a policy path that is a device, a FIFO,
// a directory or a file larger than a module may be is refused at once
// (/dev/zero was read without end, taking the daemon's memory; a FIFO
// made the load wait for a writer).
func TestLoadFileRefusesNonRegular(t *testing.T) {
	h, _ := newTestHost(t, Options{})
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo.wasm")
	if err := syscall.Mkfifo(fifo, 0o600); err != nil {
		t.Fatal(err)
	}
	big := filepath.Join(dir, "big.wasm")
	f, err := os.Create(big)
	if err != nil {
		t.Fatal(err)
	}
	if err := f.Truncate(MaxModuleBytes + 1); err != nil {
		t.Fatal(err)
	}
	f.Close()
	for path, want := range map[string]string{
		"/dev/zero": "not a regular file",
		fifo:        "not a regular file",
		dir:         "not a regular file",
		big:         "more than a policy module may be",
	} {
		done := make(chan error, 1)
		go func() {
			p, err := h.LoadFile(context.Background(), path)
			p.Close(context.Background())
			done <- err
		}()
		select {
		case err := <-done:
			if err == nil || !strings.Contains(err.Error(), want) {
				t.Errorf("LoadFile(%s): %v, want %q", path, err, want)
			}
		case <-time.After(10 * time.Second):
			t.Fatalf("LoadFile(%s) did not return", path)
		}
	}
}
