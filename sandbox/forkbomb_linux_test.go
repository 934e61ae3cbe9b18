package sandbox

import (
	"os"
	"strconv"
	"testing"
)

// TestForkBombInitSurvives repeats TestLimits' fork bomb on fresh
// sandboxes: the init shares the sandbox's pids limit, so it must never need
// a new OS thread once sandbox processes run (a Go runtime that fails to
// create one aborts, which killed the init about once in 30 TestLimits
// runs under load). Every round checks that the bomb filled the limit and
// that the init still answers, several times, while the limit is full.
func TestForkBombInitSurvives(t *testing.T) {
	rounds := 20
	if s := os.Getenv("REWIND_FORKBOMB_ROUNDS"); s != "" {
		if n, err := strconv.Atoi(s); err == nil && n > 0 {
			rounds = n
		}
	}
	for i := 0; i < rounds; i++ {
		sb := startTest(t, func(c *Config) { c.PidsMax = 16 })
		// The init's threads exist before any sandbox process runs.
		if n := initThreads(t, sb); n <= initSpareThreads {
			t.Fatalf("round %d: init has %d threads before the bomb, want > %d", i, n, initSpareThreads)
		}
		run(t, sb, "sh", "-c", "for i in $(seq 100); do sleep 1000 2>/dev/null & done 2>/dev/null; true")
		procs, err := sb.Processes()
		if err != nil || len(procs) < 16 {
			t.Fatalf("round %d: %d processes with pids.max 16 (%v)", i, len(procs), err)
		}
		// The init keeps serving while the limit is full: requests, and
		// spawn attempts that fail for lack of pids.
		for j := 0; j < 5; j++ {
			if err := sb.Ping(testCtx(t)); err != nil {
				t.Fatalf("round %d: init after fork bomb: %v", i, err)
			}
			_, _ = sb.Exec(testCtx(t), ExecRequest{Argv: []string{"true"}})
		}
		if err := sb.Ping(testCtx(t)); err != nil {
			t.Fatalf("round %d: init after spawns at the limit: %v", i, err)
		}
		if err := sb.Close(); err != nil {
			t.Fatalf("round %d: Close: %v", i, err)
		}
	}
}

// initThreads returns the number of threads of sb's init.
func initThreads(t *testing.T, sb *Sandbox) int {
	t.Helper()
	procs, err := sb.Processes()
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range procs {
		if p.PID == sb.InitPID() {
			return p.Threads
		}
	}
	t.Fatalf("init %d not among the sandbox's processes %v", sb.InitPID(), procs)
	return 0
}
