package main

import (
	"bytes"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// TestPrintTree: the checkpoint tree shows each checkpoint's times and
// tags; one still being taken says so, not "frozen 0.00 ms ... not
// restorable" (what a log right after a turn showed).
func TestPrintTree(t *testing.T) {
	l := &api.Log{
		Sandbox: &state.Sandbox{ID: "sb-1", Name: "a", Status: state.StatusRunning, Epoch: 2, Turns: 2, Head: "ck-2"},
		Checkpoints: []*state.Checkpoint{
			{ID: "ck-1", Sandbox: "sb-1", Seq: 1, Decision: state.ModeFull, Reason: "requested", Status: state.CkptReady, Restorable: true, Durable: true, FrozenUS: 1500, TookUS: 7000},
			{ID: "ck-2", Sandbox: "sb-1", Parent: "ck-1", Seq: 2, Decision: state.ModeFS, Reason: "files changed", Status: state.CkptPending},
		},
		Pins: []string{"ck-1"},
	}
	var b bytes.Buffer
	printTree(&b, l)
	lines := strings.Split(strings.TrimSpace(b.String()), "\n")
	if len(lines) != 3 {
		t.Fatalf("tree:\n%s", b.String())
	}
	for i, want := range [][]string{
		{"ck-1 #1", "frozen 1.50 ms, took 7.00 ms", "requested", "[pinned, durable]"},
		{"ck-2 #2", "being taken", "files changed", "[HEAD, pending]"},
	} {
		for _, w := range want {
			if !strings.Contains(lines[i+1], w) {
				t.Errorf("line %q lacks %q", lines[i+1], w)
			}
		}
	}
	if strings.Contains(lines[2], "not restorable") || strings.Contains(lines[2], "frozen") {
		t.Errorf("a pending checkpoint shown as %q", lines[2])
	}
}
