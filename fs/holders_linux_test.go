package fs

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/layer"
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

// A mount namespace made elsewhere while the view is mounted holds a copy
// of the mount, and with it the FUSE connection, after Unmount: Unmount
// aborts the connection once UnmountGrace has passed, and the copy is then
// dead (ENOTCONN), not served.
func TestUnmountEndsCopiesInOtherNamespaces(t *testing.T) {
	requireFUSE(t)
	dir := t.TempDir()
	st, err := layer.OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	mp := filepath.Join(dir, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		t.Fatal(err)
	}
	f, err := Mount(st, mp, Options{UnmountGrace: 100 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	mustWrite(t, filepath.Join(mp, "f"), "served")
	copyPath := testenv.ForeignMountNS(t) + filepath.Join(mp, "f")
	if b, err := os.ReadFile(copyPath); err != nil || string(b) != "served" {
		t.Fatalf("the copy of the mount before unmount: %q %v", b, err)
	}
	if err := f.Unmount(); err != nil {
		t.Fatalf("unmount: %v", err)
	}
	if _, err := os.ReadFile(copyPath); !errors.Is(err, syscall.ENOTCONN) {
		t.Fatalf("the copy after unmount: %v, want ENOTCONN", err)
	}
}

// A program started while views are mounted inherits none of their FUSE
// connections (go-fuse opens /dev/fuse without O_CLOEXEC).
func TestMountConnectionNotInherited(t *testing.T) {
	fx := mountT(t, nil, Options{})
	mustWrite(t, fx.p("f"), "x")
	out, err := exec.Command("sh", "-c", `for f in /proc/$$/fd/*; do readlink "$f"; done; true`).CombinedOutput()
	if err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	if strings.Contains(string(out), "/dev/fuse") {
		t.Fatalf("a child holds a FUSE connection:\n%s", out)
	}
}

// Mounts made while other mounts go away succeed: marking the new
// connection close-on-exec walks every descriptor of the process, and one
// closed by a concurrent unmount since the listing is no error.
func TestMountWhileOthersUnmount(t *testing.T) {
	requireFUSE(t)
	dir := t.TempDir()
	st, err := layer.OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		t.Fatal(err)
	}
	const workers, rounds = 4, 8
	var wg sync.WaitGroup
	errs := make(chan error, workers*rounds)
	for w := range workers {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := range rounds {
				mp := filepath.Join(dir, fmt.Sprintf("m%d-%d", w, r))
				if err := os.Mkdir(mp, 0o755); err != nil {
					errs <- err
					return
				}
				f, err := Mount(st, mp, Options{})
				if err != nil {
					errs <- fmt.Errorf("mount %d of worker %d: %w", r, w, err)
					return
				}
				if err := f.Unmount(); err != nil {
					errs <- fmt.Errorf("unmount %d of worker %d: %w", r, w, err)
					return
				}
			}
		}()
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}
}

// Marking a new FUSE connection close-on-exec finds it from the right
// hint, from a wrong one, and by the scan; it never touches another
// descriptor left inheritable on purpose (go-criu names its swrk socket
// by number on criu's command line).
func TestCloexecFuseFD(t *testing.T) {
	requireFUSE(t)
	for _, tc := range []struct {
		name string
		fn   func(fuseFD int) error
	}{
		{"hint", func(fd int) error { return cloexecFuseFD(fd) }},
		{"wrong hint", func(fd int) error { return cloexecFuseFD(fd + 100) }},
		{"no hint", func(int) error { return cloexecFuseFD(-1) }},
		{"scan", func(int) error { return cloexecFuseFDsScan() }},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var keep [2]int
			if err := unix.Pipe(keep[:]); err != nil { // no O_CLOEXEC
				t.Fatal(err)
			}
			defer unix.Close(keep[0])
			defer unix.Close(keep[1])
			fd, err := syscall.Open("/dev/fuse", syscall.O_RDWR, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer syscall.Close(fd)
			if err := tc.fn(fd); err != nil {
				t.Fatal(err)
			}
			flags, err := unix.FcntlInt(uintptr(fd), unix.F_GETFD, 0)
			if err != nil || flags&unix.FD_CLOEXEC == 0 {
				t.Fatalf("/dev/fuse descriptor flags %#x (%v): no close-on-exec", flags, err)
			}
			for _, p := range keep {
				if flags, err := unix.FcntlInt(uintptr(p), unix.F_GETFD, 0); err != nil || flags&unix.FD_CLOEXEC != 0 {
					t.Fatalf("an inheritable pipe got flags %#x (%v)", flags, err)
				}
			}
		})
	}
}
