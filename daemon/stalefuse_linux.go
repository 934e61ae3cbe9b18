package daemon

import (
	"bytes"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/internal/mountinfo"
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
	for _, m := range mountinfo.Parse(b) {
		if m.FSType != "fuse" && !strings.HasPrefix(m.FSType, "fuse.") {
			continue
		}
		if rel, err := filepath.Rel(dir, m.MountPoint); err != nil || rel == ".." || strings.HasPrefix(rel, "../") {
			continue
		}
		var major, minor int
		if _, err := fmt.Sscanf(m.Dev, "%d:%d", &major, &minor); err != nil || major != 0 {
			continue
		}
		out = append(out, fuseMount{point: m.MountPoint, minor: minor})
	}
	return out
}

// breakDeadLock is called when the state dir's lock is taken. A daemon
// killed while one of its own threads waited on one of its FUSE mounts (a
// file of a sandbox's root opened from the host side, a request already
// read by a server thread the kill ended) cannot finish dying: the kernel
// waits for that answer without end, and the dead daemon keeps its
// descriptors, the lock among them. When every process that took a lock
// on the state dir's files is dead or dying like that, no daemon serves
// its FUSE mounts: their connections are aborted (abortStaleFUSE), and
// breakDeadLock waits up to 10 s for the lock to free, then reports
// whether it did. A live holder is left alone.
func breakDeadLock(stateDir string, log *slog.Logger) bool {
	var st unix.Stat_t
	if err := unix.Stat(filepath.Join(stateDir, "daemon.lock"), &st); err != nil {
		return false
	}
	b, err := os.ReadFile("/proc/locks")
	if err != nil {
		return false
	}
	pids := lockHolders(b, st.Dev, st.Ino)
	if len(pids) == 0 {
		return false
	}
	for _, pid := range pids {
		if !processDead(pid) {
			return false
		}
	}
	log.Warn("the state dir's lock is held by a daemon that died but cannot exit: aborting its FUSE connections", "pids", pids)
	abortStaleFUSE(filepath.Join(stateDir, "mnt"), log)
	deadline := time.Now().Add(10 * time.Second)
	for time.Now().Before(deadline) {
		b, err := os.ReadFile("/proc/locks")
		if err == nil && len(lockHolders(b, st.Dev, st.Ino)) == 0 {
			return true
		}
		time.Sleep(20 * time.Millisecond)
	}
	return false
}

// lockHolders returns the pids /proc/locks text b gives for the locks on
// the file with device dev and inode ino (a flock lock names the process
// that took it, which may have exited since: its copies of the descriptor
// hold the lock).
func lockHolders(b []byte, dev, ino uint64) []int {
	var out []int
	for _, line := range strings.Split(string(b), "\n") {
		f := strings.Fields(line)
		// "1: FLOCK  ADVISORY  WRITE 22017 fe:00:9977884 0 EOF"; a
		// blocked waiter's line has "->" after the number.
		if len(f) > 1 && f[1] == "->" {
			f = append(f[:1], f[2:]...)
		}
		if len(f) < 6 {
			continue
		}
		id := strings.Split(f[5], ":")
		if len(id) != 3 {
			continue
		}
		maj, err1 := strconv.ParseUint(id[0], 16, 32)
		mnr, err2 := strconv.ParseUint(id[1], 16, 32)
		i, err3 := strconv.ParseUint(id[2], 10, 64)
		pid, err4 := strconv.Atoi(f[4])
		if err1 != nil || err2 != nil || err3 != nil || err4 != nil {
			continue
		}
		if unix.Mkdev(uint32(maj), uint32(mnr)) == dev && i == ino {
			out = append(out, pid)
		}
	}
	return out
}

// processDead reports whether pid is gone or dying: exited (its leader a
// zombie, whose other threads may still be stuck on their way out) or no
// longer there. An unknown pid (an OFD lock's -1) is not dead.
func processDead(pid int) bool {
	if pid <= 0 {
		return false
	}
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return errors.Is(err, os.ErrNotExist)
	}
	// The state follows the command's closing parenthesis.
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return false
	}
	switch b[i+2] {
	case 'Z', 'X', 'x':
		return true
	}
	return false
}
