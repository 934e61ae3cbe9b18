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

// mustGenerate is Generate, failing the test on an error.
func mustGenerate(t *testing.T, seed int64, o GenOptions) *Trace {
	t.Helper()
	tr, err := Generate(seed, o)
	if err != nil {
		t.Fatal(err)
	}
	return tr
}

func TestGenerate(t *testing.T) {
	a := mustGenerate(t, 7, GenOptions{})
	b := mustGenerate(t, 7, GenOptions{})
	if !reflect.DeepEqual(a, b) {
		t.Fatal("the same seed gave different traces")
	}
	if c := mustGenerate(t, 8, GenOptions{}); reflect.DeepEqual(a.Nodes, c.Nodes) {
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
	z := mustGenerate(t, 7, GenOptions{ZeroLLM: true})
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

// TestTraceRoundTrip: what Write writes, ReadTraces reads back the same,
// one trace or several in one file (what --write-trace makes of --full's
// five traces and --trace reads).
func TestTraceRoundTrip(t *testing.T) {
	for _, n := range []int{1, 5} {
		var want []*Trace
		var b bytes.Buffer
		for i := range n {
			tr := mustGenerate(t, int64(3+i), GenOptions{Expansions: 20})
			want = append(want, tr)
			if err := tr.Write(&b); err != nil {
				t.Fatal(err)
			}
		}
		got, err := ReadTraces(&b)
		if err != nil {
			t.Fatalf("%d traces: %v", n, err)
		}
		if !reflect.DeepEqual(got, want) {
			t.Fatalf("%d traces: round trip changed them:\n got %+v\nwant %+v", n, got, want)
		}
	}
}

// TestReadTracesRefuses: every malformed trace is refused with the line
// and what is wrong with it; blank lines and explicit zeros are fine.
func TestReadTracesRefuses(t *testing.T) {
	const h = `{"trace":"x","seed":2,"setup":["mkdir -p $R"]}` + "\n"
	const n1 = `{"id":1,"parent":0,"kind":"read","commands":["true"],"llm_ms":5}` + "\n"
	tests := []struct{ name, in, want string }{
		{"nothing", "", "empty"},
		{"just a newline", "\n", "empty"},
		{"header only", h, `trace "x" has no nodes`},
		{"bad header JSON", "{", "line 1: not a JSON object"},
		{"not an object", "[1]\n", "line 1: not a JSON object"},
		{"no header", n1, "line 1: the first line must be the header"},
		{"no header after a blank line", "\n" + n1, "line 2: the first line must be the header"},
		{"empty name", `{"trace":""}` + "\n" + n1, "line 1: header: trace (the name) is empty"},
		{"unknown header field", `{"trace":"x","sed":1}` + "\n" + n1, `line 1: header: unknown field "sed"`},
		{"blank setup command", `{"trace":"x","setup":[" "]}` + "\n" + n1, "setup command 1 is blank"},
		{"unknown node field", h + `{"id":1,"parent":0,"commands":["true"],"latency_ms":5}`, `line 2: unknown field "latency_ms" (a node has id`},
		{"two values on a line", h + `{"id":1,"parent":0,"commands":["true"]} {}`, "line 2: not a JSON object: invalid character"},
		{"missing parent", h + `{"id":1,"commands":["true"]}`, "line 2: missing parent"},
		{"missing id", h + `{"parent":0,"commands":["true"]}`, "line 2: missing id"},
		{"null node", h + "null", "line 2: missing commands, id, parent"},
		{"missing commands", h + `{"id":1,"parent":0}`, "line 2: missing commands"},
		{"null commands", h + `{"id":1,"parent":0,"commands":null}`, "line 2: missing commands"},
		{"empty commands", h + `{"id":1,"parent":0,"commands":[]}`, "line 2: node 1: commands is empty"},
		{"blank command", h + `{"id":1,"parent":0,"commands":["true",""]}`, "line 2: node 1: command 2 is blank"},
		{"unknown parent", h + `{"id":1,"parent":5,"commands":["true"]}`, "line 2: node 1 names parent 5"},
		{"parent after child", h + `{"id":1,"parent":2,"commands":["true"]}` + "\n" + `{"id":2,"parent":0,"commands":["true"]}`, "line 2: node 1 names parent 2"},
		{"cycle", h + `{"id":1,"parent":1,"commands":["true"]}`, "line 2: node 1 names parent 1"},
		{"duplicate id", h + n1 + n1, "line 3: id 1 is not a new"},
		{"zero id", h + `{"id":0,"parent":0,"commands":["true"]}`, "line 2: id 0 is not a new"},
		{"fractional id", h + `{"id":1.5,"parent":0,"commands":["true"]}`, "line 2: json: cannot unmarshal"},
		{"negative llm", h + `{"id":1,"parent":0,"commands":["true"],"llm_ms":-1}`, "line 2: node 1: negative llm_ms"},
		{"huge llm", h + `{"id":1,"parent":0,"commands":["true"],"llm_ms":1e300}`, "line 2: node 1: llm_ms 1e+300 is over 3600000"},
		{"second trace without nodes", h + n1 + h + h + n1, `line 4: a new header: trace "x" has no nodes`},
		{"line too long", h + n1 + `{"id":2,"parent":0,"commands":["` + strings.Repeat("x", 17<<20) + `"]}`, "line 3: longer than 16 MiB"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ReadTraces(strings.NewReader(tc.in))
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	good := "\n" + h + "\n" + n1 + `{"id":2,"parent":0,"commands":["true"],"llm_ms":3600000}` + "\n\n" + `{"trace":"y"}` + "\n" + `{"id":1,"parent":0,"commands":["ls"]}` + "\n"
	ts, err := ReadTraces(strings.NewReader(good))
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 2 || ts[0].Name != "x" || ts[0].Seed != 2 || len(ts[0].Nodes) != 2 || ts[0].Nodes[1].Parent != 0 || ts[1].Name != "y" || len(ts[1].Nodes) != 1 {
		t.Fatalf("read %+v", ts)
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

func TestGenerateExclude(t *testing.T) {
	tr := mustGenerate(t, 5, GenOptions{Exclude: []string{"server", "kill"}})
	for _, n := range tr.Nodes {
		if n.Kind == "server" || n.Kind == "kill" {
			t.Fatalf("excluded kind generated: %+v", n)
		}
	}
	if !strings.HasSuffix(tr.Name, "-no-server-kill") {
		t.Errorf("trace name %q does not say what it excludes", tr.Name)
	}
	bad := []struct {
		name string
		o    GenOptions
		want string
	}{
		{"every kind", GenOptions{Exclude: Kinds()}, "every kind excluded"},
		{"unknown kind", GenOptions{Exclude: []string{"edit", "nosuch"}}, `unknown kind "nosuch" to exclude (kinds: read, edit`},
		{"kind twice", GenOptions{Exclude: []string{"cd", "cd"}}, `kind "cd" excluded twice`},
		{"negative expansions", GenOptions{Expansions: -5}, "-5 expansions"},
		{"negative rollbacks", GenOptions{Rollbacks: -1}, "-1 rollbacks"},
		{"huge latency", GenOptions{MedianLLMMS: 1e300}, "median LLM latency"},
	}
	for _, tc := range bad {
		if _, err := Generate(1, tc.o); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: error %v, want one containing %q", tc.name, err, tc.want)
		}
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
