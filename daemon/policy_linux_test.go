package daemon_test

import (
	"context"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
)

// TestRealPolicyPreloaded checks the daemon loads its default policy while
// it starts (the first create does not wait for the compilation), and that
// sandboxes then share that one load.
func TestRealPolicyPreloaded(t *testing.T) {
	d := startReal(t, t.TempDir())
	c, ctx := d.c, context.Background()
	const loaded = `rewind_policy_load_seconds_count{policy="effects",source="compile"} 1`
	metrics := func() string {
		t.Helper()
		m, err := c.Metrics(ctx)
		if err != nil {
			t.Fatal(err)
		}
		return m
	}
	// A cold compile takes seconds on a loaded host: wait for it, with no
	// sandbox asking for the policy.
	deadline := time.Now().Add(2 * time.Minute)
	for !strings.Contains(metrics(), loaded) {
		if time.Now().After(deadline) {
			t.Fatalf("the default policy was not loaded without a sandbox:\n%s", grepLines(metrics(), "rewind_policy_load"))
		}
		time.Sleep(50 * time.Millisecond)
	}
	for _, name := range []string{"p1", "p2"} {
		if _, err := c.Create(ctx, api.CreateRequest{Name: name}); err != nil {
			t.Fatal(err)
		}
	}
	m := metrics()
	if !strings.Contains(m, loaded) || strings.Contains(m, `rewind_policy_load_seconds_count{policy="effects",source="host"}`) {
		t.Fatalf("sandboxes loaded the policy again:\n%s", grepLines(m, "rewind_policy_load"))
	}
}

func grepLines(s, sub string) string {
	var out []string
	for _, l := range strings.Split(s, "\n") {
		if strings.Contains(l, sub) {
			out = append(out, l)
		}
	}
	return strings.Join(out, "\n")
}
