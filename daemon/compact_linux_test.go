package daemon_test

import (
	"context"
	"fmt"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/layer"
)

// TestRealCompaction: with a small compact depth, a long chain of fs-only
// checkpoints is merged in the background, the live stack gets shallow,
// and every checkpoint still restores to exactly its own files.
func TestRealCompaction(t *testing.T) {
	dir := t.TempDir()
	const depth = 4
	d := startRealWith(t, dir, func(c *daemon.Config) { c.CompactDepth = depth })
	c, ctx := d.c, context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "deep"}); err != nil {
		t.Fatal(err)
	}
	const n = 3*depth + 1
	ids := make([]string, n)
	for i := range n {
		// Each turn adds a file and rewrites a shared one, so every layer
		// has content and the merge has shadowing to get right.
		sh(t, c, "deep", fmt.Sprintf("mkdir -p /w && echo %d > /w/f%d && echo %d > /w/shared && rm -f /w/f%d", i, i, i, i-2))
		r, err := c.Turn(ctx, "deep", api.TurnRequest{Mode: "fs", Wait: true})
		if err != nil {
			t.Fatal(err)
		}
		ids[i] = r.ID
	}
	// The compaction runs in the background; the live stack gets shallow.
	st, err := layer.OpenStore(filepath.Join(dir, "state", "layers"))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(30 * time.Second)
	for {
		ms, err := st.Mounts()
		if err != nil {
			t.Fatal(err)
		}
		if len(ms) != 1 {
			t.Fatalf("mount records: %d, want 1", len(ms))
		}
		if len(ms[0].Layers) < depth {
			break
		}
		if time.Now().After(deadline) {
			t.Fatalf("stack still %d layers deep after %d checkpoints (compact depth %d)", len(ms[0].Layers), n, depth)
		}
		time.Sleep(50 * time.Millisecond)
	}
	want := func(i int) string {
		var files []string
		for j := range i + 1 {
			if j < i-1 {
				continue // removed by turn j+2
			}
			files = append(files, fmt.Sprintf("f%d=%d", j, j))
		}
		files = append(files, fmt.Sprintf("shared=%d", i))
		return strings.Join(files, " ")
	}
	var epoch uint64
	for _, i := range []int{0, 1, depth, n / 2, n - 1, 2} {
		r, err := c.Restore(ctx, "deep", ids[i], epoch)
		if err != nil {
			t.Fatalf("restore checkpoint %d: %v", i, err)
		}
		epoch = r.Epoch
		got := sh(t, c, "deep", `cd /w && for f in $(ls | sort -V); do printf '%s=%s ' "$f" "$(cat "$f")"; done`)
		if got != want(i) {
			t.Errorf("checkpoint %d: files %q, want %q", i, got, want(i))
		}
	}
}
