package procfs

import (
	"bytes"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestReadFile(t *testing.T) {
	dir := t.TempDir()
	big := bytes.Repeat([]byte("0123456789abcdef"), 1000) // several buffer growths
	if err := os.WriteFile(filepath.Join(dir, "big"), big, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "empty"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink("big", filepath.Join(dir, "link")); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		name, path string
		want       []byte // nil: compare with os.ReadFile
		notExist   bool
		anyErr     bool
	}{
		{name: "proc stat", path: PIDPath(os.Getpid(), "stat")},
		{name: "proc status", path: "/proc/self/status"},
		{name: "proc cmdline", path: "/proc/self/cmdline"},
		{name: "proc maps", path: "/proc/self/maps"},
		{name: "large regular file", path: filepath.Join(dir, "big"), want: big},
		{name: "empty file", path: filepath.Join(dir, "empty"), want: []byte{}},
		{name: "missing", path: filepath.Join(dir, "nope"), notExist: true},
		{name: "missing pid", path: PIDPath(1<<30, "stat"), notExist: true},
		{name: "symlink outside /proc is not followed", path: filepath.Join(dir, "link"), anyErr: true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ReadFile(tc.path)
			switch {
			case tc.notExist:
				if !errors.Is(err, fs.ErrNotExist) {
					t.Fatalf("ReadFile(%s) error = %v, want not exist", tc.path, err)
				}
				return
			case tc.anyErr:
				if err == nil {
					t.Fatalf("ReadFile(%s) succeeded, want an error", tc.path)
				}
				return
			case err != nil:
				t.Fatal(err)
			}
			want := tc.want
			if want == nil {
				if want, err = os.ReadFile(tc.path); err != nil {
					t.Fatal(err)
				}
			}
			// /proc content may move between two reads (maps, status):
			// compare the first line, and the length loosely.
			if tc.want == nil {
				first := func(b []byte) []byte { l, _, _ := bytes.Cut(b, []byte("\n")); return l }
				if !bytes.Equal(first(got), first(want)) && tc.name != "proc stat" {
					t.Fatalf("first line %q, os.ReadFile has %q", first(got), first(want))
				}
				if len(got) == 0 || len(got) < len(want)/2 {
					t.Fatalf("read %d bytes, os.ReadFile %d", len(got), len(want))
				}
				return
			}
			if !bytes.Equal(got, want) {
				t.Fatalf("read %d bytes, want %d", len(got), len(want))
			}
		})
	}
}

func TestReadDirNames(t *testing.T) {
	dir := t.TempDir()
	var want []string
	for i := 0; i < 300; i++ { // more than one getdents buffer
		name := fmt.Sprintf("entry-with-a-long-name-%03d", i)
		want = append(want, name)
		if err := os.WriteFile(filepath.Join(dir, name), nil, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	got, err := ReadDirNames(dir)
	if err != nil {
		t.Fatal(err)
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("got %d names, want %d", len(got), len(want))
	}
	tasks, err := ReadDirNames("/proc/self/task")
	if err != nil || len(tasks) == 0 {
		t.Fatalf("tasks %v, %v", tasks, err)
	}
	if _, err := ReadDirNames(filepath.Join(dir, "nope")); !errors.Is(err, fs.ErrNotExist) {
		t.Fatalf("missing dir: %v", err)
	}
}

// BenchmarkReadStat compares ReadFile with os.ReadFile on /proc/PID/stat
// (go test -bench ReadStat ./internal/procfs/).
func BenchmarkReadStat(b *testing.B) {
	path := PIDPath(os.Getpid(), "stat")
	b.Run("os.ReadFile", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if _, err := os.ReadFile(path); err != nil {
				b.Fatal(err)
			}
		}
	})
	b.Run("procfs.ReadFile", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if _, err := ReadFile(path); err != nil {
				b.Fatal(err)
			}
		}
	})
}

// TestPIDInNS: a thread's id translated into its own PID namespace is
// itself, and an id no task has is ESRCH.
func TestPIDInNS(t *testing.T) {
	fd, err := unix.Open("/proc/self/ns/pid", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	tid := unix.Gettid()
	got, err := PIDInNS(fd, tid)
	testenv.Require(t, err != unix.ENOTTY && err != unix.EINVAL, "a kernel that translates ids into a PID namespace (NS_GET_PID_IN_PIDNS, Linux 6.10)")
	if err != nil || got != tid {
		t.Fatalf("PIDInNS(own namespace, %d) = %d, %v; want %d", tid, got, err, tid)
	}
	b, err := os.ReadFile("/proc/sys/kernel/pid_max")
	if err != nil {
		t.Fatal(err)
	}
	max, _ := strconv.Atoi(strings.TrimSpace(string(b)))
	if _, err := PIDInNS(fd, max+1); err != unix.ESRCH {
		t.Fatalf("PIDInNS of an id past pid_max: %v, want ESRCH", err)
	}
}

// TestPIDFromNS: pid 1 of a new PID namespace translates to the host pid
// of that namespace's first process, and back (PIDInNS); an id nothing has
// there is ESRCH.
func TestPIDFromNS(t *testing.T) {
	testenv.RequireRoot(t)
	cmd := exec.Command("unshare", "--pid", "--fork", "sleep", "30")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	defer func() {
		_ = cmd.Process.Kill()
		_ = cmd.Wait()
	}()
	// unshare's one child is the namespace's pid 1.
	var child int
	deadline := time.Now().Add(5 * time.Second)
	for child == 0 && time.Now().Before(deadline) {
		b, _ := os.ReadFile(fmt.Sprintf("/proc/%d/task/%d/children", cmd.Process.Pid, cmd.Process.Pid))
		if f := strings.Fields(string(b)); len(f) == 1 {
			child, _ = strconv.Atoi(f[0])
		} else {
			time.Sleep(time.Millisecond)
		}
	}
	if child == 0 {
		t.Fatal("unshare's child did not appear")
	}
	fd, err := unix.Open(fmt.Sprintf("/proc/%d/ns/pid", child), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	got, err := PIDFromNS(fd, 1)
	testenv.Require(t, err != unix.ENOTTY && err != unix.EINVAL, "a kernel that translates ids from a PID namespace (NS_GET_PID_FROM_PIDNS, Linux 6.10)")
	if err != nil || got != child {
		t.Fatalf("PIDFromNS(new namespace, 1) = %d, %v; want %d", got, err, child)
	}
	if back, err := PIDInNS(fd, child); err != nil || back != 1 {
		t.Fatalf("PIDInNS(new namespace, %d) = %d, %v; want 1", child, back, err)
	}
	if _, err := PIDFromNS(fd, 2); err != unix.ESRCH {
		t.Fatalf("PIDFromNS of an id nothing has in the namespace: %v, want ESRCH", err)
	}
}

// TestNextMapping: asked for shared mappings, the query finds a MAP_SHARED
// anonymous region of this process, named as the maps file names it, and
// not a private one.
func TestNextMapping(t *testing.T) {
	shared, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(shared)
	private, err := unix.Mmap(-1, 0, 4096, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Munmap(private)
	sharedAt := uint64(uintptr(unsafe.Pointer(&shared[0])))
	privateAt := uint64(uintptr(unsafe.Pointer(&private[0])))
	fd, err := unix.Open("/proc/self/maps", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	found := false
	for addr := uint64(0); ; {
		m, err := NextMapping(fd, addr, MapShared)
		if err == unix.ENOENT {
			break
		}
		testenv.Require(t, err != unix.ENOTTY && err != unix.EINVAL, "a kernel with PROCMAP_QUERY (Linux 6.11)")
		if err != nil {
			t.Fatal(err)
		}
		if m.Start <= privateAt && privateAt < m.End {
			t.Errorf("the private mapping at %x came back as shared: %+v", privateAt, m)
		}
		if m.Start <= sharedAt && sharedAt < m.End {
			found = true
			if m.Name != "/dev/zero (deleted)" {
				t.Errorf("the shared anonymous mapping is named %q, want %q (as in the maps file)", m.Name, "/dev/zero (deleted)")
			}
		}
		addr = m.End
	}
	if !found {
		t.Fatalf("the shared mapping at %x was not found", sharedAt)
	}
}
