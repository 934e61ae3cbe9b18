package bench

import (
	"bytes"
	"reflect"
	"strings"
	"testing"
)

// TestMedianRuns: each system's row is its median run (the lower middle
// one for an even count, failed runs last), listing every successful
// run's state time when there was more than one, in the given order.
func TestMedianRuns(t *testing.T) {
	run := func(name string, state float64, errText string) *Result {
		return &Result{Name: name, StateMS: state, Error: errText, P50MS: state / 100}
	}
	tests := []struct {
		name  string
		order []string
		runs  map[string][]*Result
		want  map[string]float64   // the row's state time
		list  map[string][]float64 // its StateMSRuns
		names []string
	}{
		{
			name:  "one run each",
			order: []string{"rewind-effects", "cp-a"},
			runs:  map[string][]*Result{"cp-a": {run("cp-a", 300, "")}, "rewind-effects": {run("rewind-effects", 100, "")}},
			want:  map[string]float64{"rewind-effects": 100, "cp-a": 300},
			list:  map[string][]float64{},
			names: []string{"rewind-effects", "cp-a"},
		},
		{
			name:  "odd and even counts",
			order: []string{"rewind-effects", "overlay-remount"},
			runs: map[string][]*Result{
				"rewind-effects":  {run("rewind-effects", 123, ""), run("rewind-effects", 103, ""), run("rewind-effects", 116, "")},
				"overlay-remount": {run("overlay-remount", 701, ""), run("overlay-remount", 488, "")},
			},
			want:  map[string]float64{"rewind-effects": 116, "overlay-remount": 488},
			list:  map[string][]float64{"rewind-effects": {103, 116, 123}, "overlay-remount": {488, 701}},
			names: []string{"rewind-effects", "overlay-remount"},
		},
		{
			name:  "failed runs count as slowest",
			order: []string{"tarball", "missing"},
			runs: map[string][]*Result{
				"tarball": {run("tarball", 0, "boom"), run("tarball", 900, ""), run("tarball", 0, "boom")},
			},
			want:  map[string]float64{"tarball": 0},
			list:  map[string][]float64{"tarball": {900}},
			names: []string{"tarball"},
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rows := MedianRuns(tc.order, tc.runs)
			var names []string
			for _, r := range rows {
				names = append(names, r.Name)
				if r.StateMS != tc.want[r.Name] {
					t.Errorf("%s: state %.0f, want %.0f", r.Name, r.StateMS, tc.want[r.Name])
				}
				if r.P50MS != r.StateMS/100 {
					t.Errorf("%s: fields of another run (p50 %.2f)", r.Name, r.P50MS)
				}
				if !reflect.DeepEqual(r.StateMSRuns, tc.list[r.Name]) {
					t.Errorf("%s: runs %v, want %v", r.Name, r.StateMSRuns, tc.list[r.Name])
				}
			}
			if !reflect.DeepEqual(names, tc.names) {
				t.Errorf("rows %v, want %v", names, tc.names)
			}
		})
	}
	// The Markdown says what the rows are.
	rep := &Report{Systems: MedianRuns([]string{"rewind-effects", "overlay-remount"}, tests[1].runs)}
	rep.compare()
	var b bytes.Buffer
	rep.Markdown(&b)
	for _, want := range []string{"median state time of up to 3 runs", "rewind-effects 103 / 116 / 123", "overlay-remount 488 / 701", "4.2x less time"} {
		if !strings.Contains(b.String(), want) {
			t.Errorf("markdown lacks %q:\n%s", want, b.String())
		}
	}
}
