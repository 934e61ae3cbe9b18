package policy

import (
	"syscall"
	"time"
)

// cpuTime is the CPU time this process used (user + system): less disturbed
// than wall time by other work on the machine.
func cpuTime() time.Duration {
	var ru syscall.Rusage
	if syscall.Getrusage(syscall.RUSAGE_SELF, &ru) != nil {
		return 0
	}
	return time.Duration(ru.Utime.Nano() + ru.Stime.Nano())
}
