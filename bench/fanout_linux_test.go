package bench

import (
	"context"
	"reflect"
	"strconv"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestSetOverFloor(t *testing.T) {
	rows := []FanoutRow{
		{Name: "rewind-fork", N: 16, ReadyMS: 300},
		{Name: "rewind-fork-repeat", N: 16, ReadyMS: 120},
		{Name: "rewind-fork", N: 32, ReadyMS: 500},
		{Name: "cp-a", N: 16, ReadyMS: 900, Error: "copy failed"},
		{Name: floorName, N: 16, ReadyMS: 100},
		{Name: floorName, N: 32, ReadyMS: 0, Error: "no shell"},
	}
	setOverFloor(rows)
	want := []float64{200, 20, 0, 0, 0, 0}
	for i, r := range rows {
		if r.OverFloorMS != want[i] {
			t.Errorf("row %d (%s n=%d): over floor %.1f, want %.1f", i, r.Name, r.N, r.OverFloorMS, want[i])
		}
	}
}

// TestFanoutFloor runs the floor row for real: n shells in a copy of the
// benchmark repository all run the first command, which must succeed in
// each.
func TestFanoutFloor(t *testing.T) {
	testenv.RequireRoot(t)
	r := fanoutFloor(context.Background(), t.TempDir(), setupCommands(), 4)
	if r.Error != "" {
		t.Fatal(r.Error)
	}
	if r.Name != floorName || r.N != 4 || r.ReadyMS <= 0 {
		t.Fatalf("row %+v", r)
	}
}

// TestRunFanoutBaselinesOnly runs the fan-out without a daemon: the copy
// rows and the floor rows, with each copy row's cost over the floor.
func TestRunFanoutBaselinesOnly(t *testing.T) {
	testenv.RequireRoot(t)
	rows, err := RunFanout(context.Background(), FanoutOptions{Counts: []int{2, 3}, Parent: t.TempDir(), Repeat: 2})
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]FanoutRow{}
	for _, r := range rows {
		if r.Error != "" {
			t.Fatalf("%s n=%d: %s", r.Name, r.N, r.Error)
		}
		got[r.Name+"/"+strconv.Itoa(r.N)] = r
	}
	for _, n := range []string{"2", "3"} {
		cp, ok := got["cp-a/"+n]
		fl, ok2 := got[floorName+"/"+n]
		if !ok || !ok2 {
			t.Fatalf("n=%s: rows %v", n, rows)
		}
		if cp.OverFloorMS != cp.ReadyMS-fl.ReadyMS {
			t.Errorf("n=%s: cp-a over floor %.2f, want %.2f - %.2f", n, cp.OverFloorMS, cp.ReadyMS, fl.ReadyMS)
		}
		if cp.DiskBytes <= 0 {
			t.Errorf("n=%s: cp-a copies take no disk", n)
		}
		if len(cp.ReadyMSRuns) != 2 || cp.ReadyMS != cp.ReadyMSRuns[0] {
			t.Errorf("n=%s: cp-a runs %v, row %.2f: want 2 runs and the lower median", n, cp.ReadyMSRuns, cp.ReadyMS)
		}
	}
	if len(rows) != 4 {
		t.Errorf("%d rows for 2 systems at 2 widths over 2 runs: %v", len(rows), rows)
	}
}

// TestMedianFanout: one row per system and width, in first-seen order,
// the median run's (failed runs last), with every successful run's time.
func TestMedianFanout(t *testing.T) {
	row := func(name string, n int, ms float64, errText string) FanoutRow {
		return FanoutRow{Name: name, N: n, ReadyMS: ms, ForkMS: ms / 2, Error: errText}
	}
	runs := [][]FanoutRow{
		{row("rewind-fork", 16, 700, ""), row("cp-a", 16, 400, "")},
		{row("rewind-fork", 16, 500, ""), row("cp-a", 16, 0, "copy failed")},
		{row("rewind-fork", 16, 600, ""), row("cp-a", 16, 300, "")},
	}
	got := medianFanout(runs)
	want := []FanoutRow{
		{Name: "rewind-fork", N: 16, ReadyMS: 600, ForkMS: 300, ReadyMSRuns: []float64{500, 600, 700}},
		{Name: "cp-a", N: 16, ReadyMS: 400, ForkMS: 200, ReadyMSRuns: []float64{300, 400}},
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("medianFanout = %+v\nwant %+v", got, want)
	}
	if one := medianFanout(runs[:1]); one[0].ReadyMSRuns != nil || one[0].ReadyMS != 700 {
		t.Fatalf("one run: %+v", one)
	}
}

// TestJudgeFanout: the fan-out verdicts judge each rewind row at 64
// copies, name the floor, and leave other widths and the baselines alone.
func TestJudgeFanout(t *testing.T) {
	rows := []FanoutRow{
		{Name: "rewind-fork", N: 64, ReadyMS: 4746, TrainerWait: 0.487},
		{Name: "rewind-fork-repeat", N: 64, ReadyMS: 250, TrainerWait: 0.048},
		{Name: "rewind-fork", N: 16, ReadyMS: 100, TrainerWait: 0.01},
		{Name: "cp-a", N: 64, ReadyMS: 2428, TrainerWait: 0.33},
		{Name: floorName, N: 64, ReadyMS: 386, TrainerWait: 0.07},
	}
	vs := JudgeFanout(rows)
	want := []struct {
		prefix string
		met    bool
	}{
		{"rewind-fork: 64 copies ready", false},
		{"rewind-fork at 64 copies: trainer waits", false},
		{"rewind-fork-repeat: 64 copies ready", true},
		{"rewind-fork-repeat at 64 copies: trainer waits", true},
	}
	if len(vs) != len(want) {
		t.Fatalf("verdicts %+v, want %d", vs, len(want))
	}
	for i, w := range want {
		if !strings.HasPrefix(vs[i].Target, w.prefix) || vs[i].Met != w.met {
			t.Errorf("verdict %d = %+v, want %q met=%v", i, vs[i], w.prefix, w.met)
		}
	}
	if !strings.Contains(vs[0].Note, "386 ms") {
		t.Errorf("the ready verdict does not name the floor: %q", vs[0].Note)
	}
	if got := JudgeFanout(rows[2:3]); len(got) != 0 {
		t.Errorf("verdicts without a row at 64: %+v", got)
	}
	var b strings.Builder
	WriteVerdicts(&b, vs)
	if !strings.Contains(b.String(), "- rewind-fork-repeat: 64 copies ready within 250 ms: 250 ms, met") {
		t.Errorf("WriteVerdicts:\n%s", b.String())
	}
}
