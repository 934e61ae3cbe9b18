package bench

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"reflect"
	"strings"
	"testing"
	"time"
)

func TestGenerate(t *testing.T) {
	a := Generate(7, GenOptions{})
	b := Generate(7, GenOptions{})
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave different traces")
	}
	if c := Generate(8, GenOptions{}); reflect.DeepEqual(a.Nodes, c.Nodes) {
		t.Fatal("different seeds gave the same trace")
	}
	if len(a.Nodes) != 100 {
		t.Fatalf("%d nodes, want 100", len(a.Nodes))
	}
	if rb := a.Rollbacks(); rb < 35 || rb > 65 {
		t.Errorf("%d rollbacks, want about 50", rb)
	}
	kinds := map[string]int{}
	var llm []float64
	for i, n := range a.Nodes {
		kinds[n.Kind]++
		llm = append(llm, n.LLMMS)
		if n.ID != i+1 || n.Parent < 0 || n.Parent >= n.ID || len(n.Commands) == 0 {
			t.Fatalf("bad node %+v", n)
		}
	}
	if kinds["read"] < 40 {
		t.Errorf("read-only actions are not the majority: %v", kinds)
	}
	// Median LLM latency near 2 s.
	med := median(llm)
	if med < 1500 || med > 2600 {
		t.Errorf("median llm_ms %.0f, want about 2000", med)
	}
	z := Generate(7, GenOptions{ZeroLLM: true})
	for _, n := range z.Nodes {
		if n.LLMMS != 0 {
			t.Fatalf("ZeroLLM trace has llm_ms %v", n.LLMMS)
		}
	}
}

func median(v []float64) float64 {
	s := append([]float64(nil), v...)
	for i := range s {
		for j := i + 1; j < len(s); j++ {
			if s[j] < s[i] {
				s[i], s[j] = s[j], s[i]
			}
		}
	}
	return s[len(s)/2]
}

func TestTraceRoundTrip(t *testing.T) {
	tr := Generate(3, GenOptions{Expansions: 20})
	var b bytes.Buffer
	if err := tr.Write(&b); err != nil {
		t.Fatal(err)
	}
	got, err := ReadTrace(&b)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, tr) {
		t.Fatalf("round trip changed the trace:\n got %+v\nwant %+v", got, tr)
	}
	bad := []struct{ name, in, want string }{
		{"empty", "", "empty"},
		{"bad header", "{", "header"},
		{"unknown parent", `{"trace":"x"}` + "\n" + `{"id":1,"parent":5,"commands":["true"]}`, "parent 5"},
		{"duplicate id", `{"trace":"x"}` + "\n" + `{"id":1,"parent":0}` + "\n" + `{"id":1,"parent":0}`, "not a new"},
		{"negative llm", `{"trace":"x"}` + "\n" + `{"id":1,"parent":0,"llm_ms":-1}`, "negative"},
	}
	for _, c := range bad {
		_, err := ReadTrace(strings.NewReader(c.in))
		if err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: error %v, want one containing %q", c.name, err, c.want)
		}
	}
}

// fakeManager charges fixed costs, so Replay's accounting can be checked.
type fakeManager struct {
	visible, async, restore time.Duration
	decision                string
	n, restores             int
	state                   string
	saved                   map[string]string
	lossy                   bool // restore loses the state (like a baseline restarting its shell)
}

func (f *fakeManager) Name() string { return "fake" }
func (f *fakeManager) Start(context.Context, []string) error {
	f.saved = map[string]string{}
	return nil
}
func (f *fakeManager) Run(_ context.Context, cmd string) error { f.state += cmd; return nil }
func (f *fakeManager) Digest(context.Context) (string, error) {
	return "files=" + f.state + " cwd= step=", nil
}
func (f *fakeManager) Usage() Usage { return Usage{DiskBytes: int64(f.n)} }
func (f *fakeManager) Close() error { return nil }
func (f *fakeManager) Checkpoint(context.Context) (string, Cost, error) {
	f.n++
	id := fmt.Sprint(f.n)
	f.saved[id] = f.state
	return id, Cost{Visible: f.visible, Async: f.async, Decision: f.decision}, nil
}
func (f *fakeManager) Restore(_ context.Context, id string) (Cost, error) {
	f.restores++
	f.state = f.saved[id]
	if f.lossy {
		f.state = ""
	}
	return Cost{Visible: f.restore}, nil
}

// fakeStepper is a fakeManager whose steps go through Stepper, each taking
// exec of command time.
type fakeStepper struct {
	fakeManager
	exec  time.Duration
	steps int
}

func (f *fakeStepper) Step(ctx context.Context, restore string, cmds []string) (StepResult, error) {
	f.steps++
	var sr StepResult
	if restore != "" {
		sr.Restored = true
		sr.Restore, _ = f.Restore(ctx, restore)
	}
	for _, c := range cmds {
		f.Run(ctx, c)
	}
	sr.Exec = f.exec
	var err error
	sr.ID, sr.Checkpoint, err = f.Checkpoint(ctx)
	return sr, err
}

func TestReplayAccounting(t *testing.T) {
	tr := &Trace{Name: "t", Nodes: []Node{
		{ID: 1, Parent: 0, Commands: []string{"a"}, LLMMS: 100},
		{ID: 2, Parent: 1, Commands: []string{"b"}, LLMMS: 5},
		{ID: 3, Parent: 1, Commands: []string{"c"}, LLMMS: 100}, // rollback
	}}
	fm := fakeManager{visible: time.Millisecond, async: 10 * time.Millisecond, restore: 4 * time.Millisecond, decision: "fs"}
	st := &fakeStepper{fakeManager: fm, exec: 2 * time.Millisecond}
	for _, tc := range []struct {
		name string
		m    Manager
		fm   *fakeManager
		// execMS is the stepper's reported exec time over its steps (-1:
		// separate calls, timed by Replay).
		execMS float64
		steps  *int
	}{
		{"separate calls", &fm, &fm, -1, nil},
		{"stepper", st, &st.fakeManager, 6, &st.steps},
	} {
		t.Run(tc.name, func(t *testing.T) { replayAccounting(t, tr, tc.m, tc.fm, tc.execMS, tc.steps) })
	}
}

func replayAccounting(t *testing.T, tr *Trace, m Manager, fm *fakeManager, execMS float64, steps *int) {
	res, err := Replay(context.Background(), tr, m, ReplayOptions{CrashChecks: 3})
	if err != nil {
		t.Fatal(err)
	}
	if execMS >= 0 && (math.Abs(res.ExecMS-execMS) > 0.001 || *steps != 3) {
		t.Errorf("ExecMS = %v after %d steps, want %v after 3", res.ExecMS, *steps, execMS)
	}
	// Root checkpoint's async is free. Node 1: llm 100 masks root async (10);
	// checkpoint 1 visible. Node 2: llm 5 leaves 5 of the async; visible 1.
	// Node 3: llm 100 masks it; restore 4; visible 1. Last async 10 in full.
	// Crash checks restore 3 times more but are not charged.
	want := 1.0 + 5 + 1 + 4 + 1 + 10
	if math.Abs(res.StateMS-want) > 0.001 {
		t.Errorf("StateMS = %v, want %v", res.StateMS, want)
	}
	wantZero := 3*(1+10) + 4.0
	if math.Abs(res.StateMSZeroLLM-wantZero) > 0.001 {
		t.Errorf("StateMSZeroLLM = %v, want %v", res.StateMSZeroLLM, wantZero)
	}
	if res.LLMMS != 205 || res.Decisions["fs"] != 3 || res.Restore.N != 1 || res.Checkpoint.N != 3 {
		t.Errorf("result %+v", res)
	}
	if res.CrashChecks != 3 || res.CrashCorrect != 3 || res.RecoveryCorrectness != 1 {
		t.Errorf("crash checks %d/%d", res.CrashCorrect, res.CrashChecks)
	}
	if fm.state != "ac" {
		t.Errorf("state after replay %q, want the rolled-back branch \"ac\"", fm.state)
	}
	lossy := &fakeManager{lossy: true}
	res, err = Replay(context.Background(), tr, lossy, ReplayOptions{CrashChecks: 3})
	if err != nil {
		t.Fatal(err)
	}
	if res.CrashCorrect != 0 || res.RecoveryCorrectness != 0 {
		t.Errorf("a manager that loses state on restore scored %d/%d", res.CrashCorrect, res.CrashChecks)
	}
}

func TestExpectedShellState(t *testing.T) {
	s := shellState{}.
		next(Node{Kind: "cd", Commands: []string{"cd $R/src/app"}}).
		next(Node{Kind: "test", Commands: []string{"cd $R && python3 -m unittest; cd - >/dev/null"}}).
		next(Node{Kind: "env", Commands: []string{"export AGENT_STEP=7"}})
	if s.cwd != "/src/app" || s.step != "7" {
		t.Fatalf("expected state %+v", s)
	}
	if got := s.next(Node{Kind: "cd", Commands: []string{"cd $R"}}); got.cwd != "" || got.step != "7" {
		t.Fatalf("after cd $R: %+v", got)
	}
}

func TestGenerateExclude(t *testing.T) {
	tr := Generate(5, GenOptions{Exclude: []string{"server", "kill"}})
	for _, n := range tr.Nodes {
		if n.Kind == "server" || n.Kind == "kill" {
			t.Fatalf("excluded kind generated: %+v", n)
		}
	}
	if !strings.HasSuffix(tr.Name, "-no-server-kill") {
		t.Errorf("trace name %q does not say what it excludes", tr.Name)
	}
}

func TestReportCompare(t *testing.T) {
	sys := func(name string, state float64, checks, correct int) *Result {
		return &Result{Name: name, StateMS: state, CrashChecks: checks, CrashCorrect: correct}
	}
	tests := []struct {
		name              string
		systems           []*Result
		best, rec         string
		speedup, speedRec float64
	}{
		{
			name: "fastest baseline loses processes",
			systems: []*Result{
				sys("rewind-effects", 100, 10, 10), sys("rewind-always", 50, 10, 10),
				sys("overlay-remount", 200, 10, 7), sys("criu-cp-a", 5000, 10, 10), sys("cp-a", 400, 10, 6),
			},
			best: "overlay-remount", speedup: 2, rec: "criu-cp-a", speedRec: 50,
		},
		{
			name:    "no baseline recovers",
			systems: []*Result{sys("rewind-effects", 100, 10, 10), sys("cp-a", 400, 10, 6)},
			best:    "cp-a", speedup: 4,
		},
		{
			name:    "failed baseline is ignored",
			systems: []*Result{sys("rewind-effects", 100, 10, 10), {Name: "tarball", StateMS: 1, Error: "boom"}, sys("cp-a", 300, 4, 4)},
			best:    "cp-a", speedup: 3, rec: "cp-a", speedRec: 3,
		},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			rep := &Report{Systems: tc.systems}
			rep.compare()
			if rep.BestBaseline != tc.best || rep.Speedup != tc.speedup {
				t.Errorf("best = %s %.2f, want %s %.2f", rep.BestBaseline, rep.Speedup, tc.best, tc.speedup)
			}
			if rep.BestRecovering != tc.rec || rep.SpeedupVsRecovering != tc.speedRec {
				t.Errorf("best recovering = %s %.2f, want %s %.2f", rep.BestRecovering, rep.SpeedupVsRecovering, tc.rec, tc.speedRec)
			}
		})
	}
}

// memManager holds 10 bytes per checkpoint and frees them all at a restore,
// so the peak is only seen mid-search.
type memManager struct {
	fakeManager
	held int64
}

func (m *memManager) Checkpoint(ctx context.Context) (string, Cost, error) {
	m.held += 10
	return m.fakeManager.Checkpoint(ctx)
}
func (m *memManager) Restore(ctx context.Context, id string) (Cost, error) {
	m.held = 0
	return m.fakeManager.Restore(ctx, id)
}
func (m *memManager) MemBytes() int64 { return m.held }
func (m *memManager) Usage() Usage    { return Usage{DiskBytes: 7, MemBytes: m.held} }

func TestReplayPeakMemory(t *testing.T) {
	tr := &Trace{Name: "t", Nodes: []Node{
		{ID: 1, Parent: 0, Commands: []string{"a"}},
		{ID: 2, Parent: 1, Commands: []string{"b"}},
		{ID: 3, Parent: 2, Commands: []string{"c"}},
		{ID: 4, Parent: 1, Commands: []string{"d"}}, // rollback frees all
	}}
	res, err := Replay(context.Background(), tr, &memManager{}, ReplayOptions{})
	if err != nil {
		t.Fatal(err)
	}
	// Root + 3 checkpoints = 40 before the rollback; 10 at the end.
	if res.Usage.MemBytes != 40 || res.Usage.DiskBytes != 7 {
		t.Fatalf("usage %+v, want the peak memory 40 and the final disk 7", res.Usage)
	}
}
