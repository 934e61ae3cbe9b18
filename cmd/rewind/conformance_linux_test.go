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
	t.Run("seed", func(t *testing.T) {
		// --seed runs a random file-system workload on the file-system
		// paths and a random process workload on the process paths.
		testenv.RequireRoot(t)
		_, err := os.Stat("/dev/fuse")
		testenv.RequireNoErr(t, err, "/dev/fuse")
		out, err := exec.Command(bin, "conformance", "run", "--seed", "7", "--steps", "25", "--paths", "fuse,template", "--repro-dir", t.TempDir()).CombinedOutput()
		if err != nil {
			t.Fatalf("run: %v\n%s", err, out)
		}
		// Columns: workload, steps, fuse, template.
		want := map[string][2]string{"random-7": {"pass", "-"}, "random-proc-7": {"-", "pass"}}
		rows := 0
		for _, l := range strings.Split(string(out), "\n") {
			f := strings.Fields(l)
			if w, ok := want[f0(f)]; ok {
				rows++
				if len(f) != 4 || f[2] != w[0] || f[3] != w[1] {
					t.Fatalf("row %q, want %s and %s on fuse and template:\n%s", l, w[0], w[1], out)
				}
			}
		}
		if rows != 2 {
			t.Fatalf("want a row for each random workload:\n%s", out)
		}
	})
}

// f0 is the first of fields, or "".
func f0(fields []string) string {
	if len(fields) == 0 {
		return ""
	}
	return fields[0]
}
