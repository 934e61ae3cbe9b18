package compat

import (
	"errors"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/kernelpath"
)

// ChooseFS picks the kernel path only with the layer-switch ioctl (and a
// passing self-test), FUSE otherwise, and says why.
func TestChooseFS(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	ch := ChooseFS(dir)
	if ch.Reason == "" {
		t.Fatalf("no reason: %+v", ch)
	}
	switch err := kernelpath.ProbeSwitchIoctl(dir); {
	case errors.Is(err, kernelpath.ErrIoctlAbsent):
		if ch.Backend != "fuse" || !strings.Contains(ch.Reason, "layer-switch ioctl") {
			t.Errorf("stock kernel: chose %+v, want fuse because of the missing ioctl", ch)
		}
	case err == nil:
		if ch.Backend != "kernel" || !strings.Contains(ch.Reason, "self-test") {
			t.Errorf("patched kernel: chose %+v, want kernel with the self-test's numbers", ch)
		}
	default:
		t.Fatalf("ioctl probe: %v", err)
	}
}
