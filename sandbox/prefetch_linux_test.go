package sandbox

import (
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestPrefetchMapped: the files the sandbox's processes map are read when
// they are on the root's device, never when they are elsewhere (a tmpfs
// inside the sandbox), and never past the limit.
func TestPrefetchMapped(t *testing.T) {
	sb := startTest(t, nil)
	// A program on the root's device (the root's own /tmp) and one on
	// the sandbox's /dev/shm tmpfs, both left running.
	sh(t, sb, "cp /usr/bin/sleep /tmp/onroot && cp /usr/bin/sleep /dev/shm/ontmpfs && "+
		"(/tmp/onroot 60 >/dev/null 2>&1 &) && (/dev/shm/ontmpfs 60 >/dev/null 2>&1 &)")
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(sb.Root(), "tmp/onroot"), &st); err != nil {
		t.Fatal(err)
	}
	onRoot := st.Ino
	onTmpfs, err := strconv.ParseUint(strings.TrimSpace(sh(t, sb, "stat -c %i /dev/shm/ontmpfs")), 10, 64)
	if err != nil {
		t.Fatal(err)
	}
	waitFor(t, "both programs running", func() bool {
		out := sh(t, sb, "cat /proc/[0-9]*/comm 2>/dev/null")
		return strings.Count(out, "onroot") == 1 && strings.Count(out, "ontmpfs") == 1
	})
	size := func(p string) int64 {
		fi, err := os.Stat(p)
		if err != nil {
			t.Fatal(err)
		}
		return fi.Size()
	}

	got, err := sb.PrefetchMapped(testCtx(t), 1<<30)
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Contains(got.Inodes, onRoot) {
		t.Errorf("the program on the root's device was not read: %+v", got)
	}
	if slices.Contains(got.Inodes, onTmpfs) {
		t.Errorf("the program on the tmpfs was read: %+v", got)
	}
	if got.Files != len(got.Inodes) || got.Bytes < size("/usr/bin/sleep")/2 {
		t.Errorf("read %d files, %d bytes (inodes %v): too little", got.Files, got.Bytes, got.Inodes)
	}

	limited, err := sb.PrefetchMapped(testCtx(t), 5000)
	if err != nil {
		t.Fatal(err)
	}
	if limited.Bytes == 0 || limited.Bytes > 5000 {
		t.Errorf("with a limit of 5000 bytes: read %d", limited.Bytes)
	}
}

func TestParseMapping(t *testing.T) {
	tests := []struct {
		line string
		ok   bool
		want mapping
	}{
		{"55d0c6a00000-55d0c6a2e000 r--p 00002000 fd:01 1838 /usr/bin/bash", true,
			mapping{name: "55d0c6a00000-55d0c6a2e000", off: 0x2000, len: 0x2e000, dev: unix.Mkdev(0xfd, 1), ino: 1838}},
		{"7f00-8f00 r-xp 00000000 00:2a 77 /lib/with space.so", true,
			mapping{name: "7f00-8f00", off: 0, len: 0x1000, dev: unix.Mkdev(0, 0x2a), ino: 77}},
		{"55d0c8000000-55d0c8021000 rw-p 00000000 00:00 0 [heap]", false, mapping{}},
		{"7ffd-7ffe rw-p 00000000 00:00 0", false, mapping{}},
		{"7f00-8f00 rw-s 00000000 00:01 0 /memfd:x (deleted)", false, mapping{}},
		{"garbage", false, mapping{}},
	}
	for _, tc := range tests {
		got, ok := parseMapping(tc.line)
		if ok != tc.ok || got != tc.want {
			t.Errorf("parseMapping(%q) = %+v, %v; want %+v, %v", tc.line, got, ok, tc.want, tc.ok)
		}
	}
}
