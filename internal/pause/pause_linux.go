// Package pause sleeps for short times precisely.
//
// time.Sleep of a few tens of microseconds sleeps about a millisecond on
// Linux (the runtime's timers wake the scheduler with millisecond
// resolution), which made every short poll on a restore's critical path
// cost a millisecond. For waits expected to end within microseconds, For
// sleeps the calling thread with nanosleep(2) instead (60-100 µs at the
// kernel's default timer slack).
package pause

import (
	"time"

	"golang.org/x/sys/unix"
)

// For sleeps for about d (at least d), blocking the calling OS thread.
// Use it only for short waits (up to a millisecond or so).
func For(d time.Duration) {
	ts := unix.NsecToTimespec(int64(d))
	for {
		var rem unix.Timespec
		err := unix.Nanosleep(&ts, &rem)
		if err != unix.EINTR {
			return
		}
		ts = rem
	}
}
