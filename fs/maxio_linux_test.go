package fs

import (
	"bytes"
	"fmt"
	"math/rand"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/mountinfo"
)

// TestMaxIO checks that Options.MaxIO reaches the kernel — the mount's
// max_read and its readahead window — and that large files read and
// write intact at every size.
func TestMaxIO(t *testing.T) {
	big := make([]byte, 3<<20+12345)
	rand.New(rand.NewSource(1)).Read(big)
	tests := []struct {
		maxIO, want int
	}{
		{0, DefaultMaxIO},
		{256 << 10, 256 << 10},
		{1000, minMaxIO},
		{300000, 300000 &^ (os.Getpagesize() - 1)},
	}
	for _, tc := range tests {
		t.Run(strconv.Itoa(tc.maxIO), func(t *testing.T) {
			fx := mountT(t, func(lower string) {
				if err := os.WriteFile(filepath.Join(lower, "big"), big, 0o644); err != nil {
					t.Fatal(err)
				}
			}, Options{MaxIO: tc.maxIO, NoDurable: true})
			var st unix.Stat_t
			if err := unix.Stat(fx.mp, &st); err != nil {
				t.Fatal(err)
			}
			ra, err := os.ReadFile(fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(st.Dev), unix.Minor(st.Dev)))
			if err != nil {
				t.Fatal(err)
			}
			if got := strings.TrimSpace(string(ra)); got != strconv.Itoa(tc.want>>10) {
				t.Errorf("read_ahead_kb = %s, want %d", got, tc.want>>10)
			}
			if got := maxRead(t, fx.mp); got != tc.want {
				t.Errorf("max_read = %d, want %d", got, tc.want)
			}
			if got, err := os.ReadFile(fx.p("big")); err != nil || !bytes.Equal(got, big) {
				t.Fatalf("lower file read through the mount differs (err %v, %d bytes)", err, len(got))
			}
			rev := bytes.Clone(big)
			for i, j := 0, len(rev)-1; i < j; i, j = i+1, j-1 {
				rev[i], rev[j] = rev[j], rev[i]
			}
			if err := os.WriteFile(fx.p("copy"), rev, 0o644); err != nil {
				t.Fatal(err)
			}
			dropCache(t, fx.p("copy"))
			if got, err := os.ReadFile(fx.p("copy")); err != nil || !bytes.Equal(got, rev) {
				t.Fatalf("written file read back differs (err %v, %d bytes)", err, len(got))
			}
		})
	}
}

// maxRead returns the max_read option of the mount at mp.
func maxRead(t *testing.T, mp string) int {
	t.Helper()
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range mountinfo.Parse(b) {
		if m.MountPoint != mp {
			continue
		}
		for _, o := range strings.Split(m.SuperOptions, ",") {
			if v, ok := strings.CutPrefix(o, "max_read="); ok {
				n, err := strconv.Atoi(v)
				if err != nil {
					t.Fatal(err)
				}
				return n
			}
		}
		t.Fatalf("no max_read in %+v", m)
	}
	t.Fatalf("%s not in mountinfo", mp)
	return 0
}

// dropCache writes path's dirty pages back and drops its page cache, so
// the next read is served by the daemon.
func dropCache(t *testing.T, path string) {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Sync(); err != nil {
		t.Fatal(err)
	}
	if err := unix.Fadvise(int(f.Fd()), 0, 0, unix.FADV_DONTNEED); err != nil {
		t.Fatal(err)
	}
}
