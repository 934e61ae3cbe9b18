package daemon_test

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"runtime"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/state"
)

// TestConcurrentCalls drives one sandbox with calls from four clients at
// once, in random order, as a harness with parallel workers (or a buggy
// one) would: sends to the shell, execs, auto turns (deferred or not,
// waited for or not), restores and forks of any id handed out so far, and
// garbage collections, which free what no head reaches. Whatever the
// interleaving, the daemon must answer every call (a call that hangs, or a
// deadlock, fails the test with every goroutine's stack), fail only as the
// API says it may (an id collected meanwhile is not found), end every
// checkpoint ready, and the sandbox must still checkpoint, restore and
// answer afterwards. It found a fork that failed when it came before the
// checkpoint's image, a daemon hung for good by a shell digest's copy that
// a checkpoint froze in the middle of an injected call, and (kernel path)
// images that failed when a restore replaced the sandbox's root meanwhile.
func TestConcurrentCalls(t *testing.T) {
	for _, tc := range []struct {
		fs   string
		seed uint64
	}{{"fuse", 2}, {"fuse", 4}, {"kernel", 3}, {"kernel", 5}} {
		t.Run(fmt.Sprintf("%s/seed%d", tc.fs, tc.seed), func(t *testing.T) {
			concurrentCalls(t, tc.fs, tc.seed)
		})
	}
}

func concurrentCalls(t *testing.T, fsKind string, seed uint64) {
	d := startKernelDaemon(t)
	c, ctx := d.c, context.Background()
	bashSandbox(t, c, api.CreateRequest{Name: "x", FS: fsKind, Policy: "effects"})
	send(t, c, "x", "b", "mkdir -p /w; cd /w; n=0; echo @@done@@")
	r0, err := c.Turn(ctx, "x", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	var (
		mu    sync.Mutex
		ids   = []string{r0.ID}
		ops   = map[string]int{}
		fails []string
	)
	note := func(op string, err error) {
		mu.Lock()
		defer mu.Unlock()
		ops[op]++
		if err != nil && !errors.Is(err, state.ErrNotFound) {
			fails = append(fails, op+": "+err.Error())
		}
	}
	pick := func(rng *rand.Rand) string {
		mu.Lock()
		defer mu.Unlock()
		return ids[rng.IntN(len(ids))]
	}
	const workers, calls = 4, 50
	var wg sync.WaitGroup
	for g := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(seed, uint64(g)))
			for k := range calls {
				cctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
				switch rng.IntN(8) {
				case 0, 1:
					_, err := c.Send(cctx, "x", "b", api.SendRequest{Text: fmt.Sprintf("n=$((n+1)); echo $n > /w/g%d; echo @@done@@", g), Until: "@@done@@", TimeoutMS: 60000})
					note("send", err)
				case 2:
					var o bytes.Buffer
					_, err := c.Exec(cctx, "x", api.ExecRequest{Argv: []string{"sh", "-c", fmt.Sprintf("echo %d >> /w/e", g)}}, &o, &o)
					note("exec", err)
				case 3, 4:
					r, err := c.Turn(cctx, "x", api.TurnRequest{Mode: "auto", Defer: rng.IntN(2) == 0, Wait: rng.IntN(2) == 0})
					note("turn", err)
					if err == nil {
						mu.Lock()
						ids = append(ids, r.ID)
						mu.Unlock()
					}
				case 5:
					_, err := c.Restore(cctx, "x", pick(rng), 0)
					note("restore", err)
				case 6:
					res, err := c.Fork(cctx, pick(rng), api.ForkRequest{Count: 1, Prefix: fmt.Sprintf("f%d-%d-", g, k)})
					note("fork", err)
					if err == nil {
						note("remove", c.Remove(cctx, res.Sandboxes[0]))
					}
				case 7:
					_, err := c.GC(cctx, false)
					note("gc", err)
				}
				cancel()
			}
		}()
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	select {
	case <-done:
	case <-time.After(4 * time.Minute):
		buf := make([]byte, 1<<24)
		n := runtime.Stack(buf, true)
		mu.Lock()
		t.Logf("calls so far: %v", ops)
		mu.Unlock()
		t.Fatalf("the calls did not finish in 4 minutes; goroutines:\n%s", buf[:n])
	}
	t.Logf("calls: %v", ops)
	if len(fails) > 0 {
		t.Errorf("%d calls failed:\n%s", len(fails), strings.Join(fails, "\n"))
	}
	for _, id := range ids {
		// Deferred turns' checkpoints may still be at work: each must
		// end ready (Wait fails for a failed one).
		wctx, cancel := context.WithTimeout(ctx, time.Minute)
		ck, err := c.Wait(wctx, id)
		cancel()
		if errors.Is(err, state.ErrNotFound) {
			continue // collected
		}
		if err != nil {
			t.Errorf("checkpoint %s: %v", id, err)
		} else if ck.Status != state.CkptReady {
			t.Errorf("checkpoint %s is %s", id, ck.Status)
		}
	}
	// The sandbox still works: a checkpoint, a change, a restore.
	send(t, c, "x", "b", "final=1; echo @@done@@")
	r, err := c.Turn(ctx, "x", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatalf("turn after the calls: %v", err)
	}
	send(t, c, "x", "b", "final=2; echo @@done@@")
	if _, err := c.Restore(ctx, "x", r.ID, 0); err != nil {
		t.Fatalf("restore after the calls: %v", err)
	}
	if got := send(t, c, "x", "b", "echo final=$final; echo @@done@@"); got != "final=1" {
		t.Errorf("after the last restore the shell says %q, want final=1", got)
	}
}
