package sandbox

import (
	"context"
	"fmt"
	"os"
	"strings"
	"testing"
	"time"
)

func TestSpares(t *testing.T) {
	requireSandbox(t)
	sp := NewSpares(2, "", nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 2 })
	sp.mu.Lock()
	var sparePIDs []int
	for _, ip := range sp.ready {
		sparePIDs = append(sparePIDs, ip.cmd.Process.Pid)
	}
	sp.mu.Unlock()
	for i := 0; i < 4; i++ {
		root, binds := testRoot(t)
		sb, err := sp.Start(testCtx(t), Config{ID: fmt.Sprintf("spare-%d-%d", os.Getpid(), i), Root: root, Binds: binds})
		if err != nil {
			t.Fatal(err)
		}
		if i == 0 && sb.InitPID() != sparePIDs[0] {
			t.Errorf("first start did not use a spare")
		}
		if out := sh(t, sb, "hostname; cat /proc/1/cmdline; echo; ls /run/rewind | wc -l"); out != sb.ID()+"\nrewind-init\x00\n0\n" {
			t.Errorf("sandbox on a spare: %q", out)
		}
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sb.InitPID()))
		if !strings.Contains(string(cg), ":freezer:/rewind/"+sb.ID()+"\n") {
			t.Errorf("spare init not in the sandbox's cgroup:\n%s", cg)
		}
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
	}
	waitFor(t, "refill", func() bool { return sp.Ready() == 2 })
	sp.mu.Lock()
	var left []int
	for _, ip := range sp.ready {
		left = append(left, ip.cmd.Process.Pid)
	}
	sp.mu.Unlock()
	sp.Close()
	for _, pid := range left {
		deadline := time.Now().Add(10 * time.Second)
		for alive(pid) && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if alive(pid) {
			t.Fatalf("spare %d survived Close", pid)
		}
	}
	// Start after Close still works (no spares).
	root, binds := testRoot(t)
	sb, err := sp.Start(context.Background(), Config{ID: fmt.Sprintf("spare-%d-late", os.Getpid()), Root: root, Binds: binds})
	if err != nil {
		t.Fatal(err)
	}
	sb.Close()
}
