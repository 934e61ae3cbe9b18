package sandbox

import (
	"os/exec"
	"strings"
	"testing"
)

// TestInitDependencies: the init runs from this package's init function,
// after every package it depends on is initialized, and a binary's
// initialization order (by import path) puts some standard packages —
// net above all, which waits for a vendored package sorted last — after
// every heavy dependency of the daemon (protobuf, metrics, eBPF, FUSE).
// The package must not depend on them: each would delay every sandbox
// start by the daemon's whole initialization.
func TestInitDependencies(t *testing.T) {
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Skip("no go tool on PATH")
	}
	out, err := exec.Command(goTool, "list", "-deps", ".").Output()
	if err != nil {
		t.Fatalf("go list -deps: %v", err)
	}
	for _, dep := range strings.Fields(string(out)) {
		switch {
		case dep == "net", dep == "net/http", strings.HasPrefix(dep, "vendor/golang.org/x/net"),
			strings.HasPrefix(dep, "google.golang.org/"), strings.HasPrefix(dep, "github.com/") && !strings.HasPrefix(dep, "github.com/rewind-sandbox/rewind/"):
			t.Errorf("package sandbox depends on %s", dep)
		}
	}
}
