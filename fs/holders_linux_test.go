package fs

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

func TestFuseHoldersNamesTheNamespaceOfTheMount(t *testing.T) {
	fx := mountT(t, nil, Options{})
	ns, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		t.Fatal(err)
	}
	if got := fuseHolders(fx.fs.dev); !strings.Contains(got, ns+"]") && !strings.Contains(got, ns+",") {
		t.Errorf("holders of the mount: %q, want this process's namespace %s", got, ns)
	}
	// A device no mount has: nobody holds it.
	if got := fuseHolders(unix.Mkdev(4095, 1048575)); strings.Contains(got, ns) || !strings.HasSuffix(got, "holding the mount: []") {
		t.Errorf("holders of an unused device: %q", got)
	}
	if got := fuseHolders(0); got != "no device number recorded" {
		t.Errorf("holders of device 0: %q", got)
	}
}
