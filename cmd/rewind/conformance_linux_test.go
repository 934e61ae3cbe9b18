package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestConformanceCLI(t *testing.T) {
	bin := rewindBinary(t)
	t.Run("unknown path", func(t *testing.T) {
		out, err := exec.Command(bin, "conformance", "run", "--paths", "fuse,warp").CombinedOutput()
		if err == nil || !strings.Contains(string(out), `unknown path "warp"`) {
			t.Fatalf("err %v, output %q; want an unknown-path error", err, out)
		}
	})
	t.Run("matrix", func(t *testing.T) {
		testenv.RequireRoot(t)
		_, err := os.Stat("/dev/fuse")
		testenv.RequireNoErr(t, err, "/dev/fuse")
		dir := t.TempDir()
		good := filepath.Join(dir, "good.json")
		os.WriteFile(good, []byte(`{"name":"good","steps":[{"op":"write","path":"a","data":"x"},
			{"op":"checkpoint","label":"c"},{"op":"rm","path":"a"},{"op":"restore","label":"c"},
			{"op":"expect","path":"a","expect":"x"}]}`), 0o644)
		out, err := exec.Command(bin, "conformance", "run", "--paths", "fuse,kernel", "--no-loop", "--workload", good).CombinedOutput()
		if err != nil {
			t.Fatalf("run: %v\n%s", err, out)
		}
		if !strings.Contains(string(out), "good") || strings.Count(string(out), "pass") != 2 {
			t.Fatalf("matrix does not show good passing on both paths:\n%s", out)
		}
		// A workload whose expectation is wrong fails as a broken
		// workload with a clear one-line error and a non-zero status.
		bad := filepath.Join(dir, "bad.json")
		os.WriteFile(bad, []byte(`{"name":"bad","steps":[{"op":"write","path":"a","data":"x"},
			{"op":"expect","path":"a","expect":"y"}]}`), 0o644)
		out, err = exec.Command(bin, "conformance", "run", "--paths", "fuse", "--workload", bad).CombinedOutput()
		if err == nil || !strings.Contains(string(out), "reference model") {
			t.Fatalf("err %v, output %q; want a reference-model error", err, out)
		}
	})
}
