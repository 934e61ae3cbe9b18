package bench

import (
	"fmt"
	"html"
	"io"
	"sort"
	"strings"
)

// Report is the outcome of a benchmark run: one row per system, aggregated
// over every trace.
type Report struct {
	Kind string `json:"kind"`
	// Machine describes the host (see Machine); the command sets it.
	Machine string    `json:"machine,omitempty"`
	Command string    `json:"command,omitempty"`
	Traces  []string  `json:"traces,omitempty"`
	Systems []*Result `json:"systems"`
	// BestBaseline names the baseline with the least state-management time
	// and Speedup is its state time over rewind-effects' (>1: rewind wins).
	BestBaseline string  `json:"best_baseline,omitempty"`
	Speedup      float64 `json:"speedup_vs_best_baseline,omitempty"`
	// BestRecovering and SpeedupVsRecovering are the same comparison
	// restricted to the baselines that recovered every injected crash
	// exactly, as rewind-effects must (a baseline that keeps files only
	// loses the processes' state and does less work).
	BestRecovering      string  `json:"best_recovering_baseline,omitempty"`
	SpeedupVsRecovering float64 `json:"speedup_vs_best_recovering_baseline,omitempty"`
	// SpeedupRounds is Speedup round by round, when every system ran more
	// than once (--repeat): BestBaseline's state time in a round over
	// rewind-effects' in the same round (0 for a round where either
	// failed). The two ran minutes apart at most, so a machine that slows
	// down or speeds up between rounds moves both; Speedup compares two
	// medians, which may come from different rounds.
	SpeedupRounds []float64 `json:"speedup_rounds,omitempty"`
	// Targets are issue 10's targets judged on this run (set by compare).
	Targets []Verdict `json:"targets,omitempty"`
	Notes   []string  `json:"notes,omitempty"`
}

// merge adds b (another trace of the same system) into a.
func merge(a, b *Result) {
	a.Nodes += b.Nodes
	a.LLMMS += b.LLMMS
	a.ExecMS += b.ExecMS
	a.StateMS += b.StateMS
	a.StateMSZeroLLM += b.StateMSZeroLLM
	a.FrozenMS += b.FrozenMS
	a.CrashChecks += b.CrashChecks
	a.CrashCorrect += b.CrashCorrect
	a.Usage.DiskBytes = max(a.Usage.DiskBytes, b.Usage.DiskBytes)
	a.Usage.MemBytes = max(a.Usage.MemBytes, b.Usage.MemBytes)
	for k, v := range b.Decisions {
		if a.Decisions == nil {
			a.Decisions = map[string]int{}
		}
		a.Decisions[k] += v
	}
	// Percentiles cannot be merged exactly: keep the worst trace's.
	a.P50MS, a.P99MS = max(a.P50MS, b.P50MS), max(a.P99MS, b.P99MS)
	a.Checkpoint = worst(a.Checkpoint, b.Checkpoint)
	for k, v := range b.Phases {
		if a.Phases == nil {
			a.Phases = map[string]Latency{}
		}
		a.Phases[k] = worst(a.Phases[k], v)
	}
	a.Restore = worst(a.Restore, b.Restore)
	if a.Error == "" {
		a.Error = b.Error
	}
	a.Trace += "," + b.Trace
	finish(a)
}

func worst(a, b Latency) Latency {
	return Latency{N: a.N + b.N, P50MS: max(a.P50MS, b.P50MS), P99MS: max(a.P99MS, b.P99MS), SumMS: a.SumMS + b.SumMS}
}

func finish(r *Result) {
	if base := r.LLMMS + r.ExecMS; base > 0 {
		r.OverheadRatio = (base + r.StateMS) / base
	}
	if r.ExecMS > 0 {
		r.OverheadRatioZeroLLM = (r.ExecMS + r.StateMSZeroLLM) / r.ExecMS
	}
	r.RecoveryCorrectness = 1
	if r.CrashChecks > 0 {
		r.RecoveryCorrectness = float64(r.CrashCorrect) / float64(r.CrashChecks)
	}
}

// compare fills BestBaseline and Speedup, the same against the fastest
// recovering baseline, and Targets.
func (rep *Report) compare() { rep.compareRuns(nil) }

// compareRuns is compare with every run of each system, in round order
// (RunMCTS's), from which it also fills SpeedupRounds.
func (rep *Report) compareRuns(runs map[string][]*Result) {
	defer func() {
		if rep.BestBaseline != "" {
			rep.SpeedupRounds = roundSpeedups(runs[rep.BestBaseline], runs["rewind-effects"])
		}
		rep.Targets = rep.judge()
	}()
	var rw, best, rec *Result
	for _, s := range rep.Systems {
		if s.Error != "" {
			continue
		}
		if s.Name == "rewind-effects" {
			rw = s
			continue
		}
		if strings.HasPrefix(s.Name, "rewind-") {
			continue
		}
		if best == nil || s.StateMS < best.StateMS {
			best = s
		}
		if s.CrashChecks > 0 && s.CrashCorrect == s.CrashChecks && (rec == nil || s.StateMS < rec.StateMS) {
			rec = s
		}
	}
	if rw == nil || rw.StateMS <= 0 {
		return
	}
	if best != nil {
		rep.BestBaseline = best.Name
		rep.Speedup = best.StateMS / rw.StateMS
	}
	if rec != nil {
		rep.BestRecovering = rec.Name
		rep.SpeedupVsRecovering = rec.StateMS / rw.StateMS
	}
}

// roundSpeedups pairs base's runs with rw's by round (index) and returns
// base's state time over rw's for each round, 0 where either run failed;
// nil unless both ran more than once.
func roundSpeedups(base, rw []*Result) []float64 {
	n := min(len(base), len(rw))
	if n < 2 {
		return nil
	}
	out := make([]float64, n)
	for i := range n {
		b, r := base[i], rw[i]
		if b.Error == "" && r.Error == "" && r.StateMS > 0 {
			out[i] = b.StateMS / r.StateMS
		}
	}
	return out
}

// roundsNote renders SpeedupRounds ("" when there are none).
func (rep *Report) roundsNote() string {
	if len(rep.SpeedupRounds) == 0 {
		return ""
	}
	v := make([]string, len(rep.SpeedupRounds))
	for i, x := range rep.SpeedupRounds {
		v[i] = "failed"
		if x > 0 {
			v[i] = fmt.Sprintf("%.1fx", x)
		}
	}
	return "round by round: " + strings.Join(v, " / ")
}

// semi returns "; s", or "" for an empty s.
func semi(s string) string {
	if s == "" {
		return ""
	}
	return "; " + s
}

func mb(b int64) string { return fmt.Sprintf("%.1f", float64(b)/(1<<20)) }

// Markdown renders the report as a Markdown table, after a line naming
// the traces and one describing the machine (when known).
func (rep *Report) Markdown(w io.Writer) {
	if len(rep.Traces) > 0 {
		fmt.Fprintf(w, "traces: %s\n", strings.Join(rep.Traces, "; "))
	}
	if rep.Machine != "" {
		fmt.Fprintf(w, "machine: %s\n", rep.Machine)
	}
	if len(rep.Traces) > 0 || rep.Machine != "" {
		fmt.Fprintln(w)
	}
	fmt.Fprintf(w, "| system | overhead (LLM 2 s median) | overhead (LLM 0) | state ms | p50 ms | p99 ms | restore p50 ms | frozen ms | disk MiB | mem MiB | skip/fs/full | recovery |\n")
	fmt.Fprintf(w, "|---|---|---|---|---|---|---|---|---|---|---|---|\n")
	for _, s := range rep.Systems {
		if s.Error != "" {
			fmt.Fprintf(w, "| %s | error: %s | | | | | | | | | | |\n", s.Name, strings.ReplaceAll(s.Error, "|", "/"))
			continue
		}
		fmt.Fprintf(w, "| %s | %.3fx | %.2fx | %.0f | %.1f | %.1f | %.1f | %.0f | %s | %s | %d/%d/%d | %d/%d |\n",
			s.Name, s.OverheadRatio, s.OverheadRatioZeroLLM, s.StateMS, s.P50MS, s.P99MS, s.Restore.P50MS, s.FrozenMS,
			mb(s.Usage.DiskBytes), mb(s.Usage.MemBytes), s.Decisions["skip"], s.Decisions["fs"], s.Decisions["full"], s.CrashCorrect, s.CrashChecks)
	}
	var spread []string
	runs := 0
	for _, s := range rep.Systems {
		if len(s.StateMSRuns) > 1 {
			runs = max(runs, len(s.StateMSRuns))
			var v []string
			for _, x := range s.StateMSRuns {
				v = append(v, fmt.Sprintf("%.0f", x))
			}
			spread = append(spread, s.Name+" "+strings.Join(v, " / "))
		}
	}
	if len(spread) > 0 {
		fmt.Fprintf(w, "\nEach row is the run with the median state time of up to %d runs per system (the systems' order rotated every run); state ms of every run: %s.\n", runs, strings.Join(spread, "; "))
	}
	switch {
	case rep.BestBaseline != "" && rep.Speedup >= 1:
		fmt.Fprintf(w, "\nrewind-effects spends %.1fx less time on state management than the fastest baseline (%s%s).\n", rep.Speedup, rep.BestBaseline, semi(rep.roundsNote()))
	case rep.BestBaseline != "":
		fmt.Fprintf(w, "\nrewind-effects spends %.1fx more time on state management than the fastest baseline (%s%s).\n", 1/rep.Speedup, rep.BestBaseline, semi(rep.roundsNote()))
	}
	if rep.BestRecovering != "" && rep.BestRecovering != rep.BestBaseline {
		more, x := "less", rep.SpeedupVsRecovering
		if x < 1 {
			more, x = "more", 1/x
		}
		fmt.Fprintf(w, "Against the fastest baseline that recovered every injected crash exactly (%s), rewind-effects spends %.1fx %s time on state management.\n", rep.BestRecovering, x, more)
	}
	WriteVerdicts(w, rep.Targets)
	for _, s := range rep.Systems {
		if len(s.Phases) == 0 || s.Error != "" {
			continue
		}
		fmt.Fprintf(w, "\nWhere %s's time went (calls of the search; \"turn.X\" and \"restore.path.X\" are the calls as the harness saw them, the rest daemon-side phases; checkpoint.* runs asynchronously):\n\n", s.Name)
		fmt.Fprintf(w, "| phase | n | p50 ms | p99 ms | sum ms |\n|---|---|---|---|---|\n")
		keys := make([]string, 0, len(s.Phases))
		for k := range s.Phases {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			l := s.Phases[k]
			fmt.Fprintf(w, "| %s | %d | %.2f | %.2f | %.1f |\n", k, l.N, l.P50MS, l.P99MS, l.SumMS)
		}
	}
	for _, n := range rep.Notes {
		fmt.Fprintf(w, "\n%s\n", n)
	}
}

// SVG renders a horizontal bar chart of state-management time per system.
func (rep *Report) SVG(w io.Writer) {
	rows := append([]*Result(nil), rep.Systems...)
	sort.SliceStable(rows, func(i, j int) bool { return rows[i].StateMS < rows[j].StateMS })
	maxv := 1.0
	for _, r := range rows {
		maxv = max(maxv, r.StateMS)
	}
	const left, width, rowH = 190, 480, 26
	h := 50 + rowH*len(rows)
	fmt.Fprintf(w, `<svg xmlns="http://www.w3.org/2000/svg" width="%d" height="%d" font-family="sans-serif" font-size="12">`+"\n", left+width+120, h)
	fmt.Fprintf(w, `<text x="10" y="20" font-size="14">State-management time over the trace (ms, lower is better)</text>`+"\n")
	for i, r := range rows {
		y := 35 + i*rowH
		bw := int(float64(width) * r.StateMS / maxv)
		color := "#888"
		if strings.HasPrefix(r.Name, "rewind-") {
			color = "#2a7"
		}
		fmt.Fprintf(w, `<text x="%d" y="%d" text-anchor="end">%s</text>`+"\n", left-8, y+15, html.EscapeString(r.Name))
		if r.Error != "" {
			fmt.Fprintf(w, `<text x="%d" y="%d" fill="#a22">error</text>`+"\n", left, y+15)
			continue
		}
		fmt.Fprintf(w, `<rect x="%d" y="%d" width="%d" height="18" fill="%s"/>`+"\n", left, y+2, max(bw, 1), color)
		fmt.Fprintf(w, `<text x="%d" y="%d">%.0f ms (%.3fx)</text>`+"\n", left+max(bw, 1)+6, y+15, r.StateMS, r.OverheadRatio)
	}
	fmt.Fprintln(w, "</svg>")
}
