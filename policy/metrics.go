package policy

import "github.com/prometheus/client_golang/prometheus"

// metrics are the Host's Prometheus metrics. They are not registered
// anywhere: the daemon registers Host.Collector() in its own registry.
type metrics struct {
	decisions *prometheus.CounterVec
	failures  *prometheus.CounterVec
	disabled  *prometheus.GaugeVec
	latency   *prometheus.HistogramVec
	load      *prometheus.HistogramVec
}

func newMetrics() *metrics {
	return &metrics{
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "rewind_policy_decisions_total",
			Help: "Checkpoint decisions made, by policy and mode (fallbacks included).",
		}, []string{"policy", "mode"}),
		failures: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "rewind_policy_failures_total",
			Help: "Policy failures that made the host fall back to a full checkpoint, by kind.",
		}, []string{"policy", "kind"}),
		disabled: prometheus.NewGaugeVec(prometheus.GaugeOpts{
			Name: "rewind_policy_disabled",
			Help: "1 when the policy is disabled (every turn gets a full checkpoint).",
		}, []string{"policy"}),
		latency: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "rewind_policy_decide_seconds",
			Help:    "Latency of policy decisions.",
			Buckets: []float64{5e-6, 1e-5, 2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 5e-3, 2e-2},
		}, []string{"policy"}),
		load: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name:    "rewind_policy_load_seconds",
			Help:    "Time to load a policy (compile, validate, first instance), by source: compile (the module was compiled, or read from the on-disk compilation cache) or host (this host compiled it before).",
			Buckets: []float64{1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.5, 1, 2, 5},
		}, []string{"policy", "source"}),
	}
}

// Describe implements prometheus.Collector.
func (m *metrics) Describe(ch chan<- *prometheus.Desc) {
	m.decisions.Describe(ch)
	m.failures.Describe(ch)
	m.disabled.Describe(ch)
	m.latency.Describe(ch)
	m.load.Describe(ch)
}

// Collect implements prometheus.Collector.
func (m *metrics) Collect(ch chan<- prometheus.Metric) {
	m.decisions.Collect(ch)
	m.failures.Collect(ch)
	m.disabled.Collect(ch)
	m.latency.Collect(ch)
	m.load.Collect(ch)
}

// policyMetrics are one policy's pre-resolved children, so the hot path does
// no label lookup.
type policyMetrics struct {
	m         *metrics
	name      string
	decisions [3]prometheus.Counter // indexed by Mode
	latency   prometheus.Observer
	disabled  prometheus.Gauge
}

func (m *metrics) forPolicy(name string) *policyMetrics {
	pm := &policyMetrics{m: m, name: name,
		latency:  m.latency.WithLabelValues(name),
		disabled: m.disabled.WithLabelValues(name),
	}
	for _, mode := range []Mode{Full, FS, Skip} {
		pm.decisions[mode] = m.decisions.WithLabelValues(name, mode.String())
	}
	pm.disabled.Set(0)
	return pm
}

// forget drops the series of policy name.
func (m *metrics) forget(name string) {
	m.latency.DeleteLabelValues(name)
	m.disabled.DeleteLabelValues(name)
	m.decisions.DeletePartialMatch(prometheus.Labels{"policy": name})
	m.failures.DeletePartialMatch(prometheus.Labels{"policy": name})
}

func (pm *policyMetrics) failure(kind string) { pm.m.failures.WithLabelValues(pm.name, kind).Inc() }
