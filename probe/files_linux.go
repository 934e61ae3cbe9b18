package probe

import (
	"errors"
	"io/fs"
	"path/filepath"
	"sync"

	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// Files keeps open, from one snapshot of a sandbox to the next, the files
// every snapshot reads: its cgroup's cgroup.procs and each process's stat
// and schedstat. A kept file is read again with one pread at offset 0 (the
// kernel generates a /proc or cgroup file anew on a read from its start)
// instead of an open, two reads and a close: a snapshot of a one-process
// sandbox makes five system calls instead of about fifteen, and each one
// costs several microseconds on a small VM, more under load.
//
// A kept /proc file stays bound to the process it was opened for: once
// that process is gone a read of it fails (ESRCH), and the file is opened
// again by its path, which names whatever process has the pid by then.
// At most maxKeptPIDs processes are kept; snapshots read the rest by path.
//
// A Files belongs to one sandbox (Target.Files), is safe for concurrent
// use, and must be closed when the sandbox's windows are done with it.
type Files struct {
	mu     sync.Mutex
	closed bool
	cg     map[string]int // cgroup directory -> its cgroup.procs
	pids   map[int]*pidFiles
}

// pidFiles are the kept files of one pid (-1: not open).
type pidFiles struct {
	stat, sched int
}

// maxKeptPIDs bounds the processes a Files keeps files of; maxKeptCgroups
// the cgroup directories. An agent's sandbox runs a few processes; the
// bounds keep a daemon of many sandboxes far from its descriptor limit
// (two per process: 64 sandboxes keep at most some 2,300).
const (
	maxKeptPIDs    = 16
	maxKeptCgroups = 4
)

// Sizes of the buffers the kept files are read into. A read that fills
// its buffer is done again by path, however long the file is.
const (
	statBufSize   = 1024 // /proc/PID/stat: a comm and 52 numbers
	schedBufSize  = 128  // /proc/PID/schedstat: three numbers
	cgroupBufSize = 8192 // cgroup.procs: about a thousand pids
)

// errFull is a read that filled its buffer.
var errFull = errors.New("file larger than its buffer")

// NewFiles returns an empty Files.
func NewFiles() *Files {
	return &Files{cg: map[string]int{}, pids: map[int]*pidFiles{}}
}

// Close closes every kept file. Snapshots that use f afterwards read by
// path.
func (f *Files) Close() error {
	if f == nil {
		return nil
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	f.closed = true
	for dir, fd := range f.cg {
		unix.Close(fd)
		delete(f.cg, dir)
	}
	for pid, pf := range f.pids {
		pf.close()
		delete(f.pids, pid)
	}
	return nil
}

// Kept returns how many processes f holds files of (for tests).
func (f *Files) Kept() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	return len(f.pids)
}

func (pf *pidFiles) close() {
	for _, fd := range []int{pf.stat, pf.sched} {
		if fd >= 0 {
			unix.Close(fd)
		}
	}
	pf.stat, pf.sched = -1, -1
}

// pread0 reads the file open as fd from its start into a buffer of size
// bytes.
func pread0(fd, size int) ([]byte, error) {
	buf := make([]byte, size)
	for {
		n, err := unix.Pread(fd, buf, 0)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n == size {
			return nil, errFull
		}
		return buf[:n], nil
	}
}

// openRead opens path, reads it from the start and returns the open file
// with what it read.
func openRead(path string, size int) (int, []byte, error) {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	for err == unix.EINTR {
		fd, err = unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	}
	if err != nil {
		return -1, nil, err
	}
	b, err := pread0(fd, size)
	if err != nil {
		unix.Close(fd)
		return -1, nil, err
	}
	return fd, b, nil
}

// cgroupProcs returns the cgroup.procs of cgroup directory dir.
func (f *Files) cgroupProcs(dir string) ([]byte, error) {
	path := filepath.Join(dir, "cgroup.procs")
	if f == nil {
		return procfs.ReadFile(path)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if fd, ok := f.cg[dir]; ok {
		if b, err := pread0(fd, cgroupBufSize); err == nil {
			return b, nil
		}
		// Removed (a nested cgroup), or too long: by path.
		unix.Close(fd)
		delete(f.cg, dir)
		return procfs.ReadFile(path)
	}
	if f.closed || len(f.cg) >= maxKeptCgroups {
		return procfs.ReadFile(path)
	}
	fd, b, err := openRead(path, cgroupBufSize)
	if err != nil {
		return procfs.ReadFile(path)
	}
	f.cg[dir] = fd
	return b, nil
}

// stat returns /proc/PID/stat.
func (f *Files) stat(pid int) ([]byte, error) {
	return f.read(pid, "stat", statBufSize, func(pf *pidFiles) *int { return &pf.stat })
}

// schedstat returns /proc/PID/schedstat.
func (f *Files) schedstat(pid int) ([]byte, error) {
	return f.read(pid, "schedstat", schedBufSize, func(pf *pidFiles) *int { return &pf.sched })
}

// read returns the /proc/PID file name through its kept descriptor
// (which(pf)), opening and keeping it if need be.
func (f *Files) read(pid int, name string, size int, which func(*pidFiles) *int) ([]byte, error) {
	path := procfs.PIDPath(pid, name)
	if f == nil {
		return procfs.ReadFile(path)
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	pf := f.pids[pid]
	if pf == nil {
		if f.closed || len(f.pids) >= maxKeptPIDs {
			return procfs.ReadFile(path)
		}
		pf = &pidFiles{stat: -1, sched: -1}
		f.pids[pid] = pf
	}
	fd := which(pf)
	if *fd >= 0 {
		b, err := pread0(*fd, size)
		if err == nil {
			return b, nil
		}
		// The process it was opened for is gone (ESRCH): the pid may
		// be another process's now.
		unix.Close(*fd)
		*fd = -1
	}
	nfd, b, err := openRead(path, size)
	if err != nil {
		if errors.Is(err, errFull) {
			return procfs.ReadFile(path)
		}
		return nil, &fs.PathError{Op: "read", Path: path, Err: err}
	}
	*fd = nfd
	return b, nil
}

// retain closes the files of every process but those of pids.
func (f *Files) retain(pids []int) {
	if f == nil {
		return
	}
	f.mu.Lock()
	defer f.mu.Unlock()
	if len(f.pids) == 0 {
		return
	}
	keep := make(map[int]bool, len(pids))
	for _, p := range pids {
		keep[p] = true
	}
	for pid, pf := range f.pids {
		if !keep[pid] {
			pf.close()
			delete(f.pids, pid)
		}
	}
}
