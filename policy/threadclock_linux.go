package policy

import (
	"time"

	"golang.org/x/sys/unix"
)

// threadClock returns a reader of the CPU time the calling OS thread has
// used, which works from any thread of the process (its per-thread CPU
// clock, MAKE_THREAD_CPUCLOCK(tid, CPUCLOCK_SCHED)). Call it on a locked
// thread.
func threadClock() func() (time.Duration, bool) {
	id := int32(^unix.Gettid()<<3 | 6)
	return func() (time.Duration, bool) {
		var ts unix.Timespec
		if unix.ClockGettime(id, &ts) != nil {
			return 0, false
		}
		return time.Duration(ts.Nano()), true
	}
}
