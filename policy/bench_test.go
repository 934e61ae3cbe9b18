package policy

import (
	"context"
	"io"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policies"
	"github.com/rewind-sandbox/rewind/policies/rules"
)

// benchReport is a typical turn: files written, a transient child, samples.
var benchReport = effect.Report{
	Version: 1, Sandbox: "sb-bench", Turn: 12, Backend: effect.BackendEBPF, DurationUS: 41000,
	FS: effect.FS{Modified: 2, Created: 1, BytesWritten: 4096, UpperNonEmpty: true,
		Samples: []effect.PathSample{{Op: "modify", Path: "/src/app.py"}, {Op: "create", Path: "/src/test_app.py"}}},
	Proc: effect.Proc{Forked: 1, Execs: 1, Exited: 1, Alive: 2,
		ExecSamples: []effect.Exec{{PID: 77, Comm: "sed", Argv0: "sed"}}},
	Mem: effect.Mem{Exact: true},
}

// quantiles returns the p50 and p99 of ds.
func quantiles(ds []time.Duration) (p50, p99 time.Duration) {
	slices.Sort(ds)
	return ds[len(ds)/2], ds[len(ds)*99/100]
}

// BenchmarkDecide measures the per-decision latency of each built-in policy
// after warm-up (one goroutine, so one warm instance), and the same rule as a
// native Go function in the same run. It reports p50/p99 of both and their
// ratio. Targets: p50 <= 20 µs, p99 <= 200 µs.
func BenchmarkDecide(b *testing.B) {
	ctx := context.Background()
	h, err := NewHost(ctx, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil))})
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close(ctx)
	for _, name := range BuiltinNames() {
		b.Run(name, func(b *testing.B) {
			p, err := h.LoadBuiltin(ctx, name)
			if err != nil {
				b.Fatal(err)
			}
			rule, _ := rules.ByName(name)
			r := benchReport
			for i := 0; i < 2000; i++ { // warm-up: buffers allocated, guest heap settled
				_, _ = p.Decide(ctx, &r)
			}
			const samples = 20000
			wasm := make([]time.Duration, 0, samples)
			native := make([]time.Duration, 0, samples)
			fallbacks := 0
			b.ResetTimer()
			for b.Loop() {
				wasm, native = wasm[:0], native[:0]
				for i := 0; i < samples; i++ {
					t0 := time.Now()
					d, _ := p.Decide(ctx, &r)
					t1 := time.Now()
					nd, _ := rule(&r)
					t2 := time.Now()
					if d.Fallback {
						// A missed deadline (a host stall past the
						// wall cap) is counted and kept in the
						// distribution.
						fallbacks++
					} else if d.Mode != fromGuest(nd) {
						b.Fatalf("decision %+v, native %d", d, nd)
					}
					wasm = append(wasm, t1.Sub(t0))
					native = append(native, t2.Sub(t1))
				}
			}
			b.StopTimer()
			w50, w99 := quantiles(wasm)
			n50, n99 := quantiles(native)
			b.ReportMetric(float64(w50.Nanoseconds()), "p50-ns")
			b.ReportMetric(float64(w99.Nanoseconds()), "p99-ns")
			b.ReportMetric(float64(n50.Nanoseconds()), "native-p50-ns")
			b.ReportMetric(float64(n99.Nanoseconds()), "native-p99-ns")
			b.ReportMetric(float64(w50)/float64(max(n50, 1)), "p50-ratio")
			b.ReportMetric(float64(fallbacks), "fallbacks")
			b.Logf("%s: wasm p50 %v p99 %v | native p50 %v p99 %v | ratio p50 %.0fx | %d deadline fallbacks (target p50 <= 20µs, p99 <= 200µs)",
				name, w50, w99, n50, n99, float64(w50)/float64(max(n50, 1)), fallbacks)
		})
	}
}

// BenchmarkDecideParallel measures throughput with every core deciding. It
// reports the fraction of decisions that fell back to full because a call
// missed its deadline (5 ms of CPU time, 100 ms of wall time).
func BenchmarkDecideParallel(b *testing.B) {
	ctx := context.Background()
	h, err := NewHost(ctx, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxFailures: 1 << 30})
	if err != nil {
		b.Fatal(err)
	}
	defer h.Close(ctx)
	p, err := h.LoadBuiltin(ctx, policies.Default)
	if err != nil {
		b.Fatal(err)
	}
	var fallbacks, total atomic.Int64
	b.RunParallel(func(pb *testing.PB) {
		r := benchReport
		for pb.Next() {
			total.Add(1)
			if d, _ := p.Decide(ctx, &r); d.Fallback {
				fallbacks.Add(1)
			}
		}
	})
	b.ReportMetric(float64(fallbacks.Load())/float64(max(total.Load(), 1)), "fallback-ratio")
}

// BenchmarkLoad measures loading the default policy: "cold" compiles in a
// fresh runtime with an empty on-disk cache (the baseline), "disk-cache" in a
// fresh runtime whose compilation cache directory is warm (a daemon
// restart), and "host-cache" on a Host that compiled the module already (a
// second sandbox using the same policy). Every case includes instantiating
// the first instance (Go runtime initialisation); disk-cache reports its
// compile (wazero decodes and validates the whole module, then reads the
// cached machine code) and instantiate phases; disk-cache-wat is the same
// for a 625-byte module. Target: <= 5 ms from cache.
func BenchmarkLoad(b *testing.B) {
	ctx := context.Background()
	quiet := slog.New(slog.NewTextHandler(io.Discard, nil))
	load := func(b *testing.B, h *Host) {
		p, err := h.LoadBuiltin(ctx, policies.Default)
		if err != nil {
			b.Fatal(err)
		}
		p.Close(ctx)
	}
	b.Run("cold", func(b *testing.B) {
		for b.Loop() {
			h, err := NewHost(ctx, Options{CacheDir: b.TempDir(), Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			load(b, h)
			_ = h.Close(ctx)
		}
	})
	b.Run("disk-cache", func(b *testing.B) {
		dir := b.TempDir()
		h, err := NewHost(ctx, Options{CacheDir: dir, Logger: quiet})
		if err != nil {
			b.Fatal(err)
		}
		load(b, h) // fill the cache
		_ = h.Close(ctx)
		wasm, _ := policies.WASM(policies.Default)
		var compile, inst, compileCPU, instCPU []time.Duration
		for b.Loop() {
			h, err := NewHost(ctx, Options{CacheDir: dir, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			// What LoadBuiltin does, phase by phase.
			c0, t0 := cpuTime(), time.Now()
			cm, err := h.compile(ctx, "builtin:"+policies.Default, wasm)
			if err != nil {
				b.Fatal(err)
			}
			c1, t1 := cpuTime(), time.Now()
			p := h.newPolicy(policies.Default, cm)
			p.tokens <- struct{}{}
			in, err := p.instantiate(ctx)
			if err != nil {
				b.Fatal(err)
			}
			c2, t2 := cpuTime(), time.Now()
			compile, inst = append(compile, t1.Sub(t0)), append(inst, t2.Sub(t1))
			compileCPU, instCPU = append(compileCPU, c1-c0), append(instCPU, c2-c1)
			p.put(in)
			p.Close(ctx)
			_ = h.Close(ctx)
		}
		c50, _ := quantiles(compile)
		i50, _ := quantiles(inst)
		cc50, _ := quantiles(compileCPU)
		ic50, _ := quantiles(instCPU)
		b.ReportMetric(float64((c50 + i50).Microseconds()), "load-µs")
		b.ReportMetric(float64(c50.Microseconds()), "compile-µs")
		b.ReportMetric(float64(i50.Microseconds()), "instantiate-µs")
		b.ReportMetric(float64(cc50.Microseconds()), "compile-cpu-µs")
		b.ReportMetric(float64(ic50.Microseconds()), "instantiate-cpu-µs")
		b.Logf("from the disk cache: compile p50 %v (CPU %v) + instantiate p50 %v (CPU %v) = %v (target <= 5 ms)", c50, cc50, i50, ic50, c50+i50)
	})
	// The same daemon-restart case for a small module (the hand-written WAT
	// example, 625 bytes): what decoding and validating cost when there is
	// no Go runtime in the module.
	b.Run("disk-cache-wat", func(b *testing.B) {
		wat, err := os.ReadFile("../examples/policy-wat/policy.wasm")
		if err != nil {
			b.Fatal(err)
		}
		dir := b.TempDir()
		var loads []time.Duration
		loadWAT := func() {
			h, err := NewHost(ctx, Options{CacheDir: dir, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			t0 := time.Now()
			p, err := h.Load(ctx, "wat", wat)
			loads = append(loads, time.Since(t0))
			if err != nil {
				b.Fatal(err)
			}
			p.Close(ctx)
			_ = h.Close(ctx)
		}
		loadWAT() // fill the cache
		loads = loads[:0]
		for b.Loop() {
			loadWAT()
		}
		l50, _ := quantiles(loads)
		b.ReportMetric(float64(l50.Microseconds()), "load-µs")
	})
	b.Run("host-cache", func(b *testing.B) {
		h, err := NewHost(ctx, Options{Logger: quiet})
		if err != nil {
			b.Fatal(err)
		}
		defer h.Close(ctx)
		load(b, h)
		for b.Loop() {
			load(b, h)
		}
	})
}

// BenchmarkInstantiate measures creating one instance of the default policy
// (what Load, a growing pool and every failure cost): as the host does it
// (data segments merged, linear memory reserved), with wazero's own memory
// allocation, and the baseline: the module as Go's linker writes it (built
// in the same run) with wazero's allocation. The variants alternate in one
// loop so they see the same machine load; it reports wall and CPU time p50
// and the baseline's ratio to the host's way.
func BenchmarkInstantiate(b *testing.B) {
	ctx := context.Background()
	out := filepath.Join(b.TempDir(), "linker.wasm")
	build := exec.Command("go", "build", "-buildmode=c-shared", "-trimpath", "-ldflags=-s -w -buildid=", "-o", out, "./src/"+policies.Default)
	build.Dir = "../policies"
	build.Env = append(os.Environ(), "GOOS=wasip1", "GOARCH=wasm", "CGO_ENABLED=0")
	if msg, err := build.CombinedOutput(); err != nil {
		b.Fatalf("go build: %v\n%s", err, msg)
	}
	linker, err := os.ReadFile(out)
	if err != nil {
		b.Fatal(err)
	}
	merged, _ := policies.WASM(policies.Default)
	type variant struct {
		name      string
		h         *Host
		p         *Policy
		wall, cpu []time.Duration
	}
	var vs []*variant
	for _, m := range []struct {
		name    string
		wasm    []byte
		reserve bool
	}{{"host", merged, true}, {"merged", merged, false}, {"linker-output", linker, false}} {
		h, err := NewHost(ctx, Options{Logger: slog.New(slog.NewTextHandler(io.Discard, nil)), MaxInstances: 1})
		if err != nil {
			b.Fatal(err)
		}
		defer h.Close(ctx)
		if !m.reserve {
			h.memory = nil
		}
		// Compiled without the host's merge, to measure the bytes as given.
		cm, err := h.rt.CompileModule(ctx, m.wasm)
		if err != nil {
			b.Fatal(err)
		}
		vs = append(vs, &variant{name: m.name, h: h, p: h.newPolicy(m.name, cm)})
	}
	for b.Loop() {
		for _, v := range vs {
			v.p.tokens <- struct{}{}
			c0, t0 := cpuTime(), time.Now()
			in, err := v.p.instantiate(ctx)
			v.wall, v.cpu = append(v.wall, time.Since(t0)), append(v.cpu, cpuTime()-c0)
			if err != nil {
				b.Fatal(err)
			}
			v.p.drop(ctx, in)
		}
	}
	w50, c50 := make([]time.Duration, len(vs)), make([]time.Duration, len(vs))
	for i, v := range vs {
		v.p.Close(ctx)
		w50[i], _ = quantiles(v.wall)
		c50[i], _ = quantiles(v.cpu)
		b.ReportMetric(float64(w50[i].Microseconds()), v.name+"-p50-µs")
		b.ReportMetric(float64(c50[i].Microseconds()), v.name+"-cpu-p50-µs")
	}
	ratio := func(d []time.Duration, i int) float64 { return float64(d[i]) / float64(max(d[0], 1)) }
	b.ReportMetric(ratio(w50, 2), "ratio")
	b.Logf("instantiate p50 (CPU): host %v (%v) | merged, wazero memory %v (%v) | linker output, wazero memory %v (%v): host %.1fx faster than the linker output (CPU %.1fx)",
		w50[0], c50[0], w50[1], c50[1], w50[2], c50[2], ratio(w50, 2), ratio(c50, 2))
}
