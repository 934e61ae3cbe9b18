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
