package policy

import (
	"runtime"
	"sync/atomic"
	"testing"
	"time"
)

// A classify call's deadline counts the CPU time of its thread: a thread
// the host does not run (here: asleep) is not stopped before the wall cap,
// one that runs (here: spinning) is stopped once it used the limit.
func TestWatchCPU(t *testing.T) {
	runtime.LockOSThread()
	defer runtime.UnlockOSThread()

	var fired atomic.Bool
	stop := watchCPU(5*time.Millisecond, 10*time.Second, func() { fired.Store(true) })
	time.Sleep(60 * time.Millisecond)
	if fired.Load() {
		t.Fatal("expired while its thread used no CPU")
	}
	start := time.Now()
	for !fired.Load() && time.Since(start) < 5*time.Second {
	}
	stop()
	if !fired.Load() {
		t.Fatal("did not expire while its thread spun")
	}

	// The wall cap stops a call whose thread does not run at all.
	fired.Store(false)
	stop = watchCPU(5*time.Millisecond, 30*time.Millisecond, func() { fired.Store(true) })
	time.Sleep(300 * time.Millisecond)
	stop()
	if !fired.Load() {
		t.Fatal("did not expire at its wall cap")
	}

	// A call that ends in time is never expired.
	fired.Store(false)
	stop = watchCPU(5*time.Millisecond, 30*time.Millisecond, func() { fired.Store(true) })
	stop()
	time.Sleep(60 * time.Millisecond)
	if fired.Load() {
		t.Fatal("expired after stop")
	}
}
