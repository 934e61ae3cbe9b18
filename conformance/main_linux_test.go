package conformance

import (
	"os"
	"testing"

	"github.com/rewind-sandbox/rewind/sandbox"
)

// TestMain lets the test binary serve as the sandbox init (process paths).
func TestMain(m *testing.M) {
	sandbox.MaybeRunInit()
	os.Exit(m.Run())
}
