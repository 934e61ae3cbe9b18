package pause

import (
	"testing"
	"time"
)

func TestForSleepsAtLeastD(t *testing.T) {
	for _, d := range []time.Duration{time.Microsecond, 50 * time.Microsecond, 2 * time.Millisecond} {
		t0 := time.Now()
		For(d)
		if got := time.Since(t0); got < d {
			t.Errorf("For(%v) returned after %v", d, got)
		}
	}
}
