package criu

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestFirstError(t *testing.T) {
	tests := []struct{ log, want string }{
		{"", ""},
		{"(00.1) Dumping\n(00.2) all fine\n", ""},
		{"(00.1) Error (criu/kerndat.c:1) RLIMIT_NOFILE\n(00.2) Seizing 12\n(10.0) Error (criu/cr-dump.c:1791): Timeout reached\n(10.1) Error: Dumping FAILED.\n",
			"; after (00.2) Seizing 12; (10.0) Error (criu/cr-dump.c:1791): Timeout reached"},
		{"(00.1) Error (criu/x.c:1): first\n", "; (00.1) Error (criu/x.c:1): first"},
	}
	for _, tc := range tests {
		if got := firstError(tc.log); got != tc.want {
			t.Errorf("firstError(%q) = %q, want %q", tc.log, got, tc.want)
		}
	}
}

// TestCgroupMountsParse: each hierarchy maps to the first mount of its
// root (a bind mount of a subdirectory and a second mount are ignored),
// and a process's cgroup lines map to cgroup.procs files under them.
func TestCgroupMountsParse(t *testing.T) {
	mi, err := os.ReadFile("testdata/mountinfo-hybrid")
	if err != nil {
		t.Fatal(err)
	}
	got := parseCgroupMounts(mi)
	want := map[string]string{
		"":             "/sys/fs/cgroup/unified",
		"name=systemd": "/sys/fs/cgroup/systemd",
		"cpu,cpuacct":  "/sys/fs/cgroup/cpu,cpuacct",
		"pids":         "/sys/fs/cgroup/pids",
		"freezer":      "/sys/fs/cgroup/freezer",
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("parseCgroupMounts = %v, want %v", got, want)
	}
	for _, tc := range []struct {
		name    string
		cgroup  string
		files   []string
		missing bool
	}{
		{"v2 only", "0::/sb/x\n", []string{"/sys/fs/cgroup/unified/sb/x/cgroup.procs"}, false},
		{"hybrid", "5:pids:/sb\n3:cpu,cpuacct:/sb\n0::/sb\n",
			[]string{"/sys/fs/cgroup/pids/sb/cgroup.procs", "/sys/fs/cgroup/cpu,cpuacct/sb/cgroup.procs", "/sys/fs/cgroup/unified/sb/cgroup.procs"}, false},
		{"unknown hierarchy", "7:memory:/sb\n0::/sb\n", []string{"/sys/fs/cgroup/unified/sb/cgroup.procs"}, true},
		{"quote in path", "0::/sb'x\n", nil, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			files, missing := cgroupFilesOf([]byte(tc.cgroup), got)
			if !reflect.DeepEqual(files, tc.files) || missing != tc.missing {
				t.Errorf("cgroupFilesOf = %v, %v; want %v, %v", files, missing, tc.files, tc.missing)
			}
		})
	}
}

// TestCgroupMountsCached: the runner reads the mount table once; a
// process in a hierarchy the cached table lacks makes it read it again.
func TestCgroupMountsCached(t *testing.T) {
	r := &Runner{}
	fresh, err := r.cgroupMounts(false)
	if err != nil {
		t.Fatal(err)
	}
	want, err := r.cgroupProcsFiles(os.Getpid(), false)
	if err != nil {
		t.Fatal(err)
	}
	if len(want) == 0 {
		t.Fatal("this process is in no mounted cgroup hierarchy")
	}
	// A cached table is used as it is, even a wrong one...
	stale := map[string]string{}
	for k := range fresh {
		stale[k] = "/nonexistent"
	}
	r.cgMounts = stale
	got, err := r.cgroupProcsFiles(os.Getpid(), false)
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range got {
		if !strings.HasPrefix(f, "/nonexistent/") {
			t.Fatalf("cached table not used: %v", got)
		}
	}
	// ...but one that lacks a hierarchy of the process is read again.
	r.cgMounts = map[string]string{"no-such-hierarchy": "/x"}
	got, err = r.cgroupProcsFiles(os.Getpid(), false)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("after a missing hierarchy: %v, want %v", got, want)
	}
}

// BenchmarkCgroupMounts is what a criu start used to pay for the cgroup
// mount table on every run, against the cached table, on a host with
// the testdata's hierarchies and 2000 other mounts (a container host's
// overlays, a daemon's sandbox views).
func BenchmarkCgroupMounts(b *testing.B) {
	mi, err := os.ReadFile("testdata/mountinfo-hybrid")
	if err != nil {
		b.Fatal(err)
	}
	var big []byte
	for i := 0; i < 2000; i++ {
		big = append(big, fmt.Sprintf("%d 27 0:%d / /var/lib/rewind/mnt/sb-%06d rw,nosuid,nodev,relatime - fuse.rewind rewind:sb-%06d rw,user_id=0,group_id=0\n", 100+i, 100+i, i, i)...)
	}
	big = append(big, mi...)
	cg := []byte("5:pids:/sb\n3:cpu,cpuacct:/sb\n0::/sb\n")
	b.Run("parse-every-start", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			if files, _ := cgroupFilesOf(cg, parseCgroupMounts(big)); len(files) != 3 {
				b.Fatal(files)
			}
		}
	})
	b.Run("cached", func(b *testing.B) {
		mounts := parseCgroupMounts(big)
		b.ResetTimer()
		for i := 0; i < b.N; i++ {
			if files, _ := cgroupFilesOf(cg, mounts); len(files) != 3 {
				b.Fatal(files)
			}
		}
	})
}

// TestKdatCancelKillsTheCheck: a criu check that never ends (a stand-in
// that sleeps) is ended with its namespace when the context ends: making
// the cache returns, and holds no caller of the runner for ever.
func TestKdatCancelKillsTheCheck(t *testing.T) {
	testenv.RequireRoot(t)
	dir := t.TempDir()
	fake := filepath.Join(dir, "criu")
	if err := os.WriteFile(fake, []byte("#!/bin/sh\nexec sleep 1000\n"), 0o700); err != nil {
		t.Fatal(err)
	}
	r := &Runner{Path: fake}
	ctx, cancel := context.WithTimeout(context.Background(), 300*time.Millisecond)
	defer cancel()
	start := time.Now()
	if _, err := r.makeKdat(ctx); err == nil {
		t.Fatal("a check that never ended made a cache")
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Errorf("making the cache returned %s after its context ended", d)
	}
}
