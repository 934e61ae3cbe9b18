// Package procfs reads small kernel pseudo-files (/proc, cgroupfs) with as
// few system calls as possible.
//
// os.ReadFile costs ten system calls for a /proc file: besides open, read
// and close, the os package tries to register the descriptor with the
// runtime's poller (two fcntl pairs and an epoll_ctl that fails with EPERM)
// and stats it for its size (zero for /proc files). ReadFile here opens,
// reads until end of file and closes: four. On the restore path, where
// rewind reads a handful of /proc files per process at every probe window
// and every kill, and on a paravirtualized VM where a system call costs
// several microseconds, the difference is most of a window's time.
package procfs

import (
	"io/fs"
	"strconv"

	"golang.org/x/sys/unix"
)

// initialSize is the first buffer ReadFile reads into: /proc/PID/stat,
// schedstat, cmdline and cgroup.procs of a small cgroup fit.
const initialSize = 1024

// ReadFile returns the content of the file at path, read with open(2),
// read(2) until end of file, and close(2). The path is opened with
// O_NOFOLLOW unless it is under /proc (whose per-process entries are
// symbolic links, /proc/self among them).
func ReadFile(path string) ([]byte, error) {
	fd, err := open(path)
	if err != nil {
		return nil, err
	}
	defer unix.Close(fd)
	buf := make([]byte, 0, initialSize)
	for {
		if len(buf) == cap(buf) {
			buf = append(buf, 0)[:len(buf)]
		}
		n, err := unix.Read(fd, buf[len(buf):cap(buf)])
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &fs.PathError{Op: "read", Path: path, Err: err}
		}
		if n == 0 {
			return buf, nil
		}
		buf = buf[:len(buf)+n]
	}
}

// ReadDirNames returns the names in directory path (without "." and ".."),
// read with open(2), getdents64(2) and close(2).
func ReadDirNames(path string) ([]string, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	for err == unix.EINTR {
		fd, err = unix.Open(path, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return nil, &fs.PathError{Op: "open", Path: path, Err: err}
	}
	defer unix.Close(fd)
	return ReadDirNamesFD(fd, path)
}

// ReadDirNamesFD is ReadDirNames of directory descriptor fd, read from its
// current offset; path names it in errors. The caller keeps fd (to open
// files relative to it).
func ReadDirNamesFD(fd int, path string) ([]string, error) {
	var names []string
	buf := make([]byte, 4096)
	for {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, &fs.PathError{Op: "getdents", Path: path, Err: err}
		}
		if n <= 0 {
			return names, nil
		}
		_, _, names = unix.ParseDirent(buf[:n], -1, names)
	}
}

// PIDPath returns "/proc/PID/name" without fmt.
func PIDPath(pid int, name string) string {
	return "/proc/" + strconv.Itoa(pid) + "/" + name
}

func open(path string) (int, error) {
	flags := unix.O_RDONLY | unix.O_CLOEXEC
	if len(path) < 6 || path[:6] != "/proc/" {
		flags |= unix.O_NOFOLLOW
	}
	for {
		fd, err := unix.Open(path, flags, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return -1, &fs.PathError{Op: "open", Path: path, Err: err}
		}
		return fd, nil
	}
}

// nsGetPIDFromPIDNS is NS_GET_PID_FROM_PIDNS, _IOR(0xb7, 0x6, int) in
// linux/nsfs.h (Linux 6.10).
const nsGetPIDFromPIDNS = 0x8004b706

// PIDFromNS returns the id, in the caller's PID namespace, of the task
// whose id in the namespace whose descriptor is nsfd (an open
// /proc/PID/ns/pid) is id: PIDInNS the other way round. ESRCH: no task has
// that id there. ENOTTY or EINVAL: the kernel cannot translate.
func PIDFromNS(nsfd, id int) (int, error) { return nsIoctl(nsfd, nsGetPIDFromPIDNS, id) }

// nsGetPIDInPIDNS is NS_GET_PID_IN_PIDNS, _IOR(0xb7, 0x8, int) in
// linux/nsfs.h (Linux 6.10).
const nsGetPIDInPIDNS = 0x8004b708

// PIDInNS returns the id, in the PID namespace whose descriptor is nsfd
// (an open /proc/PID/ns/pid), of the task (a thread or a process) whose id
// in the caller's namespace is id: one ioctl, where the id is otherwise
// read from the task's status (NSpid). ESRCH: no such task, or it is not
// in that namespace. ENOTTY or EINVAL: the kernel cannot translate.
func PIDInNS(nsfd, id int) (int, error) { return nsIoctl(nsfd, nsGetPIDInPIDNS, id) }

// nsIoctl is one of nsfs's id translations: the ioctl's result is the id.
func nsIoctl(nsfd int, req uintptr, id int) (int, error) {
	r, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(nsfd), req, uintptr(id))
	if errno != 0 {
		return 0, errno
	}
	return int(r), nil
}
