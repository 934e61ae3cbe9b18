package compat

import (
	"os"
	"strings"
	"testing"
)

func TestParseKernelVersion(t *testing.T) {
	tests := []struct {
		in      string
		want    KernelVersion
		wantErr bool
	}{
		{"6.18.44-fc-v669", KernelVersion{6, 18, 44}, false},
		{"5.15.0-91-generic", KernelVersion{5, 15, 0}, false},
		{"6.9", KernelVersion{6, 9, 0}, false},
		{"6.10.0+", KernelVersion{6, 10, 0}, false},
		{"4.19.0-rc3\n", KernelVersion{4, 19, 0}, false},
		{"garbage", KernelVersion{}, true},
		{"6", KernelVersion{}, true},
		{"", KernelVersion{}, true},
	}
	for _, tt := range tests {
		got, err := ParseKernelVersion(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseKernelVersion(%q) error = %v, wantErr %v", tt.in, err, tt.wantErr)
			continue
		}
		if got != tt.want {
			t.Errorf("ParseKernelVersion(%q) = %v, want %v", tt.in, got, tt.want)
		}
	}
	v := KernelVersion{6, 9, 0}
	if !v.AtLeast(6, 9) || !v.AtLeast(5, 20) || v.AtLeast(6, 10) || v.AtLeast(7, 0) {
		t.Errorf("AtLeast is wrong for %v", v)
	}
}

func TestParseCRIUVersion(t *testing.T) {
	tests := []struct {
		in      string
		want    CRIUVersion
		wantErr bool
	}{
		{"Version: 4.1.1\n", CRIUVersion{Major: 4, Minor: 1, Sublevel: 1}, false},
		{"Version: 3.17\n", CRIUVersion{Major: 3, Minor: 17}, false},
		{"Version: 4.0\nGitID: v4.0-12-g1234abc\n", CRIUVersion{Major: 4, GitID: "v4.0-12-g1234abc"}, false},
		{"criu: command not found", CRIUVersion{}, true},
		{"Version: four\n", CRIUVersion{}, true},
		{"Version: 4\n", CRIUVersion{}, true},
	}
	for _, tt := range tests {
		got, err := ParseCRIUVersion(tt.in)
		if (err != nil) != tt.wantErr {
			t.Errorf("ParseCRIUVersion(%q) error = %v, wantErr %v", tt.in, err, tt.wantErr)
			continue
		}
		if got != tt.want {
			t.Errorf("ParseCRIUVersion(%q) = %+v, want %+v", tt.in, got, tt.want)
		}
	}
}

func TestParseFilesystems(t *testing.T) {
	in := "nodev\tsysfs\nnodev\ttmpfs\n\text4\nnodev\toverlay\n\txfs\nnodev\tfuse\n\n"
	got, err := ParseFilesystems(strings.NewReader(in))
	if err != nil {
		t.Fatal(err)
	}
	for _, fs := range []string{"sysfs", "tmpfs", "ext4", "overlay", "xfs", "fuse"} {
		if !got[fs] {
			t.Errorf("%s missing from %v", fs, got)
		}
	}
	if got["nodev"] || got["btrfs"] || len(got) != 6 {
		t.Errorf("unexpected entries: %v", got)
	}
}

func TestParseMountinfo(t *testing.T) {
	f, err := os.Open("testdata/mountinfo.txt")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	ms, err := ParseMountinfo(f)
	if err != nil {
		t.Fatal(err)
	}
	if len(ms) != 7 {
		t.Fatalf("got %d mounts, want 7", len(ms))
	}
	xfs := ms[5]
	if xfs.ID != 50 || xfs.Parent != 22 || xfs.Major != 7 || xfs.Minor != 0 || xfs.FSType != "xfs" ||
		xfs.MountPoint != "/var/lib/rewind" || xfs.Source != "/dev/loop0" || !strings.Contains(xfs.SuperOptions, "reflink") {
		t.Errorf("xfs line parsed as %+v", xfs)
	}
	if ms[6].MountPoint != "/mnt/with space" || ms[6].FSType != "fuse.rewind" {
		t.Errorf("escaped line parsed as %+v", ms[6])
	}
	if ms[3].FSType != "cgroup" || ms[3].SuperOptions != "rw,freezer" {
		t.Errorf("freezer line parsed as %+v", ms[3])
	}
	for _, tt := range []struct{ path, want string }{
		{"/var/lib/rewind/layers/x", "/var/lib/rewind"},
		{"/var/lib/rewindx", "/"},
		{"/sys/fs/cgroup/unified/rewind/sb1", "/sys/fs/cgroup/unified"},
		{"/", "/"},
	} {
		m, ok := MountFor(ms, tt.path)
		if !ok || m.MountPoint != tt.want {
			t.Errorf("MountFor(%q) = %q, %v; want %q", tt.path, m.MountPoint, ok, tt.want)
		}
	}
}

func TestParseMountinfoMalformed(t *testing.T) {
	for _, in := range []string{
		"22 1 254:0 / / rw", // too short
		"x 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw",  // bad id
		"22 1 254-0 / / rw,relatime shared:1 - ext4 /dev/vda rw", // bad device
		"22 1 254:0 / / rw,relatime shared:1 ext4 /dev/vda rw x", // no separator
	} {
		if _, err := ParseMountinfo(strings.NewReader(in + "\n")); err == nil {
			t.Errorf("ParseMountinfo(%q) succeeded, want an error", in)
		}
	}
}

func TestChoose(t *testing.T) {
	mk := func(oks ...string) *Report {
		r := &Report{}
		for _, o := range oks {
			g, n, _ := strings.Cut(o, "/")
			r.Checks = append(r.Checks, Check{Group: g, Name: n, Status: OK})
		}
		return r
	}
	tests := []struct {
		name                string
		r                   *Report
		fs, cr, probeChoice string
	}{
		{"everything", mk("fuse/mount", "criu/check", "kernel/ptrace", "ebpf/raw-tracepoints", "ebpf/cgroup-v2-id"), "fuse", "template+criu", "ebpf"},
		{"patched kernel", mk("overlayfs/layer-switch-ioctl", "fuse/mount", "criu/check"), "kernel", "criu", "userspace"},
		{"laptop without criu", mk("fuse/mount", "kernel/ptrace", "ebpf/raw-tracepoints"), "fuse", "template", "userspace"},
		{"nothing", mk(), "none", "none", "userspace"},
	}
	for _, tt := range tests {
		ch := choose(tt.r)
		if ch.FS.Backend != tt.fs || ch.CR.Backend != tt.cr || ch.Probe.Backend != tt.probeChoice {
			t.Errorf("%s: chose fs=%s cr=%s probe=%s, want %s %s %s", tt.name, ch.FS.Backend, ch.CR.Backend, ch.Probe.Backend, tt.fs, tt.cr, tt.probeChoice)
		}
		if ch.FS.Reason == "" || ch.CR.Reason == "" || ch.Probe.Reason == "" {
			t.Errorf("%s: a choice has no reason: %+v", tt.name, ch)
		}
	}
}

func TestFindCRIU(t *testing.T) {
	dir := t.TempDir()
	fake := dir + "/criu"
	if err := os.WriteFile(fake, []byte("#!/bin/sh\necho Version: 4.1.1\n"), 0o755); err != nil {
		t.Fatal(err)
	}
	got, err := FindCRIU(fake)
	if err != nil || got != fake {
		t.Fatalf("FindCRIU(configured) = %q, %v; want %q", got, err, fake)
	}
	t.Setenv("REWIND_CRIU", fake)
	if got, err := FindCRIU(""); err != nil || got != fake {
		t.Fatalf("FindCRIU with REWIND_CRIU = %q, %v; want %q", got, err, fake)
	}
	if _, err := FindCRIU(dir + "/nope"); err == nil {
		t.Fatal("FindCRIU of a missing configured path succeeded")
	}
	nonExec := dir + "/plain"
	if err := os.WriteFile(nonExec, nil, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := FindCRIU(nonExec); err == nil {
		t.Fatal("FindCRIU of a non-executable file succeeded")
	}
	v, err := CRIUVersionOf(t.Context(), fake)
	if err != nil || v.Major != 4 || v.Minor != 1 || v.Sublevel != 1 {
		t.Fatalf("CRIUVersionOf(fake) = %v, %v", v, err)
	}
}
