// Package mountinfo holds what every reader of /proc/PID/mountinfo needs.
package mountinfo

import (
	"strconv"
	"strings"
)

// Unescape undoes the kernel's octal escapes in a mountinfo field (\040
// for a space, \011 tab, \012 newline, \134 backslash). A backslash not
// followed by three octal digits is kept as it is.
func Unescape(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	b.Grow(len(s))
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if n, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(n))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}

// Mount is one line of a mountinfo file, the fields its readers use.
type Mount struct {
	Dev          string // the superblock's device, "major:minor"
	MountPoint   string // unescaped
	FSType       string
	SuperOptions string // per-superblock options, comma-separated ("" if absent)
}

// Parse returns the mounts of mountinfo text b in its order (a mount's
// parent before it); malformed lines are skipped.
func Parse(b []byte) []Mount {
	var ms []Mount
	for _, l := range strings.Split(string(b), "\n") {
		pre, post, ok := strings.Cut(l, " - ")
		if !ok {
			continue
		}
		pf, qf := strings.Fields(pre), strings.Fields(post)
		if len(pf) < 5 || len(qf) < 1 {
			continue
		}
		m := Mount{Dev: pf[2], MountPoint: Unescape(pf[4]), FSType: qf[0]}
		if len(qf) >= 3 {
			m.SuperOptions = qf[2]
		}
		ms = append(ms, m)
	}
	return ms
}
