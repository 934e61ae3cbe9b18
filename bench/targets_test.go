package bench

import (
	"bytes"
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
