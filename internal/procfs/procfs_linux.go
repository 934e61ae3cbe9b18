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
	"runtime"
	"strconv"
	"unsafe"

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

// procmapQuery is struct procmap_query of linux/fs.h (Linux 6.11).
type procmapQuery struct {
	Size        uint64
	QueryFlags  uint64
	QueryAddr   uint64
	VMAStart    uint64
	VMAEnd      uint64
	VMAFlags    uint64
	VMAPageSize uint64
	VMAOffset   uint64
	Inode       uint64
	DevMajor    uint32
	DevMinor    uint32
	VMANameSize uint32
	BuildIDSize uint32
	VMANameAddr uint64
	BuildIDAddr uint64
}

// procmapQueryIoctl is PROCMAP_QUERY, _IOWR('f', 17, struct procmap_query).
const procmapQueryIoctl = 0xc0686611

// Flags of NextMapping's want (PROCMAP_QUERY_VMA_*): a mapping must have
// all of them.
const (
	MapReadable = 0x01
	MapWritable = 0x02
	MapShared   = 0x08
)

// procmapCoveringOrNext is PROCMAP_QUERY_COVERING_OR_NEXT_VMA.
const procmapCoveringOrNext = 0x10

// Mapping is one memory mapping of a process.
type Mapping struct {
	Start, End uint64
	// Name is the mapping's path (with " (deleted)" for a file without a
	// name: a deleted file, a memfd, shared anonymous or SysV memory) or
	// its kind ("[heap]"); empty for private anonymous memory.
	Name string
}

// NextMapping returns the lowest mapping ending above addr that has every
// flag of want (Map*), of the process whose maps file is open as mapsFD
// (/proc/PID/maps): one ioctl, where the maps file formats every mapping
// with its path. ENOENT: there is none. ENOTTY: the kernel has no
// PROCMAP_QUERY (Linux 6.11), read the maps file instead.
func NextMapping(mapsFD int, addr uint64, want uint64) (Mapping, error) {
	name := make([]byte, 4096)
	q := procmapQuery{
		QueryFlags:  procmapCoveringOrNext | want,
		QueryAddr:   addr,
		VMANameSize: uint32(len(name)),
		VMANameAddr: uint64(uintptr(unsafe.Pointer(&name[0]))),
	}
	q.Size = uint64(unsafe.Sizeof(q))
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, uintptr(mapsFD), procmapQueryIoctl, uintptr(unsafe.Pointer(&q)))
	runtime.KeepAlive(name)
	if errno != 0 {
		return Mapping{}, errno
	}
	m := Mapping{Start: q.VMAStart, End: q.VMAEnd}
	if n := int(q.VMANameSize); n > 0 && n <= len(name) {
		m.Name = string(name[:n-1]) // without its NUL
	}
	return m, nil
}
