package daemon

import (
	"time"

	"github.com/prometheus/client_golang/prometheus"

	"github.com/rewind-sandbox/rewind/state"
)

// metrics implements state.Observer with Prometheus collectors.
type metrics struct {
	ckpt       *prometheus.HistogramVec
	frozen     *prometheus.HistogramVec
	ckptFail   *prometheus.CounterVec
	restore    *prometheus.HistogramVec
	restFail   prometheus.Counter
	decisions  *prometheus.CounterVec
	turnCall   *prometheus.HistogramVec
	fork       prometheus.Histogram
	forked     prometheus.Counter
	gcRuns     prometheus.Counter
	gcFreed    prometheus.Counter
	gcDuration prometheus.Histogram
	requests   *prometheus.HistogramVec
}

// Latency buckets from 50 µs to ~13 s.
var latencyBuckets = prometheus.ExponentialBuckets(50e-6, 2, 19)

func newMetrics(reg prometheus.Registerer) *metrics {
	m := &metrics{
		ckpt: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "rewind_checkpoint_seconds", Help: "Time to take a checkpoint (the asynchronous part), by kind.",
			Buckets: latencyBuckets}, []string{"kind"}),
		frozen: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "rewind_checkpoint_frozen_seconds", Help: "Time sandbox processes were stopped for a checkpoint, by kind.",
			Buckets: latencyBuckets}, []string{"kind"}),
		ckptFail: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "rewind_checkpoint_failures_total", Help: "Checkpoints that failed, by kind."}, []string{"kind"}),
		restore: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "rewind_restore_seconds", Help: "Time to restore a sandbox, by process path (template, criu, criu-lazy).",
			Buckets: latencyBuckets}, []string{"path"}),
		restFail: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rewind_restore_failures_total", Help: "Restores that failed (the sandbox was left as it was)."}),
		decisions: prometheus.NewCounterVec(prometheus.CounterOpts{
			Name: "rewind_turn_decisions_total", Help: "Auto-mode turn decisions as the policy made them, by policy and mode (the daemon may then take more: a full checkpoint where the last one failed or no earlier one exists, fs where the writable layer changed unseen; rewind_checkpoint_seconds{kind} counts what was taken)."}, []string{"policy", "mode"}),
		turnCall: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "rewind_turn_call_seconds", Help: "Harness-visible time of a turn call inside the daemon, by decision.",
			Buckets: latencyBuckets}, []string{"decision"}),
		fork: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "rewind_fork_seconds", Help: "Time to fork N sandboxes from a checkpoint.", Buckets: latencyBuckets}),
		forked: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rewind_forked_sandboxes_total", Help: "Sandboxes created by fork."}),
		gcRuns: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rewind_gc_runs_total", Help: "Garbage collections run."}),
		gcFreed: prometheus.NewCounter(prometheus.CounterOpts{
			Name: "rewind_gc_freed_checkpoints_total", Help: "Checkpoints freed by GC."}),
		gcDuration: prometheus.NewHistogram(prometheus.HistogramOpts{
			Name: "rewind_gc_seconds", Help: "Time of a garbage collection.", Buckets: latencyBuckets}),
		requests: prometheus.NewHistogramVec(prometheus.HistogramOpts{
			Name: "rewind_api_request_seconds", Help: "API request latency, by route.", Buckets: latencyBuckets}, []string{"route"}),
	}
	reg.MustRegister(m.ckpt, m.frozen, m.ckptFail, m.restore, m.restFail, m.decisions, m.turnCall,
		m.fork, m.forked, m.gcRuns, m.gcFreed, m.gcDuration, m.requests)
	return m
}

func (m *metrics) Checkpointed(kind state.Mode, took, frozen time.Duration, err error) {
	if err != nil {
		m.ckptFail.WithLabelValues(string(kind)).Inc()
		return
	}
	m.ckpt.WithLabelValues(string(kind)).Observe(took.Seconds())
	m.frozen.WithLabelValues(string(kind)).Observe(frozen.Seconds())
}

func (m *metrics) Restored(path string, took time.Duration, err error) {
	if err != nil {
		m.restFail.Inc()
		return
	}
	m.restore.WithLabelValues(path).Observe(took.Seconds())
}

func (m *metrics) Decided(policy string, mode state.Mode) {
	m.decisions.WithLabelValues(policy, string(mode)).Inc()
}

func (m *metrics) Forked(n int, took time.Duration) {
	m.fork.Observe(took.Seconds())
	m.forked.Add(float64(n))
}

func (m *metrics) Collected(freed int, took time.Duration) {
	m.gcRuns.Inc()
	m.gcFreed.Add(float64(freed))
	m.gcDuration.Observe(took.Seconds())
}

func (m *metrics) turn(decision state.Mode, took time.Duration) {
	m.turnCall.WithLabelValues(string(decision)).Observe(took.Seconds())
}

func (m *metrics) request(route string, took time.Duration) {
	m.requests.WithLabelValues(route).Observe(took.Seconds())
}

// gauges registers gauges computed from the manager at scrape time.
func gauges(reg prometheus.Registerer, mgr *state.Manager) {
	reg.MustRegister(
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_sandboxes", Help: "Sandboxes known to the daemon."},
			func() float64 { return float64(len(mgr.List())) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_pins", Help: "Pinned checkpoints."},
			func() float64 { return float64(len(mgr.Pins())) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_checkpoints", Help: "Checkpoints in the tree."},
			func() float64 { return float64(mgr.Stats().Checkpoints) }),
		prometheus.NewGaugeFunc(prometheus.GaugeOpts{Name: "rewind_checkpoint_bytes", Help: "Bytes held by checkpoints, as the back ends report them."},
			func() float64 { return float64(mgr.Stats().Bytes) }),
		warmCollector{mgr: mgr, desc: prometheus.NewDesc("rewind_warm_forks",
			"Fork children prepared ahead of a repeated fork, ready to hand out, by checkpoint.", []string{"checkpoint"}, nil)},
	)
}

// warmCollector reports the prepared fork children of each checkpoint.
type warmCollector struct {
	mgr  *state.Manager
	desc *prometheus.Desc
}

func (c warmCollector) Describe(ch chan<- *prometheus.Desc) { ch <- c.desc }

func (c warmCollector) Collect(ch chan<- prometheus.Metric) {
	for id, n := range c.mgr.WarmForks() {
		ch <- prometheus.MustNewConstMetric(c.desc, prometheus.GaugeValue, float64(n), id)
	}
}
