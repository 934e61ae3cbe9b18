package main

import (
	"context"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/policy"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func TestClassify(t *testing.T) {
	shellOnly := effect.Mem{PagesWritten: 4, PerProc: []effect.ProcPages{{PID: 1, Comm: "bash", Pages: 4}}}
	tests := []struct {
		name string
		r    effect.Report
		want guest.Decision
	}{
		{"nothing", effect.Report{}, guest.Skip},
		{"shell heap only", effect.Report{Mem: shellOnly}, guest.Skip},
		{"shell heap and a file", effect.Report{Mem: shellOnly, FS: effect.FS{Created: 1}}, guest.FS},
		{"python heap", effect.Report{Mem: effect.Mem{PagesWritten: 4, PerProc: []effect.ProcPages{{Comm: "python3", Pages: 4}}}}, guest.Full},
		{"unattributed pages", effect.Report{Mem: effect.Mem{PagesWritten: 9, PerProc: shellOnly.PerProc}}, guest.Full},
		{"shell heap and a new daemon", effect.Report{Mem: shellOnly, Proc: effect.Proc{Forked: 1, NewLongLived: 1}}, guest.Full},
		{"lost events", effect.Report{Mem: shellOnly, LostEvents: 1}, guest.Full},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got, reason := Classify(&tt.r); got != tt.want {
				t.Fatalf("Classify = %d (%s), want %d", got, reason, tt.want)
			}
		})
	}
}

// TestBuildAndRun builds the example the way its README says and runs the
// module in rewind's policy host.
func TestBuildAndRun(t *testing.T) {
	goBin, err := exec.LookPath("go")
	testenv.Require(t, err == nil, "the Go toolchain on PATH")
	out := filepath.Join(t.TempDir(), "policy.wasm")
	cmd := exec.Command(goBin, "build", "-buildmode=c-shared", "-trimpath", "-o", out, ".")
	cmd.Env = append(os.Environ(), "GOOS=wasip1", "GOARCH=wasm")
	if b, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, b)
	}
	ctx := context.Background()
	h, err := policy.NewHost(ctx, policy.Options{Timeout: 10 * time.Second})
	if err != nil {
		t.Fatal(err)
	}
	defer h.Close(ctx)
	p, err := h.LoadFile(ctx, out)
	if err != nil {
		t.Fatal(err)
	}
	r := effect.Report{Mem: effect.Mem{PagesWritten: 2, PerProc: []effect.ProcPages{{PID: 3, Comm: "bash", Pages: 2}}}}
	d, err := p.Decide(ctx, &r)
	if err != nil || d.Fallback || d.Mode != policy.Skip {
		t.Fatalf("decision %+v, %v; want skip", d, err)
	}
	t.Logf("decided %v: %s", d.Mode, d.Reason)
}
