package policy

import (
	"fmt"
	"time"
)

// Mode is what a turn's checkpoint must capture. Its zero value is Full, the
// safe decision.
type Mode uint8

// Checkpoint modes.
const (
	// Full checkpoints the file system and every process.
	Full Mode = iota
	// FS checkpoints the file system only.
	FS
	// Skip takes no checkpoint.
	Skip
)

// String returns "full", "fs" or "skip".
func (m Mode) String() string {
	switch m {
	case Full:
		return "full"
	case FS:
		return "fs"
	case Skip:
		return "skip"
	}
	return fmt.Sprintf("mode(%d)", uint8(m))
}

// ParseMode parses "skip", "fs" (or "fs-only") and "full".
func ParseMode(s string) (Mode, error) {
	switch s {
	case "full":
		return Full, nil
	case "fs", "fs-only":
		return FS, nil
	case "skip":
		return Skip, nil
	}
	return Full, fmt.Errorf("unknown checkpoint mode %q (want skip, fs or full)", s)
}

// MarshalText implements encoding.TextMarshaler.
func (m Mode) MarshalText() ([]byte, error) { return []byte(m.String()), nil }

// UnmarshalText implements encoding.TextUnmarshaler.
func (m *Mode) UnmarshalText(b []byte) error {
	v, err := ParseMode(string(b))
	if err != nil {
		return err
	}
	*m = v
	return nil
}

// Decision is the outcome of classifying one turn.
type Decision struct {
	// Mode is the checkpoint to take.
	Mode Mode
	// Reason is the policy's short explanation (at most 256 bytes), or, when
	// Fallback is set, why the host chose Full.
	Reason string
	// Fallback is true when the policy did not decide (it failed, is
	// disabled, or its decision was overridden) and the host chose Full.
	Fallback bool
	// Latency is the time Decide took.
	Latency time.Duration
}
