package bench

import (
	"context"
	"strconv"
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
	rows, err := RunFanout(context.Background(), FanoutOptions{Counts: []int{2, 3}, Parent: t.TempDir()})
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
	}
}
