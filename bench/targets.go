package bench

import (
	"fmt"
	"io"
	"strings"
)

// Verdict is one of the targets rewind's benchmarks are held to, judged
// on one run's numbers.
type Verdict struct {
	// Target says what is measured and the goal.
	Target string `json:"target"`
	// Value is the run's measure, in Unit ("x": a ratio, "ms", "%").
	Value float64 `json:"value"`
	Unit  string  `json:"unit"`
	// Goal is the bound Value must reach (Max: at most; else at least).
	Goal float64 `json:"goal"`
	Max  bool    `json:"at_most,omitempty"`
	// Met reports whether Value reaches Goal.
	Met bool `json:"met"`
	// Note gives what the value is to be read against, if anything.
	Note string `json:"note,omitempty"`
}

func verdict(target string, value, goal float64, atMost bool, unit, note string) Verdict {
	met := value >= goal
	if atMost {
		met = value <= goal
	}
	return Verdict{Target: target, Value: value, Unit: unit, Goal: goal, Max: atMost, Met: met, Note: note}
}

// Targets of the tree-search benchmark (issue 10).
const (
	// maxOverhead bounds rewind-effects' total time over the LLM-only
	// time at median LLM latency 2 s (DeltaBox reports 3-6%).
	maxOverhead = 1.03
	// minSpeedup is how many times less state-management time than the
	// fastest baseline rewind-effects must spend.
	minSpeedup = 10
)

// Targets of the fan-out benchmark (issue 10), at targetForks copies.
const (
	targetForks   = 64
	maxFanoutMS   = 250
	maxWaitFanout = 0.05
)

// judge returns the tree-search targets' verdicts on rep (after compare):
// rewind-effects' overhead at LLM 2 s, its state time against the fastest
// baseline's, and the crash recovery of every rewind row. Targets whose
// rows are missing or failed are left out.
func (rep *Report) judge() []Verdict {
	var out []Verdict
	var rw *Result
	for _, s := range rep.Systems {
		if s.Name == "rewind-effects" && s.Error == "" {
			rw = s
		}
	}
	if rw != nil {
		out = append(out, verdict(fmt.Sprintf("rewind-effects overhead at median LLM latency 2 s <= %.2fx", maxOverhead), rw.OverheadRatio, maxOverhead, true, "x", ""))
		if rep.BestBaseline != "" {
			note := "fastest baseline: " + rep.BestBaseline
			if r := rep.roundsNote(); r != "" {
				note += "; " + r
			}
			if rep.BestRecovering != "" && rep.BestRecovering != rep.BestBaseline {
				note += fmt.Sprintf("; against the fastest that recovered every crash (%s): %.1fx", rep.BestRecovering, rep.SpeedupVsRecovering)
			}
			out = append(out, verdict(fmt.Sprintf("state-management time, fastest baseline over rewind-effects >= %dx", minSpeedup), rep.Speedup, minSpeedup, false, "x", note))
		}
	}
	for _, s := range rep.Systems {
		if s.Error != "" || s.CrashChecks == 0 || !strings.HasPrefix(s.Name, "rewind-") {
			continue
		}
		out = append(out, verdict(s.Name+" recovers every injected crash exactly (100%)", 100*s.RecoveryCorrectness, 100, false, "%",
			fmt.Sprintf("%d of %d", s.CrashCorrect, s.CrashChecks)))
	}
	return out
}

// WriteVerdicts prints verdicts as a Markdown list under a heading.
func WriteVerdicts(w io.Writer, vs []Verdict) {
	if len(vs) == 0 {
		return
	}
	fmt.Fprintf(w, "\nTargets, judged on this run:\n\n")
	for _, v := range vs {
		met := "not met"
		if v.Met {
			met = "met"
		}
		note := ""
		if v.Note != "" {
			note = " (" + v.Note + ")"
		}
		fmt.Fprintf(w, "- %s: %s, %s%s\n", v.Target, formatValue(v), met, note)
	}
}

func formatValue(v Verdict) string {
	switch v.Unit {
	case "x":
		if v.Value < 2 {
			return fmt.Sprintf("%.3fx", v.Value)
		}
		return fmt.Sprintf("%.1fx", v.Value)
	case "ms":
		return fmt.Sprintf("%.0f ms", v.Value)
	case "%":
		return fmt.Sprintf("%.1f%%", v.Value)
	}
	return fmt.Sprintf("%g %s", v.Value, v.Unit)
}
