package daemon_test

import (
	"context"
	"errors"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/state"
	"golang.org/x/sys/unix"
)

// TestCrashCalls kills the daemon (SIGKILL) while four clients call one
// sandbox at once (sends, auto turns waited for or not, restores, forks,
// GC), starts a new daemon on the same state and restores every checkpoint
// that was reported durable before the crash, asking the shell each time.
// Odd seeds run the sandbox on FUSE, even ones on the kernel path (the
// state dir on its own XFS). The crash lands at a random moment, so each
// run differs; the suite runs 4 seeds (about 9 s each), REWIND_STRESS_N
// asks for more:
//
//	REWIND_STRESS_N=100 go test -run 'TestCrashCalls$' -v ./daemon/
func TestCrashCalls(t *testing.T) {
	n := 4
	if v, err := strconv.Atoi(os.Getenv("REWIND_STRESS_N")); err == nil && v > 0 {
		n = v
	}
	for seed := 1; seed <= n; seed++ {
		fsKind := "fuse"
		if seed%2 == 0 {
			fsKind = "kernel"
		}
		t.Run(fmt.Sprintf("seed%d-%s", seed, fsKind), func(t *testing.T) { crashCalls(t, seed, fsKind) })
	}
}

func crashCalls(t *testing.T, seed int, fsKind string) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	stateDir, sock := filepath.Join(dir, "state"), filepath.Join(dir, "run", "rewind.sock")
	if fsKind == "kernel" {
		_, err := exec.LookPath("mkfs.xfs")
		testenv.Require(t, err == nil, "mkfs.xfs (xfsprogs)")
		if _, err := kernelpath.InitStore(kernelpath.StoreImage{Image: filepath.Join(dir, "store.img"), FS: "xfs", Size: kernelpath.MinImageSize, StateDir: stateDir}); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { unix.Unmount(stateDir, unix.MNT_DETACH) })
	}
	cmd, c := spawnDaemon(t, stateDir, sock, "real")
	ctx := context.Background()
	bashSandbox(t, c, api.CreateRequest{Name: "x", FS: fsKind, Policy: "effects"})
	send(t, c, "x", "b", "mkdir -p /w; cd /w; n=0; echo @@done@@")
	r0, err := c.Turn(ctx, "x", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	ids := []string{r0.ID}
	durable := map[string]bool{r0.ID: true}
	freed := map[string]bool{}
	gcCut := false // a GC call failed: what it freed is unknown
	var crashed atomic.Bool
	var wg sync.WaitGroup
	for g := range 4 {
		wg.Add(1)
		go func() {
			defer wg.Done()
			rng := rand.New(rand.NewPCG(uint64(seed), uint64(g)))
			for k := 0; k < 200 && !crashed.Load(); k++ {
				cctx, cancel := context.WithTimeout(ctx, 30*time.Second)
				switch rng.IntN(7) {
				case 0, 1:
					c.Send(cctx, "x", "b", api.SendRequest{Text: fmt.Sprintf("n=$((n+1)); echo $n > /w/g%d; echo @@done@@", g), Until: "@@done@@", TimeoutMS: 20000})
				case 2, 3:
					r, err := c.Turn(cctx, "x", api.TurnRequest{Mode: "auto", Defer: rng.IntN(2) == 0, Wait: rng.IntN(2) == 0})
					if err == nil {
						mu.Lock()
						ids = append(ids, r.ID)
						if r.Durable {
							durable[r.ID] = true
						}
						mu.Unlock()
						if !r.Durable && rng.IntN(2) == 0 {
							if ck, err := c.Wait(cctx, r.ID); err == nil && ck.Durable {
								mu.Lock()
								durable[r.ID] = true
								mu.Unlock()
							}
						}
					}
				case 4:
					mu.Lock()
					id := ids[rng.IntN(len(ids))]
					mu.Unlock()
					c.Restore(cctx, "x", id, 0)
				case 5:
					mu.Lock()
					id := ids[rng.IntN(len(ids))]
					mu.Unlock()
					if res, err := c.Fork(cctx, id, api.ForkRequest{Count: 1, Prefix: fmt.Sprintf("f%d-%d-", g, k)}); err == nil {
						c.Remove(cctx, res.Sandboxes[0])
					}
				case 6:
					res, err := c.GC(cctx, false)
					mu.Lock()
					if err == nil {
						for _, f := range res.Freed {
							freed[f] = true
						}
					} else {
						// Cut short, by the crash or not: what it
						// freed is unknown.
						gcCut = true
					}
					mu.Unlock()
				}
				cancel()
			}
		}()
	}
	time.Sleep(time.Duration(1500+rand.New(rand.NewPCG(uint64(seed), 99)).IntN(3000)) * time.Millisecond)
	crashed.Store(true)
	killDaemon(t, cmd)
	wg.Wait()
	_, c2 := spawnDaemon(t, stateDir, sock, "real")
	mu.Lock()
	defer mu.Unlock()
	n, bad := 0, 0
	for id := range durable {
		if freed[id] {
			continue
		}
		n++
		if _, err := c2.Restore(ctx, "x", id, 0); err != nil {
			if errors.Is(err, state.ErrNotFound) && gcCut {
				t.Logf("durable %s not found after the crash (a GC call was cut short)", id)
				continue
			}
			bad++
			t.Errorf("restore of durable %s after the crash: %v", id, err)
			continue
		}
		out, err := c2.Send(ctx, "x", "b", api.SendRequest{Text: "echo alive n=$n; echo @@done@@", Until: "@@done@@", TimeoutMS: 20000})
		if err != nil {
			bad++
			t.Errorf("session after restoring %s: %v %q", id, err, out)
		}
	}
	t.Logf("%d durable checkpoints restored after the crash, %d bad, %d ids in all", n, bad, len(ids))
}
