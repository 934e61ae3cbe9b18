package probe

import (
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestEBPFLoads(t *testing.T) {
	testenv.RequireRoot(t)
	if err := CheckEBPF(); err != nil {
		t.Fatalf("CheckEBPF: %v", err)
	}
}
