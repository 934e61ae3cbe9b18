package policy

import (
	"context"
	"io"
	"log/slog"
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
						// A missed wall-clock deadline (host stall) is
						// counted and kept in the distribution.
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
// missed its 5 ms wall-clock deadline (on a loaded VM the OS alone stalls a
// thread for several ms now and then).
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
// the first instance (Go runtime initialisation). Target: <= 5 ms from cache.
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
		var total time.Duration
		n := 0
		for b.Loop() {
			h, err := NewHost(ctx, Options{CacheDir: dir, Logger: quiet})
			if err != nil {
				b.Fatal(err)
			}
			t0 := time.Now()
			load(b, h)
			total += time.Since(t0)
			n++
			_ = h.Close(ctx)
		}
		b.ReportMetric(float64(total.Microseconds())/float64(n), "load-µs")
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
