package policies_test

import (
	"bytes"
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/policies"
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func readFixtures(t *testing.T, name string) ([]effect.Report, []policy.Expectation) {
	t.Helper()
	f, err := os.Open(filepath.Join("testdata", "reports.jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	reports, err := policy.ReadReports(f)
	if err != nil {
		t.Fatal(err)
	}
	g, err := os.Open(filepath.Join("testdata", "expect-"+name+".jsonl"))
	if err != nil {
		t.Fatal(err)
	}
	defer g.Close()
	exps, err := policy.ReadExpectations(g)
	if err != nil {
		t.Fatal(err)
	}
	if len(exps) != len(reports) || len(reports) == 0 {
		t.Fatalf("%d reports, %d expectations", len(reports), len(exps))
	}
	return reports, exps
}

func toMode(d guest.Decision) policy.Mode {
	switch d {
	case guest.Skip:
		return policy.Skip
	case guest.FS:
		return policy.FS
	}
	return policy.Full
}

// TestBuiltinDecisions runs every built-in WASM policy on the fixtures and
// checks its decisions against the expectations and against the same rule
// run natively.
func TestBuiltinDecisions(t *testing.T) {
	ctx := context.Background()
	h, err := policy.NewHost(ctx, policy.Options{Timeout: 10 * time.Second}) // no spurious deadline on a loaded machine
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	if got := policies.Names(); len(got) != 4 || got[0] != policies.Default {
		t.Fatalf("Names() = %v", got)
	}
	for _, name := range policies.Names() {
		t.Run(name, func(t *testing.T) {
			reports, exps := readFixtures(t, name)
			p, err := h.LoadBuiltin(ctx, name)
			if err != nil {
				t.Fatal(err)
			}
			rule, ok := rules.ByName(name)
			if !ok {
				t.Fatalf("no native rule %q", name)
			}
			for i := range reports {
				r := &reports[i]
				d, err := p.Decide(ctx, r)
				if err != nil || d.Fallback {
					t.Fatalf("turn %d: %+v, %v", r.Turn, d, err)
				}
				if exps[i].Turn != r.Turn || d.Mode != exps[i].Mode {
					t.Errorf("turn %d: decided %v (%s), expected %v", r.Turn, d.Mode, d.Reason, exps[i].Mode)
				}
				nd, nreason := rule(r)
				if toMode(nd) != d.Mode || nreason != d.Reason {
					t.Errorf("turn %d: wasm %v %q, native %v %q", r.Turn, d.Mode, d.Reason, toMode(nd), nreason)
				}
			}
		})
	}
}

// TestBuiltinModulesReproducible rebuilds the built-in modules from their
// sources and fails if they differ from the committed ones.
func TestBuiltinModulesReproducible(t *testing.T) {
	goBin, err := exec.LookPath("go")
	testenv.Require(t, err == nil, "the Go toolchain on PATH (to rebuild the built-in policies)")
	if testing.Short() && !testenv.Strict() {
		t.Skip("rebuilding policies takes a while; skipped with -short")
	}
	out := t.TempDir()
	cmd := exec.Command("bash", "../scripts/build-policies.sh", out)
	cmd.Env = append(os.Environ(), "GO="+goBin)
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build-policies.sh: %v\n%s", err, b)
	}
	committedTC, _ := os.ReadFile("wasm/TOOLCHAIN")
	builtTC, _ := os.ReadFile(filepath.Join(out, "TOOLCHAIN"))
	for _, name := range policies.Names() {
		built, err := os.ReadFile(filepath.Join(out, name+".wasm"))
		if err != nil {
			t.Fatal(err)
		}
		committed, _ := policies.WASM(name)
		if !bytes.Equal(built, committed) {
			t.Errorf("policies/wasm/%s.wasm differs from its sources (committed with %s, rebuilt with %s): run `make policies` and commit",
				name, bytes.TrimSpace(committedTC), bytes.TrimSpace(builtTC))
		}
	}
	if !bytes.Equal(committedTC, builtTC) {
		t.Errorf("policies/wasm/TOOLCHAIN is %q, this toolchain is %q", committedTC, builtTC)
	}
}

// TestWATModulesReproducible recompiles the hand-written WAT modules and
// fails if a committed .wasm differs from its .wat source.
func TestWATModulesReproducible(t *testing.T) {
	wat2wasm, err := exec.LookPath("wat2wasm")
	testenv.Require(t, err == nil, "wat2wasm (Debian package wabt)")
	wats, _ := filepath.Glob("../examples/policy-wat/*.wat")
	hostile, _ := filepath.Glob("../policy/testdata/hostile/*.wat")
	wats = append(wats, hostile...)
	if len(wats) < 2 {
		t.Fatalf("found only %d .wat files", len(wats))
	}
	for _, wat := range wats {
		out := filepath.Join(t.TempDir(), "m.wasm")
		if b, err := exec.Command(wat2wasm, wat, "-o", out).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v\n%s", wat, err, b)
		}
		built, _ := os.ReadFile(out)
		committed, err := os.ReadFile(wat[:len(wat)-len(".wat")] + ".wasm")
		if err != nil || !bytes.Equal(built, committed) {
			t.Errorf("%s: committed .wasm differs from its source (err %v): run `make policies`", wat, err)
		}
	}
}

// TestWATExamplePolicy checks that the hand-written WAT example implements
// the effects rule: same modes as the built-in on every fixture.
func TestWATExamplePolicy(t *testing.T) {
	ctx := context.Background()
	h, err := policy.NewHost(ctx, policy.Options{Timeout: 10 * time.Second}) // no spurious deadline on a loaded machine
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	p, err := h.LoadFile(ctx, "../examples/policy-wat/policy.wasm")
	if err != nil {
		t.Fatal(err)
	}
	reports, exps := readFixtures(t, rules.NameEffects)
	for i := range reports {
		d, err := p.Decide(ctx, &reports[i])
		if err != nil || d.Fallback || d.Mode != exps[i].Mode {
			t.Errorf("turn %d: %+v, %v; want %v", reports[i].Turn, d, err, exps[i].Mode)
		}
	}
	// A report big enough to make the module grow its memory for the input.
	big := reports[1]
	for i := 0; i < effect.MaxSamples; i++ {
		big.FS.Samples = append(big.FS.Samples, effect.PathSample{Op: "modify", Path: string(bytes.Repeat([]byte("p"), effect.MaxWireString))})
	}
	if d, _ := p.Decide(ctx, &big); d.Fallback || d.Mode != policy.FS {
		t.Fatalf("big report: %+v", d)
	}
}
