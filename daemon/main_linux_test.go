package daemon_test

import (
	"os"
	"testing"

	"github.com/rewind-sandbox/rewind/sandbox"
)

func TestMain(m *testing.M) {
	sandbox.MaybeRunInit()
	os.Exit(m.Run())
}
