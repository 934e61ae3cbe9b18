package daemon

import (
	"bufio"
	"bytes"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
)

// abortStaleFUSE ends the FUSE connections of the mounts under mntDir,
// which only a dead daemon on this state dir can have left (the caller
// holds the state dir's lock): no server answers them. A process blocked
// on one waits for ever, and SIGKILL does not free it: the daemon's own
// child, forked to exec a helper in a sandbox's namespaces, was seen
// blocked so in the exec's walk through the sandbox's root when the daemon
// was killed, holding a copy of every descriptor the daemon had (the FUSE
// connections, so they never ended, and the state database, so the next
// daemon timed out opening it). The mounts themselves go later, with the
// rest of what the dead daemon left. It returns how many it aborted.
func abortStaleFUSE(mntDir string, log *slog.Logger) int {
	b, err := os.ReadFile("/proc/self/mountinfo")
	if err != nil {
		log.Warn("stale FUSE connections not checked", "err", err)
		return 0
	}
	n := 0
	for _, m := range staleFUSEMounts(b, mntDir) {
		if err := fs.AbortConnection(unix.Mkdev(0, uint32(m.minor))); err != nil {
			log.Warn("abort a stale FUSE connection", "mount", m.point, "err", err)
			continue
		}
		log.Info("aborted the FUSE connection of a mount a dead daemon left", "mount", m.point)
		n++
	}
	return n
}

type fuseMount struct {
	point string
	minor int
}

// staleFUSEMounts lists the FUSE mounts of mountinfo text b at or under
// dir.
func staleFUSEMounts(b []byte, dir string) []fuseMount {
	var out []fuseMount
	sc := bufio.NewScanner(bytes.NewReader(b))
	sc.Buffer(make([]byte, 0, 64<<10), 1<<20)
	for sc.Scan() {
		f := strings.Fields(sc.Text())
		sep := -1
		for i, x := range f {
			if x == "-" {
				sep = i
				break
			}
		}
		if sep < 5 || sep+1 >= len(f) {
			continue
		}
		if fstype := f[sep+1]; fstype != "fuse" && !strings.HasPrefix(fstype, "fuse.") {
			continue
		}
		point := unescapeMountPath(f[4])
		if rel, err := filepath.Rel(dir, point); err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
			continue
		}
		var major, minor int
		if _, err := fmt.Sscanf(f[2], "%d:%d", &major, &minor); err != nil || major != 0 {
			continue
		}
		out = append(out, fuseMount{point: point, minor: minor})
	}
	return out
}

// unescapeMountPath undoes mountinfo's octal escapes (\040 for a space).
func unescapeMountPath(s string) string {
	if !strings.Contains(s, `\`) {
		return s
	}
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		if s[i] == '\\' && i+4 <= len(s) {
			if v, err := strconv.ParseUint(s[i+1:i+4], 8, 8); err == nil {
				b.WriteByte(byte(v))
				i += 3
				continue
			}
		}
		b.WriteByte(s[i])
	}
	return b.String()
}
