//go:build !linux

package policy

import "time"

// threadClock cannot read a thread's CPU time on this platform: the
// deadline is then wall time.
func threadClock() func() (time.Duration, bool) {
	return func() (time.Duration, bool) { return 0, false }
}
