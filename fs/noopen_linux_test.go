package fs

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestDifferentialNoOpen(t *testing.T) {
	runDifferentialOpts(t, 11, 1500, Options{NoOpen: true})
}

// primeNoOpen opens and closes one file, so that the kernel has learnt
// that the mount answers neither OPEN nor FLUSH. It returns once the
// RELEASE of the file's creation (sent before the kernel learnt it, and
// in the background) has arrived, so that counts taken afterwards do
// not catch it.
func primeNoOpen(t *testing.T, fx *fixture) {
	t.Helper()
	r0 := fx.fs.RequestCounts()["RELEASE"]
	defer func() {
		for deadline := time.Now().Add(2 * time.Second); fx.fs.RequestCounts()["RELEASE"] == r0 && time.Now().Before(deadline); {
			time.Sleep(time.Millisecond)
		}
	}()
	mustWrite(t, fx.p(".prime"), "x")
	mustRead(t, fx.p(".prime"))
	if err := os.Remove(fx.p(".prime")); err != nil {
		t.Fatal(err)
	}
}

// TestNoOpenRoundTrips: in no-open mode, opening, reading, writing and
// closing files costs no OPEN, RELEASE or FLUSH, and the data is right.
func TestNoOpenRoundTrips(t *testing.T) {
	fx := mountT(t, func(l string) {
		for i := range 20 {
			mustWrite(t, fmt.Sprintf("%s/r%d", l, i), fmt.Sprint("lower ", i))
		}
	}, Options{NoOpen: true})
	primeNoOpen(t, fx)
	before := fx.fs.RequestCounts()
	for i := range 20 {
		if got := mustRead(t, fx.p(fmt.Sprintf("r%d", i))); got != fmt.Sprint("lower ", i) {
			t.Errorf("r%d: %q", i, got)
		}
		mustWrite(t, fx.p(fmt.Sprintf("w%d", i)), fmt.Sprint("new ", i))
	}
	w, err := os.OpenFile(fx.p("r0"), os.O_WRONLY|os.O_APPEND, 0)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := w.WriteString("+"); err != nil {
		t.Fatal(err)
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	got := countsSince(fx, before)
	for _, op := range []string{"OPEN", "RELEASE", "FLUSH"} {
		if got[op] != 0 {
			t.Errorf("%s requests: %d, want 0 (all: %v)", op, got[op], got)
		}
	}
	if s := mustRead(t, fx.p("r0")); s != "lower 0+" {
		t.Errorf("r0 after append: %q", s)
	}
	if s := mustRead(t, fx.upperPath("r0")); s != "lower 0+" {
		t.Errorf("upper r0: %q", s)
	}
	if s := mustRead(t, fx.lower+"/r0"); s != "lower 0" {
		t.Errorf("lower r0 was written: %q", s)
	}
	for i := range 20 {
		if s := mustRead(t, fx.p(fmt.Sprintf("w%d", i))); s != fmt.Sprint("new ", i) {
			t.Errorf("w%d: %q", i, s)
		}
	}
}

// TestNoOpenUnlinkedOpenFile: a file opened (no request in no-open mode)
// and unlinked or renamed over before its first read or write stays
// readable and writable through the descriptor, for a file in the upper,
// in a frozen layer and in a lower one; frozen and lower layers are never
// written, and the view no longer has the name.
func TestNoOpenUnlinkedOpenFile(t *testing.T) {
	for _, where := range []string{"upper", "frozen", "lower"} {
		for _, how := range []string{"unlink", "rename-over"} {
			t.Run(where+"/"+how, func(t *testing.T) {
				fx := mountT(t, func(l string) { mustWrite(t, l+"/f", "base") }, Options{NoOpen: true})
				primeNoOpen(t, fx)
				switch where {
				case "upper":
					if err := os.Remove(fx.p("f")); err != nil {
						t.Fatal(err)
					}
					mustWrite(t, fx.p("f"), "base")
				case "frozen":
					if err := os.Remove(fx.p("f")); err != nil {
						t.Fatal(err)
					}
					mustWrite(t, fx.p("f"), "base")
					fx.checkpoint(t)
				}
				// O_DIRECT: reads and writes reach the daemon.
				fd, err := unix.Open(fx.p("f"), unix.O_RDWR|unix.O_DIRECT, 0)
				if err != nil {
					t.Fatal(err)
				}
				defer unix.Close(fd)
				if how == "unlink" {
					if err := os.Remove(fx.p("f")); err != nil {
						t.Fatal(err)
					}
				} else {
					mustWrite(t, fx.p("g"), "other")
					if err := os.Rename(fx.p("g"), fx.p("f")); err != nil {
						t.Fatal(err)
					}
				}
				buf := make([]byte, 4096)
				if n, err := unix.Pread(fd, buf, 0); err != nil || string(buf[:n]) != "base" {
					t.Fatalf("read after the name went: %q %v", buf[:max(n, 0)], err)
				}
				fx.checkpoint(t)
				data := make([]byte, 4096)
				copy(data, "BASE")
				if _, err := unix.Pwrite(fd, data, 0); err != nil {
					t.Fatalf("write after the name went: %v", err)
				}
				if n, err := unix.Pread(fd, buf, 0); err != nil || n != 4096 || string(buf[:4]) != "BASE" {
					t.Fatalf("read back: %q %v", buf[:min(max(n, 0), 4)], err)
				}
				if s := mustRead(t, fx.lower+"/f"); s != "base" {
					t.Errorf("lower layer written: %q", s)
				}
				for _, l := range fx.fs.st.frozen {
					if b, err := os.ReadFile(l.path + "/f"); err == nil && strings.HasPrefix(string(b), "BASE") {
						t.Errorf("frozen layer %s written", l.path)
					}
				}
				want := ""
				if how == "rename-over" {
					want = "other"
				}
				b, err := os.ReadFile(fx.p("f"))
				switch {
				case want == "" && !os.IsNotExist(err):
					t.Errorf("view still has f: %q %v", b, err)
				case want != "" && string(b) != want:
					t.Errorf("view f: %q %v, want %q", b, err, want)
				}
			})
		}
	}
}

// TestNoOpenManyFiles: more files read and written than implicit handles
// are kept stay correct (idle handles are closed and reopened), across a
// checkpoint and a restore.
func TestNoOpenManyFiles(t *testing.T) {
	fx := mountT(t, nil, Options{NoOpen: true})
	n := 3 * implicitMax
	for i := range n {
		mustWrite(t, fx.p(fmt.Sprintf("f%d", i)), fmt.Sprint("one ", i))
	}
	c1 := fx.checkpoint(t)
	for i := range n {
		if i%2 == 0 {
			mustWrite(t, fx.p(fmt.Sprintf("f%d", i)), fmt.Sprint("two ", i))
		}
	}
	fx.fs.implMu.Lock()
	held := len(fx.fs.implNodes)
	fx.fs.implMu.Unlock()
	if held > implicitMax {
		t.Errorf("%d nodes hold implicit handles, want at most %d", held, implicitMax)
	}
	for i := range n {
		want := fmt.Sprint("one ", i)
		if i%2 == 0 {
			want = fmt.Sprint("two ", i)
		}
		if got := mustRead(t, fx.p(fmt.Sprintf("f%d", i))); got != want {
			t.Fatalf("f%d: %q, want %q", i, got, want)
		}
	}
	fx.restore(t, c1)
	for i := range n {
		if got := mustRead(t, fx.p(fmt.Sprintf("f%d", i))); got != fmt.Sprint("one ", i) {
			t.Fatalf("f%d after restore: %q", i, got)
		}
	}
}
