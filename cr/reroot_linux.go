package cr

import (
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/cr/inject"
)

// viewFD is an open file: its path inside the sandbox, open flags and
// offset (from /proc/PID/fdinfo), and whether it is on the process's root
// mount (the sandbox's view, which a restore switches).
type viewFD struct {
	fd    int
	path  string
	flags int
	pos   int64
	root  bool
}

// captureCwd reads process pid's working directory, taken before the
// sandbox's root mount is replaced (RestoreOptions.Reroot): the copy moves
// there on the new root (reenter). Its descriptors of the root mount are
// its template's, reopened after every switch anyway (Engine.ownFiles).
func captureCwd(pid int) string {
	cwd, _ := os.Readlink("/proc/" + strconv.Itoa(pid) + "/cwd")
	return cwd
}

// captureFiles returns the regular files and directories process pid holds
// open, by path, with their flags and offsets, on every mount but a pseudo
// file system's (see pseudoFS). A template's copies reopen them
// (Engine.ownFiles): a copy shares its template's open file descriptions,
// and so their offsets, with the original, which reads on; a dynamic
// loader caught between opening a library and reading its header (a
// process checkpointed as it starts) read the original's later offset in
// the copy and failed ("invalid ELF header", exit 127) when the library was
// on a mount of its own, as a bind-mounted /usr is.
func captureFiles(pid int) []viewFD {
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
		if mnt != rootMnt && pseudoFS(base+"/fd/"+e.Name()) {
			continue
		}
		path, err := os.Readlink(base + "/fd/" + e.Name())
		if err != nil || !strings.HasPrefix(path, "/") || strings.HasSuffix(path, " (deleted)") {
			continue
		}
		fds = append(fds, viewFD{fd: fd, path: path, flags: int(flags), pos: pos, root: mnt == rootMnt})
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

// checkpointCwd is captureCwd for a template made at a checkpoint: "" for
// a working directory already removed then (nothing to go back to).
func checkpointCwd(pid int) string {
	cwd := captureCwd(pid)
	if !strings.HasPrefix(cwd, "/") || strings.HasSuffix(cwd, " (deleted)") {
		return ""
	}
	return cwd
}

// recwd moves the stopped copies ms, made for a restore whose switch kept
// the sandbox's root mount (FUSE), back into their template's working
// directory by path when theirs no longer is that path: the template
// holds its directory as an object, which the live view renamed or removed
// after the checkpoint ("/d2 (deleted)" after the switch), while the
// checkpoint's view has it at the old path. One readlink a copy when
// nothing moved.
func (e *Engine) recwd(ms []made) error {
	var stale []made
	for _, m := range ms {
		if m.tm.cwd != "" && captureCwd(m.p.Pid()) != m.tm.cwd {
			stale = append(stale, m)
		}
	}
	if len(stale) == 0 {
		return nil
	}
	return e.tracer.Do(func() error {
		for _, m := range stale {
			reenter(m.p, m.tm.cwd)
		}
		return nil
	})
}

// reenter moves a stopped copy onto the new root's view: into its working
// directory there, by path. A working directory that no longer exists in
// the new view is left as it was (like a removed directory).
func reenter(p *inject.Proc, cwd string) {
	if cwd != "" {
		_ = p.Chdir(cwd)
	}
}
