package cr

import (
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// Proc describes a sandbox process as it was at checkpoint time.
type Proc struct {
	// PID is the host pid.
	PID int
	// NSPID is the pid inside the sandbox's PID namespace (0 if unknown).
	NSPID int
	// PPID is the host pid of the parent.
	PPID int
	// Threads is the number of threads.
	Threads int
	// Comm is the command name.
	Comm string
}

// readProc reads /proc/<pid>/status.
func readProc(pid int) (Proc, error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "status"))
	if err != nil {
		return Proc{}, err
	}
	p := Proc{PID: pid}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Name":
			p.Comm = v
		case "PPid":
			p.PPID, _ = strconv.Atoi(v)
		case "Threads":
			p.Threads, _ = strconv.Atoi(v)
		case "NSpid":
			f := strings.Fields(v)
			if len(f) > 1 {
				p.NSPID, _ = strconv.Atoi(f[len(f)-1])
			}
		}
	}
	return p, nil
}

// children returns the host pids of the children of pid (all its threads).
// Each thread has its own list, and a sandbox's init has a score of
// threads: the lists are opened relative to one descriptor of the task
// directory and read without the stat os.ReadFile takes, which made a
// listing of the init's children a third cheaper (0.73 -> 0.49 ms on a
// loaded 2-core machine, 24 threads).
func children(pid int) ([]int, error) {
	dfd, err := unix.Open("/proc/"+strconv.Itoa(pid)+"/task", unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, &os.PathError{Op: "open", Path: "/proc/" + strconv.Itoa(pid) + "/task", Err: err}
	}
	defer unix.Close(dfd)
	tids, err := procfs.ReadDirNamesFD(dfd, "/proc/"+strconv.Itoa(pid)+"/task")
	if err != nil {
		return nil, err
	}
	buf := make([]byte, 4096)
	var out []int
	for _, tid := range tids {
		b, ok := readAt(dfd, tid+"/children", buf)
		if !ok {
			continue // the thread exited meanwhile
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out, nil
}

// readAt reads file name below directory dfd whole, using buf (and
// growing past it only for a longer file).
func readAt(dfd int, name string, buf []byte) ([]byte, bool) {
	fd, err := unix.Openat(dfd, name, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, false
	}
	defer unix.Close(fd)
	var data []byte
	for {
		n, err := unix.Read(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, false
		}
		if n <= 0 {
			return data, true
		}
		data = append(data, buf[:n]...)
	}
}

// descendants lists every process below init (init excluded), parents
// before children, skipping the pids in skip (and their subtrees).
func descendants(init int, skip map[int]bool) ([]Proc, error) {
	return walk(init, skip, true)
}

// walk lists the descendants of init; with full false only PIDs are filled.
func walk(init int, skip map[int]bool, full bool) ([]Proc, error) {
	var out []Proc
	err := visitDescendants(init, skip, func(c int) {
		if exiting(c) {
			return // dying: not a live process any more
		}
		if !full {
			out = append(out, Proc{PID: c})
			return
		}
		p, err := readProc(c)
		if err != nil {
			return // exited meanwhile
		}
		out = append(out, p)
	})
	return out, err
}

// visitDescendants calls visit for every process below init (init
// excluded), breadth first, parents before children, skipping the pids in
// skip and their subtrees. Only listing init's own children can fail.
//
// Pids are host pids, and a host's pids are reused (pid_max is 32768 on
// this project's machine kind): a descendant that exits while the walk
// runs may be replaced by a process of another sandbox or of the host,
// whose children would then be listed as the sandbox's. So a child counts
// only if its parent, read from its own stat, is a process the walk
// already holds, and a process's children count only if it is still the
// process the walk found (same start time after its list was read).
func visitDescendants(init int, skip map[int]bool, visit func(pid int)) error {
	queue := []int{init}
	seen := map[int]bool{init: true}
	start := map[int]uint64{}
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		kids, err := children(pid)
		if err != nil {
			if pid == init {
				return fmt.Errorf("list children of init %d: %w", init, err)
			}
			continue
		}
		if pid != init {
			if _, st, err := statIDs(pid); err != nil || st != start[pid] {
				continue // gone, and maybe reused, while its list was read
			}
		}
		for _, c := range kids {
			if seen[c] || skip[c] {
				continue
			}
			ppid, st, err := statIDs(c)
			if err != nil || !seen[ppid] {
				continue // exited, or no longer the child that was listed
			}
			seen[c] = true
			start[c] = st
			queue = append(queue, c)
			visit(c)
		}
	}
	return nil
}

// statIDs reads pid's parent pid and start time (clock ticks since boot)
// from /proc/<pid>/stat.
func statIDs(pid int) (ppid int, start uint64, err error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "stat"))
	if err != nil {
		return 0, 0, err
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: no command name", pid)
	}
	f := strings.Fields(string(b[i+1:]))
	if len(f) < 20 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %d fields", pid, len(f))
	}
	// After the command: state, ppid, ..., starttime (field 22 of stat).
	if ppid, err = strconv.Atoi(f[1]); err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat: ppid: %w", pid, err)
	}
	if start, err = strconv.ParseUint(f[19], 10, 64); err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat: start time: %w", pid, err)
	}
	return ppid, start, nil
}

func itoa(i int) string { return strconv.Itoa(i) }

// pfExiting is the kernel's PF_EXITING task flag.
const pfExiting = 0x4

// readStatFields reads a /proc stat file and returns its fields after the
// command name (state first); ok is false when it is gone or unreadable.
func readStatFields(path string) (f []string, ok bool) {
	b, err := procfs.ReadFile(path)
	if err != nil {
		return nil, false
	}
	i := strings.LastIndexByte(string(b), ')')
	if i < 0 {
		return nil, false
	}
	return strings.Fields(string(b[i+1:])), true
}

// taskExiting reports whether the task whose stat fields are f is a
// zombie, dead, or has begun to exit (PF_EXITING).
func taskExiting(f []string) bool {
	if len(f) < 7 || f[0] == "Z" || f[0] == "X" {
		return true
	}
	flags, err := strconv.ParseUint(f[6], 10, 64)
	return err == nil && flags&pfExiting != 0
}

// exiting reports whether pid is gone, a zombie, or has begun to exit.
func exiting(pid int) bool {
	f, ok := readStatFields("/proc/" + strconv.Itoa(pid) + "/stat")
	return !ok || taskExiting(f)
}

// groupExiting reports whether every thread of process pid is gone, a
// zombie, or has begun to exit (exiting looks at the thread group's
// leader only, which may exit before its other threads: a thread of a
// killed process may still be in a system call then).
func groupExiting(pid int) bool {
	f, ok := readStatFields("/proc/" + strconv.Itoa(pid) + "/stat")
	if !ok || len(f) < 18 {
		return true
	}
	if n, err := strconv.Atoi(f[17]); err == nil && n <= 1 {
		return taskExiting(f)
	}
	// Several threads: each must be exiting (a zombie leader's group
	// lives on while another thread runs).
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	names, err := procfs.ReadDirNames(dir)
	if err != nil {
		return true // reaped meanwhile
	}
	for _, name := range names {
		if tf, ok := readStatFields(dir + "/" + name + "/stat"); ok && !taskExiting(tf) {
			return false
		}
	}
	return true
}

// errTerminal: CRIU cannot restore a terminal here. A pseudo-terminal slave
// without its master in the image (the master is the daemon's) needs the
// restoring criu's own stdin to be a terminal, or the master sent back over
// RPC (--orphan-pts-master), which go-criu cannot receive; so a process
// holding one gets no CRIU image, and a TTY session has templates only.
var errTerminal = errors.New("holds a terminal, which CRIU cannot restore here")

// terminalFd returns a descriptor of pid open on a terminal and its path,
// or -1.
func terminalFd(pid int) (int, string) {
	dir := "/proc/" + strconv.Itoa(pid) + "/fd"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return -1, ""
	}
	for _, e := range ents {
		l, err := os.Readlink(dir + "/" + e.Name())
		if err != nil {
			continue
		}
		if strings.HasPrefix(l, "/dev/pts/") || l == "/dev/ptmx" || l == "/dev/tty" || strings.HasPrefix(l, "/dev/tty") || l == "/dev/console" {
			n, _ := strconv.Atoi(e.Name())
			return n, l
		}
	}
	return -1, ""
}

// checkNoTerminal returns errTerminal (with the descriptor) if pid holds a
// terminal.
func checkNoTerminal(pid, shown int) error {
	if fd, path := terminalFd(pid); fd >= 0 {
		return fmt.Errorf("process %d %w (fd %d: %s)", shown, errTerminal, fd, path)
	}
	return nil
}
