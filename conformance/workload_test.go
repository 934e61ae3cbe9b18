package conformance

import (
	"context"
	"path/filepath"
	"strings"
	"testing"
)

func TestParseErrors(t *testing.T) {
	cases := []struct{ name, doc, want string }{
		{"unknown op", `{"steps":[{"op":"explode"}]}`, "unknown op"},
		{"unknown field", `{"steps":[{"op":"write","path":"a","dat":"x"}]}`, "unknown field"},
		{"escaping path", `{"steps":[{"op":"write","path":"../etc/passwd"}]}`, "inside the tree"},
		{"absolute path", `{"steps":[{"op":"write","path":"/etc/passwd"}]}`, "inside the tree"},
		{"unclean path", `{"steps":[{"op":"write","path":"a/./b"}]}`, "clean"},
		{"restore before checkpoint", `{"steps":[{"op":"restore","label":"x"}]}`, "not checkpointed"},
		{"bad mode", `{"steps":[{"op":"mkdir","path":"a","mode":"rwx"}]}`, "octal"},
		{"whiteout mknod", `{"steps":[{"op":"mknod","path":"a","kind":"char"}]}`, "whiteout"},
		{"unknown exception", `{"steps":[{"op":"write","path":"a","except":{"kernel":"magic"}}]}`, "unknown exception"},
		{"exception on wrong path", `{"steps":[{"op":"write","path":"a","except":{"fuse":"hardlink-copyup"}}]}`, "applies to kernel"},
		{"fdread without expect", `{"steps":[{"op":"fdread","fd":"x"}]}`, "needs expect"},
		{"empty repeat", `{"steps":[{"op":"repeat","count":0}]}`, "count > 0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse([]byte(c.doc))
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("Parse: %v, want an error containing %q", err, c.want)
			}
		})
	}
}

func TestRepeatExpansion(t *testing.T) {
	w, err := Parse([]byte(`{"steps":[{"op":"repeat","count":3,"steps":[
		{"op":"write","path":"f{i}","data":"v{i}"},{"op":"checkpoint","label":"c{i}"}]},
		{"op":"restore","label":"c1"},{"op":"expect","path":"f1","expect":"v1"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	var got []string
	for _, s := range w.Steps {
		got = append(got, s.Op+":"+s.Path+s.Label+s.Data)
	}
	want := "write:f0v0 checkpoint:c0 write:f1v1 checkpoint:c1 write:f2v2 checkpoint:c2 restore:c1 expect:f1"
	if strings.Join(got, " ") != want {
		t.Fatalf("expanded to %q, want %q", strings.Join(got, " "), want)
	}
}

func TestCorpusParses(t *testing.T) {
	files, _ := filepath.Glob("testdata/*.json")
	if len(files) < 10 {
		t.Fatalf("corpus has %d workloads, want at least 10", len(files))
	}
	for _, f := range files {
		w, err := Load(f)
		if err != nil {
			t.Fatal(err)
		}
		// Round trip through Marshal.
		w2, err := Parse(w.Marshal())
		if err != nil {
			t.Fatalf("%s: re-parse of Marshal: %v", f, err)
		}
		if len(w2.Steps) != len(w.Steps) || w2.Name != w.Name {
			t.Fatalf("%s: round trip changed the workload", f)
		}
	}
}

func TestGenerateDeterministicAndValid(t *testing.T) {
	a, b := Generate(7, 300), Generate(7, 300)
	if string(a.Marshal()) != string(b.Marshal()) {
		t.Fatal("Generate is not deterministic for one seed")
	}
	if string(a.Marshal()) == string(Generate(8, 300).Marshal()) {
		t.Fatal("seeds 7 and 8 gave the same workload")
	}
	if err := a.Validate(); err != nil {
		t.Fatal(err)
	}
	ops := map[string]bool{}
	for _, s := range a.Steps {
		ops[s.Op] = true
	}
	for _, op := range []string{"write", "rename", "checkpoint", "restore", "rmtree", "setxattr"} {
		if !ops[op] {
			t.Errorf("300 random steps contain no %s", op)
		}
	}
}

func TestMinimize(t *testing.T) {
	// A synthetic failure: a chmod 0444 of a0 after a checkpoint that is
	// restored later.
	w, err := Parse([]byte(`{"name":"m","allow_errors":true,"steps":[
		{"op":"write","path":"x","data":"1"},{"op":"checkpoint","label":"k0"},
		{"op":"write","path":"y","data":"2"},{"op":"chmod","path":"a0","mode":"0444"},
		{"op":"mkdir","path":"d"},{"op":"checkpoint","label":"k1"},
		{"op":"write","path":"z","data":"3"},{"op":"restore","label":"k0"},
		{"op":"compare"}]}`))
	if err != nil {
		t.Fatal(err)
	}
	fails := func(c *Workload) bool {
		chmod := false
		for _, s := range c.Steps {
			if s.Op == "chmod" {
				chmod = true
			}
			if chmod && s.Op == "restore" {
				return true
			}
		}
		return false
	}
	min := Minimize(context.Background(), w, fails, 1000)
	var ops []string
	for _, s := range min.Steps {
		ops = append(ops, s.Op)
	}
	if got := strings.Join(ops, ","); got != "checkpoint,chmod,restore" {
		t.Fatalf("minimized to %s, want checkpoint,chmod,restore", got)
	}
}

// GenerateProcess is deterministic, valid, a process workload, and ends on
// a restore (so the last changes are compared).
func TestGenerateProcess(t *testing.T) {
	for _, seed := range []uint64{1, 2, 3} {
		a, b := GenerateProcess(seed, 80), GenerateProcess(seed, 80)
		if string(a.Marshal()) != string(b.Marshal()) {
			t.Fatalf("seed %d: two workloads differ", seed)
		}
		if err := a.Validate(); err != nil {
			t.Fatalf("seed %d: %v", seed, err)
		}
		if !a.Process() || len(a.Steps) < 80 {
			t.Fatalf("seed %d: process %v, %d steps", seed, a.Process(), len(a.Steps))
		}
		ops := map[string]int{}
		for _, s := range a.Steps {
			ops[s.Op]++
		}
		if ops["checkpoint"] == 0 || ops["restore"] == 0 || ops["send"] < 20 {
			t.Fatalf("seed %d: step mix %v", seed, ops)
		}
		if last := a.Steps[len(a.Steps)-1]; last.Op != "restore" {
			t.Fatalf("seed %d: last step %s, want a restore", seed, last.Op)
		}
		if p, err := Parse(a.Marshal()); err != nil || len(p.Steps) != len(a.Steps) {
			t.Fatalf("seed %d: does not round-trip: %v", seed, err)
		}
	}
	if string(GenerateProcess(1, 80).Marshal()) == string(GenerateProcess(2, 80).Marshal()) {
		t.Fatal("seeds 1 and 2 give the same workload")
	}
	// Some seeds add a python session, and drive it.
	var py []uint64
	for seed := uint64(1); seed <= 8; seed++ {
		sends := 0
		for _, s := range GenerateProcess(seed, 80).Steps {
			if s.Op == "send" && s.Session == "py" {
				sends++
			}
		}
		if sends > 5 {
			py = append(py, seed)
		}
	}
	if len(py) == 0 || len(py) == 8 {
		t.Fatalf("seeds with a python session: %v, want some of 1-8", py)
	}
	t.Logf("seeds with a python session: %v", py)
}
