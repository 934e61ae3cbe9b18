package main

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/bench"
)

// runBenchCmd runs `rewind bench ARGS` with a socket no daemon listens on
// and autostart off: the flags must be refused before any connection.
func runBenchCmd(t *testing.T, args ...string) (string, error) {
	t.Helper()
	t.Setenv("REWIND_NO_AUTOSTART", "1")
	cmd := newBenchCmd()
	var out bytes.Buffer
	cmd.SetOut(&out)
	cmd.SetErr(&out)
	cmd.SetArgs(append(args, "--socket", filepath.Join(t.TempDir(), "none.sock")))
	err := cmd.Execute()
	return out.String(), err
}

// TestBenchFlagsRefused: bad values and combinations of bench mcts's and
// bench fanout's flags are refused up front, saying what is wrong, before
// a daemon is reached or anything runs.
func TestBenchFlagsRefused(t *testing.T) {
	file := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"mcts", "--systems", "nosuch"}, `unknown system "nosuch" (known: rewind-effects`},
		{[]string{"mcts", "--systems", "cp-a,"}, "an empty system name (known:"},
		{[]string{"mcts", "--systems", ""}, "an empty system name"},
		{[]string{"mcts", "--systems", "cp-a,tarball,cp-a"}, `system "cp-a" named twice`},
		{[]string{"mcts", "--exclude-kinds", "read,edit,test,cd,env,install,server,kill"}, "every kind excluded"},
		{[]string{"mcts", "--exclude-kinds", "reed"}, `unknown kind "reed" to exclude (kinds: read, edit`},
		{[]string{"mcts", "--expansions", "0"}, "--expansions 0: want 1 or more"},
		{[]string{"mcts", "--expansions", "-5"}, "--expansions -5"},
		{[]string{"mcts", "--crash-checks", "-1"}, "--crash-checks -1"},
		{[]string{"mcts", "--repeat", "0"}, "--repeat 0"},
		{[]string{"mcts", "--quick=false"}, "--quick=false"},
		{[]string{"mcts", "--quick", "--full"}, "not with --full or --trace"},
		{[]string{"mcts", "--full", "--trace", file}, "--full generates five traces: not with --trace"},
		{[]string{"mcts", "--trace", file, "--seed", "3"}, "not with --trace"},
		{[]string{"mcts", "--trace", file}, "--trace " + file + ": read trace: empty"},
		{[]string{"mcts", "--out", filepath.Join(file, "sub")}, "--out: mkdir"},
		{[]string{"mcts", "--write-trace", filepath.Join(file, "t.jsonl")}, "--write-trace:"},
		{[]string{"fanout", "-n", "0"}, "fan-out width 0: want 1..1024"},
		{[]string{"fanout", "-n", "-1"}, "fan-out width -1"},
		{[]string{"fanout", "-n", "2000"}, "fan-out width 2000"},
		{[]string{"fanout", "-n", "4,4"}, "fan-out width 4 given twice"},
		{[]string{"fanout", "--repeat", "0"}, "--repeat 0"},
		{[]string{"fanout", "--trainer-step-ms", "-5"}, "--trainer-step-ms -5"},
		{[]string{"fanout", "--trainer-step-ms", "0"}, "--trainer-step-ms 0"},
		{[]string{"fanout", "--trainer-step-ms", "NaN"}, "--trainer-step-ms NaN"},
		{[]string{"fanout", "--fs", "nosuch"}, `unknown fs "nosuch" (want auto, fuse or kernel)`},
	}
	for _, tc := range tests {
		t.Run(strings.Join(tc.args, " "), func(t *testing.T) {
			_, err := runBenchCmd(t, tc.args...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			if strings.Contains(err.Error(), "daemon") || strings.Contains(err.Error(), "rewind: rewind:") {
				t.Fatalf("error %v: the flags were not checked first", err)
			}
		})
	}
}

// TestBenchMCTSFlagsAccepted: the combinations the help gives pass the
// checks, and --systems becomes the list it names.
func TestBenchMCTSFlagsAccepted(t *testing.T) {
	tests := []struct {
		name    string
		f       mctsFlags
		changed []string
		systems []string
	}{
		{"defaults", mctsFlags{expansions: 100, crash: 10, repeat: 1}, nil, nil},
		{"quick", mctsFlags{quick: true, expansions: 100, crash: 10, repeat: 1}, []string{"quick"}, nil},
		{"full, no crash checks", mctsFlags{full: true, expansions: 100, repeat: 3}, []string{"full", "crash-checks"}, nil},
		{"trace and systems", mctsFlags{traces: []string{"x"}, systems: "rewind-effects, cp-a", expansions: 100, crash: 10, repeat: 1}, []string{"trace", "systems"}, []string{"rewind-effects", "cp-a"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			changed := func(name string) bool {
				for _, c := range tc.changed {
					if c == name {
						return true
					}
				}
				return false
			}
			if err := tc.f.check(changed); err != nil {
				t.Fatal(err)
			}
			sys, err := tc.f.systemList(changed)
			if err != nil || !reflect.DeepEqual(sys, tc.systems) {
				t.Fatalf("systems %q, %v; want %q", sys, err, tc.systems)
			}
		})
	}
}

// TestBenchMCTSWriteTraceRoundTrip: what --full --write-trace writes,
// --trace reads back: the same five traces.
func TestBenchMCTSWriteTraceRoundTrip(t *testing.T) {
	f := mctsFlags{full: true, seed: 4, expansions: 15}
	ts, err := f.loadTraces()
	if err != nil {
		t.Fatal(err)
	}
	if len(ts) != 5 {
		t.Fatalf("--full made %d traces", len(ts))
	}
	var b bytes.Buffer
	for _, tr := range ts {
		if err := tr.Write(&b); err != nil {
			t.Fatal(err)
		}
	}
	p := filepath.Join(t.TempDir(), "traces.jsonl")
	if err := os.WriteFile(p, b.Bytes(), 0o644); err != nil {
		t.Fatal(err)
	}
	got, err := (&mctsFlags{traces: []string{p}}).loadTraces()
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, ts) {
		t.Fatalf("--trace read back %d traces, not the %d written", len(got), len(ts))
	}
}

// TestPrepareOutDir: --out is made up front; one that cannot hold files
// is refused.
func TestPrepareOutDir(t *testing.T) {
	dir := t.TempDir()
	if err := prepareOutDir(filepath.Join(dir, "a", "b")); err != nil {
		t.Fatal(err)
	}
	if ents, _ := os.ReadDir(filepath.Join(dir, "a", "b")); len(ents) != 0 {
		t.Fatalf("the check left %v", ents)
	}
	file := filepath.Join(dir, "f")
	if err := os.WriteFile(file, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := prepareOutDir(filepath.Join(file, "out")); err == nil {
		t.Fatal("a dir under a regular file was accepted")
	}
}

// TestBenchFanoutOptions: accepted fan-out flags become the run's options.
func TestBenchFanoutOptions(t *testing.T) {
	f := fanoutFlags{counts: []int{1, 1024}, step: 2000, fsKind: "kernel", repeat: 2}
	o, err := f.options(func(string) bool { return true })
	if err != nil {
		t.Fatal(err)
	}
	want := bench.FanoutOptions{Counts: []int{1, 1024}, TrainerStepMS: 2000, FS: "kernel", Repeat: 2}
	if !reflect.DeepEqual(o, want) {
		t.Fatalf("options %+v, want %+v", o, want)
	}
}
