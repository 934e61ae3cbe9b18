package sandbox

import (
	"context"
	"fmt"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// Prefetched is what PrefetchMapped read.
type Prefetched struct {
	// Files and Bytes count the distinct files read and the bytes read.
	Files int
	Bytes int64
	// Inodes are the inode numbers of the files read, on the root's
	// device.
	Inodes []uint64
}

// PrefetchMapped reads the file ranges the sandbox's processes have
// mapped (their programs and libraries) through the sandbox's root file
// system, up to limit bytes, so that the pages a process faults in later
// come from that file system's page cache instead of a read each. On a
// FUSE root every sandbox has a page cache of its own: a shell restored
// into a new sandbox faults its program's code in through the daemon,
// one READ of up to a megabyte at a time, at its first command. A
// prepared fork child does it here, before it is handed out.
//
// Only files on the root's own device are read (not a bind mount's, nor
// a tmpfs's, nor a file system the sandbox mounted itself), each through
// /proc/PID/map_files, so no path of the sandbox is resolved on the host.
// It stops at ctx's end.
func (s *Sandbox) PrefetchMapped(ctx context.Context, limit int64) (Prefetched, error) {
	var st unix.Stat_t
	if err := unix.Stat(s.cfg.Root, &st); err != nil {
		return Prefetched{}, fmt.Errorf("prefetch %s: root: %w", s.cfg.ID, err)
	}
	pids, err := s.MemberPIDs()
	if err != nil {
		return Prefetched{}, fmt.Errorf("prefetch %s: %w", s.cfg.ID, err)
	}
	var keep []int
	for _, p := range pids {
		if p != s.initPID {
			keep = append(keep, p)
		}
	}
	return prefetchMapped(ctx, keep, st.Dev, limit), nil
}

// mapping is one file-backed line of /proc/PID/maps.
type mapping struct {
	name     string // start-end, as map_files names it
	off, len int64
	dev      uint64
	ino      uint64
}

// parseMapping parses a line of /proc/PID/maps; ok is false for lines
// that map no file.
func parseMapping(line string) (m mapping, ok bool) {
	f := strings.Fields(line)
	if len(f) < 6 || !strings.HasPrefix(f[5], "/") {
		return m, false
	}
	start, end, found := strings.Cut(f[0], "-")
	if !found {
		return m, false
	}
	a, err1 := strconv.ParseUint(start, 16, 64)
	b, err2 := strconv.ParseUint(end, 16, 64)
	off, err3 := strconv.ParseInt(f[2], 16, 64)
	maj, min, found := strings.Cut(f[3], ":")
	ma, err4 := strconv.ParseUint(maj, 16, 32)
	mi, err5 := strconv.ParseUint(min, 16, 32)
	ino, err6 := strconv.ParseUint(f[4], 10, 64)
	if !found || err1 != nil || err2 != nil || err3 != nil || err4 != nil || err5 != nil || err6 != nil || b <= a || ino == 0 {
		return m, false
	}
	return mapping{name: f[0], off: off, len: int64(b - a), dev: unix.Mkdev(uint32(ma), uint32(mi)), ino: ino}, true
}

// prefetchMapped reads the ranges of the files on device dev that
// processes pids map, each range once, up to limit bytes in all.
func prefetchMapped(ctx context.Context, pids []int, dev uint64, limit int64) Prefetched {
	var out Prefetched
	type rng struct{ off, len int64 }
	done := map[uint64]map[rng]bool{}
	read := map[uint64]bool{}
	buf := make([]byte, 256<<10)
	for _, pid := range pids {
		maps, err := procfs.ReadFile("/proc/" + strconv.Itoa(pid) + "/maps")
		if err != nil {
			continue // gone
		}
		for _, line := range strings.Split(string(maps), "\n") {
			if out.Bytes >= limit || ctx.Err() != nil {
				return out
			}
			m, ok := parseMapping(line)
			if !ok || m.dev != dev || done[m.ino][rng{m.off, m.len}] {
				continue
			}
			if done[m.ino] == nil {
				done[m.ino] = map[rng]bool{}
			}
			done[m.ino][rng{m.off, m.len}] = true
			n := readMapping(pid, m, buf, limit-out.Bytes)
			if n > 0 && !read[m.ino] {
				read[m.ino] = true
				out.Files++
				out.Inodes = append(out.Inodes, m.ino)
			}
			out.Bytes += n
		}
	}
	return out
}

// readMapping reads up to max bytes of mapping m of process pid, through
// the file the mapping holds (map_files), after checking it is still the
// file the line named.
func readMapping(pid int, m mapping, buf []byte, max int64) int64 {
	fd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/map_files/"+m.name, unix.O_RDONLY|unix.O_CLOEXEC|unix.O_NONBLOCK, 0)
	if err != nil {
		return 0
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if unix.Fstat(fd, &st) != nil || st.Dev != m.dev || st.Ino != m.ino || st.Mode&unix.S_IFMT != unix.S_IFREG {
		return 0
	}
	end := min(m.off+m.len, st.Size, m.off+max)
	var n int64
	for off := m.off; off < end; {
		k, err := unix.Pread(fd, buf[:min(int64(len(buf)), end-off)], off)
		if err != nil || k <= 0 {
			break
		}
		n += int64(k)
		off += int64(k)
	}
	return n
}
