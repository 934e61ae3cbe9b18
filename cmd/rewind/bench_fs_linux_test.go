package main

import (
	"os"
	"os/exec"
	"path/filepath"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestBenchFSBuildC: the bench's build row really builds its C project
// (objects and a program that runs), so a broken generator cannot pass as
// a fast build.
func TestBenchFSBuildC(t *testing.T) {
	for _, tool := range []string{"cc", "make"} {
		_, err := exec.LookPath(tool)
		testenv.RequireNoErr(t, err, tool+" (build-essential, installed by make deps)")
	}
	d := t.TempDir()
	if err := fsBuildC(d, 3); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"u0.o", "u2.o", "main.o", "prog"} {
		if _, err := os.Stat(filepath.Join(d, f)); err != nil {
			t.Errorf("build left no %s: %v", f, err)
		}
	}
	if err := fsBuildC(t.TempDir(), 0); err != nil {
		t.Fatalf("a project without units: %v", err)
	}
}
