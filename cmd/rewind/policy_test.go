package main

import (
	"bytes"
	"context"
	"errors"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestPolicyTestRefusesBadInput: a line that is no effect report (it was
// decided as turn 0), a zero or negative timeout and a memory limit below
// a page are refused with what is wrong.
func TestPolicyTestRefusesBadInput(t *testing.T) {
	reports := filepath.Join("..", "..", "policies", "testdata", "reports.jsonl")
	junk := filepath.Join(t.TempDir(), "junk.jsonl")
	if err := os.WriteFile(junk, []byte(`{"garbage":1}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	noTurn := filepath.Join(t.TempDir(), "noturn.jsonl")
	if err := os.WriteFile(noTurn, []byte(`{"fs":{}}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name string
		o    policyTestOpts
		want string
	}{
		{"unknown field", policyTestOpts{reports: junk, timeout: 5e9, memory: 16 << 20}, "unknown field"},
		{"no turn", policyTestOpts{reports: noTurn, timeout: 5e9, memory: 16 << 20}, "no \"turn\""},
		{"zero timeout", policyTestOpts{reports: reports, timeout: 0, memory: 16 << 20}, "--timeout"},
		{"negative timeout", policyTestOpts{reports: reports, timeout: -1, memory: 16 << 20}, "--timeout"},
		{"tiny memory", policyTestOpts{reports: reports, timeout: 5e9, memory: 1}, "--memory"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := runPolicyTest(context.Background(), &out, &errOut, "effects", tc.o)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err %v, want it to say %q", err, tc.want)
			}
		})
	}
}

func TestPolicyTestCommand(t *testing.T) {
	reports := filepath.Join("..", "..", "policies", "testdata", "reports.jsonl")
	wrong := filepath.Join(t.TempDir(), "wrong.jsonl")
	if err := os.WriteFile(wrong, []byte(`{"turn":1,"mode":"skip"}`+"\n"+`{"turn":99,"mode":"skip"}`+"\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, ref, expect string
		wantExit          int
		wantOut           []string
	}{
		{"builtin matches", "effects", filepath.Join("..", "..", "policies", "testdata", "expect-effects.jsonl"), 0,
			[]string{"TURN", "files changed only", "new long-lived"}},
		{"wat example", filepath.Join("..", "..", "examples", "policy-wat", "policy.wasm"), "", 0, []string{"no lasting effects"}},
		{"differences", "always", wrong, 1, []string{"DIFF turn 99: expected skip", "DIFF turn 1"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var out, errOut bytes.Buffer
			err := runPolicyTest(context.Background(), &out, &errOut, tt.ref, policyTestOpts{reports: reports, expect: tt.expect, timeout: 5e9, memory: 16 << 20})
			var ee exitError
			switch {
			case tt.wantExit == 0 && err != nil:
				t.Fatalf("error %v\n%s", err, out.String())
			case tt.wantExit != 0 && (!errors.As(err, &ee) || ee.code != tt.wantExit):
				t.Fatalf("error %v, want exit %d", err, tt.wantExit)
			}
			for _, w := range tt.wantOut {
				if !strings.Contains(out.String(), w) {
					t.Errorf("output lacks %q:\n%s", w, out.String())
				}
			}
			if !strings.Contains(errOut.String(), "19 reports") {
				t.Errorf("summary: %s", errOut.String())
			}
		})
	}
	err := runPolicyTest(context.Background(), &bytes.Buffer{}, &bytes.Buffer{}, filepath.Join("..", "..", "policy", "testdata", "hostile", "notwasm.wasm"),
		policyTestOpts{reports: reports, timeout: 5e9, memory: 16 << 20})
	if err == nil || !strings.Contains(err.Error(), "not a WASM module") {
		t.Fatalf("not-wasm policy: %v", err)
	}
}
