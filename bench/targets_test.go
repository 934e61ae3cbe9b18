package bench

import (
	"bytes"
	"math"
	"strings"
	"testing"
)

// TestReportTargets: the tree-search verdicts follow the run's numbers,
// at and around each bound, and the Markdown says them.
func TestReportTargets(t *testing.T) {
	sys := func(name string, state, overhead float64, checks, correct int) *Result {
		r := &Result{Name: name, StateMS: state, OverheadRatio: overhead, CrashChecks: checks, CrashCorrect: correct}
		r.RecoveryCorrectness = 1
		if checks > 0 {
			r.RecoveryCorrectness = float64(correct) / float64(checks)
		}
		return r
	}
	tests := []struct {
		name    string
		systems []*Result
		want    map[string]bool // target prefix -> met
	}{
		{
			name: "all met",
			systems: []*Result{
				sys("rewind-effects", 100, 1.001, 10, 10), sys("rewind-always", 200, 1.002, 10, 10),
				sys("overlay-remount", 1000, 1.01, 10, 7), sys("criu-cp-a", 9000, 1.05, 10, 10),
			},
			want: map[string]bool{"rewind-effects overhead": true, "state-management time": true, "rewind-effects recovers": true, "rewind-always recovers": true},
		},
		{
			name:    "bounds are inclusive",
			systems: []*Result{sys("rewind-effects", 100, 1.03, 10, 10), sys("cp-a", 1000, 1.01, 10, 6)},
			want:    map[string]bool{"rewind-effects overhead": true, "state-management time": true, "rewind-effects recovers": true},
		},
		{
			name: "missed",
			systems: []*Result{
				sys("rewind-effects", 130, 1.031, 10, 9),
				sys("overlay-remount", 667, 1.003, 10, 7), sys("criu-cp-a", 10300, 1.05, 10, 10),
			},
			want: map[string]bool{"rewind-effects overhead": false, "state-management time": false, "rewind-effects recovers": false},
		},
		{
			name:    "failed rewind row: no verdict on it",
			systems: []*Result{{Name: "rewind-effects", Error: "boom"}, sys("rewind-always", 200, 1.002, 10, 10), sys("cp-a", 1000, 1.01, 10, 6)},
			want:    map[string]bool{"rewind-always recovers": true},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{Systems: tc.systems}
			rep.compare()
			got := map[string]bool{}
			for _, v := range rep.Targets {
				for p := range tc.want {
					if strings.HasPrefix(v.Target, p) {
						got[p] = v.Met
					}
				}
			}
			if len(rep.Targets) != len(tc.want) || len(got) != len(tc.want) {
				t.Fatalf("verdicts %+v, want %v", rep.Targets, tc.want)
			}
			for p, met := range tc.want {
				if got[p] != met {
					t.Errorf("%s: met = %v, want %v (%+v)", p, got[p], met, rep.Targets)
				}
			}
			var md bytes.Buffer
			rep.Markdown(&md)
			for _, v := range rep.Targets {
				line := "- " + v.Target + ": "
				if !strings.Contains(md.String(), line) {
					t.Errorf("Markdown lacks %q:\n%s", line, md.String())
				}
			}
		})
	}
}

// With several rounds the speedup is also given round by round, each
// round's best-baseline run over its rewind-effects run, in the JSON, the
// Markdown and the target's note; a failed run leaves its round out.
func TestSpeedupRounds(t *testing.T) {
	run := func(name string, state float64, failed bool) *Result {
		r := &Result{Name: name, StateMS: state, OverheadRatio: 1.001, CrashChecks: 10, CrashCorrect: 10}
		if failed {
			r.Error = "boom"
		}
		return r
	}
	runs := map[string][]*Result{
		// Round 2 is slow for both: its ratio is close to the others'
		// although its rewind run is the slowest of the three.
		"rewind-effects":  {run("rewind-effects", 100, false), run("rewind-effects", 200, false), run("rewind-effects", 110, false)},
		"overlay-remount": {run("overlay-remount", 500, false), run("overlay-remount", 1100, false), run("overlay-remount", 0, true)},
	}
	rep := &Report{Systems: MedianRuns([]string{"rewind-effects", "overlay-remount"}, runs)}
	rep.compareRuns(runs)
	if rep.BestBaseline != "overlay-remount" {
		t.Fatalf("best baseline %q", rep.BestBaseline)
	}
	want := []float64{5, 5.5, 0}
	if len(rep.SpeedupRounds) != len(want) {
		t.Fatalf("rounds %v, want %v", rep.SpeedupRounds, want)
	}
	for i := range want {
		if math.Abs(rep.SpeedupRounds[i]-want[i]) > 1e-9 {
			t.Fatalf("rounds %v, want %v", rep.SpeedupRounds, want)
		}
	}
	const note = "round by round: 5.0x / 5.5x / failed"
	var md bytes.Buffer
	rep.Markdown(&md)
	if !strings.Contains(md.String(), note) {
		t.Errorf("Markdown lacks %q:\n%s", note, md.String())
	}
	found := false
	for _, v := range rep.Targets {
		found = found || (strings.HasPrefix(v.Target, "state-management time") && strings.Contains(v.Note, note))
	}
	if !found {
		t.Errorf("no speedup verdict with %q: %+v", note, rep.Targets)
	}
	// One round: nothing to pair.
	one := map[string][]*Result{"rewind-effects": runs["rewind-effects"][:1], "overlay-remount": runs["overlay-remount"][:1]}
	rep = &Report{Systems: MedianRuns([]string{"rewind-effects", "overlay-remount"}, one)}
	rep.compareRuns(one)
	if rep.SpeedupRounds != nil {
		t.Fatalf("one round: rounds %v, want none", rep.SpeedupRounds)
	}
}
