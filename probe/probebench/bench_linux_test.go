package probebench

import (
	"os"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/probe"
)

// BenchmarkProbe reports the overhead of each backend on a syscall-heavy
// workload (REWIND_PROBE_BENCH_CMD, default "find /usr -xdev") and End's
// latency. Run: go test -bench Probe -run '^$' -benchtime 1x ./probe/probebench
func BenchmarkProbe(b *testing.B) {
	testenv.RequireRoot(b)
	var wl []string
	if c := os.Getenv("REWIND_PROBE_BENCH_CMD"); c != "" {
		wl = strings.Fields(c)
	}
	for _, c := range []struct {
		name    string
		backend string
		nofs    bool
	}{
		{"ebpf", probe.BackendEBPF, false},
		{"ebpf-syscall-hook", probe.BackendEBPF, true},
		{"userspace", probe.BackendUserspace, false},
	} {
		b.Run(c.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				r, err := Run(Options{Backend: c.backend, Workload: wl, NoFSSource: c.nofs})
				if err != nil {
					b.Fatal(err)
				}
				b.ReportMetric(r.OverheadPct, "overhead-%")
				b.ReportMetric(r.OverheadMinPct, "overhead-min-%")
				b.ReportMetric(r.ProgPct, "prog-%")
				b.ReportMetric(float64(r.ProgRuns), "prog-runs")
				b.ReportMetric(r.OffMS, "off-cpu-ms")
				b.ReportMetric(r.OnMS, "on-cpu-ms")
				b.ReportMetric(r.EndP50US, "end-p50-µs")
				b.ReportMetric(r.EndP99US, "end-p99-µs")
				b.ReportMetric(r.BeginP50US, "begin-p50-µs")
			}
		})
	}
}

// TestRunSmall checks that Run works end to end on a tiny workload.
func TestRunSmall(t *testing.T) {
	testenv.RequireRoot(t)
	for _, be := range []string{probe.BackendEBPF, probe.BackendUserspace} {
		r, err := Run(Options{Backend: be, Workload: []string{"ls", "-R", "/usr/share/doc"}, Rounds: 1, Turns: 5})
		if err != nil {
			t.Fatalf("%s: %v", be, err)
		}
		if r.Backend != be || r.OffMS <= 0 || r.OnMS <= 0 || r.EndP50US <= 0 {
			t.Fatalf("%+v", r)
		}
	}
}
