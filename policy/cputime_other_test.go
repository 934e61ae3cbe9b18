//go:build !linux

package policy

import "time"

// cpuTime is not measured on this platform.
func cpuTime() time.Duration { return 0 }
