package compat

import (
	"bufio"
	"fmt"
	"github.com/rewind-sandbox/rewind/internal/mountinfo"
	"io"
	"strconv"
	"strings"
)

// KernelVersion is a parsed Linux kernel release.
type KernelVersion struct{ Major, Minor, Patch int }

// AtLeast reports whether v >= major.minor.
func (v KernelVersion) AtLeast(major, minor int) bool {
	return v.Major > major || (v.Major == major && v.Minor >= minor)
}

func (v KernelVersion) String() string { return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Patch) }

// ParseKernelVersion parses a uname release such as "6.18.44-fc-v669" or
// "5.15.0-91-generic".
func ParseKernelVersion(release string) (KernelVersion, error) {
	var v KernelVersion
	s := strings.TrimSpace(release)
	// Cut at the first character that is neither a digit nor a dot.
	end := strings.IndexFunc(s, func(r rune) bool { return (r < '0' || r > '9') && r != '.' })
	if end >= 0 {
		s = s[:end]
	}
	parts := strings.Split(strings.TrimSuffix(s, "."), ".")
	if len(parts) < 2 {
		return v, fmt.Errorf("parse kernel release %q: want MAJOR.MINOR[.PATCH]", release)
	}
	nums := make([]int, 3)
	for i := 0; i < len(parts) && i < 3; i++ {
		n, err := strconv.Atoi(parts[i])
		if err != nil {
			return v, fmt.Errorf("parse kernel release %q: %w", release, err)
		}
		nums[i] = n
	}
	return KernelVersion{nums[0], nums[1], nums[2]}, nil
}

// CRIUVersion is a parsed `criu --version`.
type CRIUVersion struct {
	Major, Minor, Sublevel int
	// GitID is set for builds from git.
	GitID string
}

func (v CRIUVersion) String() string {
	return fmt.Sprintf("%d.%d.%d", v.Major, v.Minor, v.Sublevel)
}

// ParseCRIUVersion parses the output of `criu --version`:
//
//	Version: 4.1.1
//	GitID: v4.1.1-12-gabcdef
func ParseCRIUVersion(out string) (CRIUVersion, error) {
	var v CRIUVersion
	found := false
	for _, line := range strings.Split(out, "\n") {
		k, val, ok := strings.Cut(strings.TrimSpace(line), ":")
		if !ok {
			continue
		}
		val = strings.TrimSpace(val)
		switch strings.TrimSpace(k) {
		case "Version":
			parts := strings.Split(val, ".")
			if len(parts) < 2 {
				return v, fmt.Errorf("parse criu version %q: want MAJOR.MINOR[.SUBLEVEL]", val)
			}
			nums := make([]int, 3)
			for i := 0; i < len(parts) && i < 3; i++ {
				n, err := strconv.Atoi(parts[i])
				if err != nil {
					return v, fmt.Errorf("parse criu version %q: %w", val, err)
				}
				nums[i] = n
			}
			v.Major, v.Minor, v.Sublevel = nums[0], nums[1], nums[2]
			found = true
		case "GitID":
			v.GitID = val
		}
	}
	if !found {
		return v, fmt.Errorf("parse criu version: no \"Version:\" line in %q", strings.TrimSpace(out))
	}
	return v, nil
}

// ParseFilesystems parses /proc/filesystems into the set of known file
// system types.
func ParseFilesystems(r io.Reader) (map[string]bool, error) {
	fss := make(map[string]bool)
	sc := bufio.NewScanner(r)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		switch len(f) {
		case 1:
			fss[f[0]] = true
		case 2:
			fss[f[1]] = true
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("parse /proc/filesystems: %w", err)
	}
	return fss, nil
}

// MountInfo is one line of /proc/PID/mountinfo.
type MountInfo struct {
	ID, Parent   int
	Major, Minor int
	Root         string
	MountPoint   string
	Options      string
	FSType       string
	Source       string
	SuperOptions string
}

// ParseMountinfo parses /proc/PID/mountinfo (see proc(5)). Octal escapes
// (\040 for a space) in paths are decoded.
func ParseMountinfo(r io.Reader) ([]MountInfo, error) {
	var out []MountInfo
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64*1024), 1024*1024)
	line := 0
	for sc.Scan() {
		line++
		f := strings.Fields(sc.Text())
		sep := -1
		for i := 6; i < len(f); i++ {
			if f[i] == "-" {
				sep = i
				break
			}
		}
		if len(f) < 10 || sep < 0 || sep+3 > len(f) {
			return nil, fmt.Errorf("parse mountinfo line %d: malformed %q", line, sc.Text())
		}
		var m MountInfo
		var err error
		if m.ID, err = strconv.Atoi(f[0]); err != nil {
			return nil, fmt.Errorf("parse mountinfo line %d: mount id: %w", line, err)
		}
		if m.Parent, err = strconv.Atoi(f[1]); err != nil {
			return nil, fmt.Errorf("parse mountinfo line %d: parent id: %w", line, err)
		}
		maj, min, ok := strings.Cut(f[2], ":")
		if !ok {
			return nil, fmt.Errorf("parse mountinfo line %d: device %q", line, f[2])
		}
		if m.Major, err = strconv.Atoi(maj); err != nil {
			return nil, fmt.Errorf("parse mountinfo line %d: major: %w", line, err)
		}
		if m.Minor, err = strconv.Atoi(min); err != nil {
			return nil, fmt.Errorf("parse mountinfo line %d: minor: %w", line, err)
		}
		m.Root = mountinfo.Unescape(f[3])
		m.MountPoint = mountinfo.Unescape(f[4])
		m.Options = f[5]
		m.FSType = f[sep+1]
		m.Source = mountinfo.Unescape(f[sep+2])
		if sep+3 < len(f) {
			m.SuperOptions = f[sep+3]
		}
		out = append(out, m)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("parse mountinfo: %w", err)
	}
	return out, nil
}

// MountFor returns the mount that contains path (the longest mount point
// that is a prefix of it). path must be absolute and clean.
func MountFor(mounts []MountInfo, path string) (MountInfo, bool) {
	best, found := MountInfo{}, false
	for _, m := range mounts {
		mp := m.MountPoint
		if path == mp || mp == "/" || strings.HasPrefix(path, strings.TrimSuffix(mp, "/")+"/") {
			if !found || len(mp) >= len(best.MountPoint) {
				best, found = m, true
			}
		}
	}
	return best, found
}
