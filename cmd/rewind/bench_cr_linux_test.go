package main

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestBenchCRRows runs `rewind bench cr` once at its smallest size: every
// row the issue asks for is there with a measured, positive time, the fork
// rows count their copies' private memory, and a restored copy answered
// (runCRBench checks the buffer's length after the restores).
func TestBenchCRRows(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := criu.Find("")
	testenv.RequireNoErr(t, err, "CRIU (make deps installs it)")
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	rows, err := runCRBench(ctx, 2, 15, false)
	if err != nil {
		t.Fatal(err)
	}
	got := map[string]crBenchRow{}
	for _, r := range rows {
		got[r.Op] = r
	}
	for _, op := range []string{
		"fork() baseline", "checkpoint frozen", "restore template", "restore template+warm",
		"restore criu (evicted)", "restore criu lazy-pages", "first write (no warm)", "first write (warm)",
		"fork 16 copies", "fork 32 copies", "fork 64 copies",
	} {
		r, ok := got[op]
		if !ok {
			t.Errorf("no %q row", op)
			continue
		}
		if r.N == 0 || r.P50MS <= 0 {
			t.Errorf("%q: n %d, p50 %.3f ms", op, r.N, r.P50MS)
		}
		if strings.HasPrefix(op, "fork ") && op != "fork() baseline" {
			if r.PrivateKiBPerCopy <= 0 || r.BaseP50MS <= 0 {
				t.Errorf("%q: %.0f KiB per copy, baseline %.3f ms", op, r.PrivateKiBPerCopy, r.BaseP50MS)
			}
		}
	}
	if r := got["restore template"]; len(r.Phases) == 0 {
		t.Error("restore template: no steps")
	}
}
