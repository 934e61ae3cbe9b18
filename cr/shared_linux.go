package cr

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// sharedState says why process pid holds state that a template, which is
// a fork of it, would share with it instead of copying, and that no path
// names ("" when it holds none). A fork copies private memory and the
// descriptor table, not the objects the descriptors and shared mappings
// refer to: the live process would go on changing a memfd, a deleted
// (or O_TMPFILE) file, a MAP_SHARED anonymous or SysV shared memory
// region after the checkpoint, and a restore from the template would
// bring back those changes instead of the checkpoint's content. Files
// with a name are not such state: a restored copy reopens them by path
// in the restored view (captureFiles). A checkpoint of such a process
// takes the CRIU path, whose dump copies the objects' content.
//
// It reads pid's maps and stats each descriptor; the caller holds pid
// stopped, so nothing changes meanwhile. A process whose /proc cannot be
// read is left to the stop or the fork that follows, which fail for it.
func sharedState(pid int) string {
	base := "/proc/" + strconv.Itoa(pid)
	if why := sharedMappings(base + "/maps"); why != "" {
		return why
	}
	dfd, err := unix.Open(base+"/fd", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return ""
	}
	defer unix.Close(dfd)
	names, err := procfs.ReadDirNamesFD(dfd, base+"/fd")
	if err != nil {
		return ""
	}
	for _, n := range names {
		var st unix.Stat_t
		// Stat follows the descriptor's link to its file.
		if unix.Fstatat(dfd, n, &st, 0) != nil {
			continue // closed meanwhile (it was not stopped yet)
		}
		if st.Mode&unix.S_IFMT == unix.S_IFREG && st.Nlink == 0 {
			target, err := os.Readlink(base + "/fd/" + n)
			if err != nil {
				target = "a file"
			}
			return fmt.Sprintf("descriptor %s is %s, without a name", n, target)
		}
	}
	return ""
}

// sharedMappings says why the process whose maps file is at path has a
// shared mapping of an object without a name ("" when it has none). It
// asks the kernel for the shared mappings alone (PROCMAP_QUERY: a bash
// has none, and one ioctl says so), where reading the maps file formats
// every mapping with its path: the whole check of a bash took 43 µs, and
// 133 with the file read, 124 of them the read (BenchmarkSharedState, on
// the 2-core machine under load). Older kernels read the file.
func sharedMappings(path string) string {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return ""
	}
	defer unix.Close(fd)
	for addr := uint64(0); ; {
		m, err := procfs.NextMapping(fd, addr, procfs.MapShared)
		switch err {
		case nil:
			if strings.HasSuffix(m.Name, " (deleted)") {
				return fmt.Sprintf("a shared mapping of %s (%x-%x)", m.Name, m.Start, m.End)
			}
			addr = m.End
			continue
		case unix.ENOENT:
			return ""
		case unix.ENOTTY, unix.EINVAL:
			b, err := procfs.ReadFile(path)
			if err != nil {
				return ""
			}
			for _, l := range strings.Split(string(b), "\n") {
				if why := sharedMapping(l); why != "" {
					return why
				}
			}
		}
		return ""
	}
}

// sharedMapping says why a line of /proc/PID/maps is a shared mapping of
// an object without a name ("" when it is not): MAP_SHARED anonymous
// memory ("/dev/zero (deleted)"), a memfd, SysV shared memory, or a file
// deleted since it was mapped, all shown with a " (deleted)" suffix. A
// private mapping is copied by a fork, so it never counts.
func sharedMapping(line string) string {
	// address perms offset dev inode [path]
	f := strings.Fields(line)
	if len(f) < 6 || len(f[1]) < 4 || f[1][3] != 's' || !strings.HasSuffix(line, " (deleted)") {
		return ""
	}
	return "a shared mapping of " + strings.Join(f[5:], " ") + " (" + f[0] + ")"
}
