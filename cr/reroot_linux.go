package cr

import (
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/cr/inject"
)

// viewState is where a copy's working directory and its descriptors on
// its root mount are, by path, taken before the sandbox's root mount is
// replaced (RestoreOptions.Reroot).
type viewState struct {
	cwd string
	fds []viewFD
}

// viewFD is an open file of the root mount: its path inside the sandbox,
// open flags and offset (from /proc/PID/fdinfo).
type viewFD struct {
	fd    int
	path  string
	flags int
	pos   int64
}

// captureView reads process pid's working directory and the descriptors
// it holds on the mount that is its root. Files deleted since they were
// opened cannot be reopened by path and are left as they are.
func captureView(pid int) viewState {
	cwd, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd")
	return viewState{cwd: cwd, fds: captureFiles(pid, false)}
}

// captureFiles returns the regular files and directories process pid holds
// open, by path, with their flags and offsets: those on the mount that is
// its root (see captureView), or, with anyMount, those on every mount but
// a pseudo file system's (see pseudoFS). A template's copies reopen the
// latter (Engine.ownFiles): a copy shares its template's open file
// descriptions, and so their offsets, with the original, which reads on;
// a dynamic loader caught between opening a library and reading its
// header (a process checkpointed as it starts) read the original's later
// offset in the copy and failed ("invalid ELF header", exit 127) when the
// library was on a mount of its own, as a bind-mounted /usr is.
func captureFiles(pid int, anyMount bool) []viewFD {
	base := "/proc/" + strconv.Itoa(pid)
	var fds []viewFD
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, base+"/root", 0, unix.STATX_MNT_ID, &stx); err != nil || stx.Mask&unix.STATX_MNT_ID == 0 {
		return nil
	}
	rootMnt := strconv.FormatUint(stx.Mnt_id, 10)
	ents, err := os.ReadDir(base + "/fd")
	if err != nil {
		return nil
	}
	for _, e := range ents {
		fd, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		// One stat leaves out pipes, sockets and devices (most of a
		// session's descriptors) before the three calls of fdinfo: a
		// checkpoint reads this while the agent is stopped.
		var st unix.Stat_t
		if unix.Stat(base+"/fd/"+e.Name(), &st) != nil || (st.Mode&unix.S_IFMT != unix.S_IFREG && st.Mode&unix.S_IFMT != unix.S_IFDIR) {
			continue
		}
		info, err := os.ReadFile(base + "/fdinfo/" + e.Name())
		if err != nil {
			continue
		}
		var mnt string
		var flags, pos int64
		for _, line := range strings.Split(string(info), "\n") {
			k, val, ok := strings.Cut(line, ":")
			if !ok {
				continue
			}
			val = strings.TrimSpace(val)
			switch k {
			case "mnt_id":
				mnt = val
			case "flags":
				flags, _ = strconv.ParseInt(val, 8, 64)
			case "pos":
				pos, _ = strconv.ParseInt(val, 10, 64)
			}
		}
		if mnt != rootMnt && (!anyMount || pseudoFS(base+"/fd/"+e.Name())) {
			continue
		}
		path, err := os.Readlink(base + "/fd/" + e.Name())
		if err != nil || !strings.HasPrefix(path, "/") || strings.HasSuffix(path, " (deleted)") {
			continue
		}
		fds = append(fds, viewFD{fd: fd, path: path, flags: int(flags), pos: pos})
	}
	return fds
}

// pseudoFS reports whether the file at path (a /proc/PID/fd link) is on
// a pseudo file system (procfs, sysfs, cgroups, debugfs...), whose files a
// copy must not reopen by path: the path may name the copy's own object
// (/proc/self) or reopening it may act. A file whose file system cannot be
// told counts as one.
func pseudoFS(path string) bool {
	var st unix.Statfs_t
	if unix.Statfs(path, &st) != nil {
		return true
	}
	switch uint32(st.Type) {
	case unix.PROC_SUPER_MAGIC, unix.SYSFS_MAGIC, unix.CGROUP_SUPER_MAGIC, unix.CGROUP2_SUPER_MAGIC,
		unix.DEBUGFS_MAGIC, unix.TRACEFS_MAGIC, unix.SECURITYFS_MAGIC, unix.BPF_FS_MAGIC,
		unix.DEVPTS_SUPER_MAGIC, unix.PSTOREFS_MAGIC, unix.EFIVARFS_MAGIC, unix.NSFS_MAGIC,
		unix.BINFMTFS_MAGIC, unix.SELINUX_MAGIC, unix.SMACK_MAGIC, unix.ANON_INODE_FS_MAGIC:
		return true
	}
	return false
}

// reenter moves a stopped copy onto the new root's view: its working
// directory and the files captureView found, reopened by path. A working
// directory that no longer exists in the new view is left as it was (like
// a removed directory).
func reenter(p *inject.Proc, v viewState) error {
	if v.cwd != "" {
		_ = p.Chdir(v.cwd)
	}
	for _, f := range v.fds {
		if err := p.Reopen(f.fd, f.path, f.flags, f.pos); err != nil {
			return err
		}
	}
	return nil
}
