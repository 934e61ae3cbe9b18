package probe

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// cgroupPIDs lists the processes of a cgroup v2 directory and its
// descendants, through f's kept files (nil: by path).
func cgroupPIDs(f *Files, dir string) ([]int, error) {
	var pids []int
	if err := addCgroupPIDs(f, dir, true, &pids); err != nil {
		return nil, fmt.Errorf("list processes of cgroup %s: %w", dir, err)
	}
	return pids, nil
}

// addCgroupPIDs appends the processes of cgroup dir and of its nested
// cgroups to pids. A cgroup directory's link count is two plus its number
// of subdirectories (kernfs keeps it so), which tells, at the cost of one
// stat, that there is no nested cgroup to list: a listing of the directory
// itself (a score of control files) cost more than the rest of a /proc
// snapshot of a one-process sandbox. A nested cgroup that vanishes
// meanwhile is no error; top is dir itself.
func addCgroupPIDs(f *Files, dir string, top bool, pids *[]int) error {
	gone := func(err error) bool { return !top && errors.Is(err, os.ErrNotExist) }
	b, err := f.cgroupProcs(dir)
	if err != nil {
		if gone(err) {
			return nil
		}
		return err
	}
	for _, f := range strings.Fields(string(b)) {
		if pid, err := strconv.Atoi(f); err == nil {
			*pids = append(*pids, pid)
		}
	}
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		if gone(err) {
			return nil
		}
		return err
	}
	if st.Nlink == 2 {
		return nil // no nested cgroup
	}
	ents, err := os.ReadDir(dir)
	if err != nil {
		if gone(err) {
			return nil
		}
		return err
	}
	for _, e := range ents {
		if !e.IsDir() {
			continue
		}
		if err := addCgroupPIDs(f, filepath.Join(dir, e.Name()), false, pids); err != nil {
			return err
		}
	}
	return nil
}

// takeSnapshot reads the processes of cgroup dir, through f's kept files
// (nil: by path; f then keeps the files of these processes only).
// Processes that exit while being read are left out. withNet adds the
// socket table. prev, if not nil, is an earlier snapshot of the same
// processes: see readProc.
func takeSnapshot(f *Files, dir string, withNet bool, exclude excludeFunc, prev *snapshot) (*snapshot, error) {
	pids, err := cgroupPIDs(f, dir)
	if err != nil {
		return nil, err
	}
	defer f.retain(pids)
	s := &snapshot{Procs: make(map[int]*procInfo, len(pids))}
	for _, pid := range pids {
		// The process's stat, read once: by the exclusion test if it
		// wants it, else by readProc.
		var st []byte
		var stErr error
		read := false
		stat := func() ([]byte, error) {
			if !read {
				read = true
				st, stErr = f.stat(pid)
			}
			return st, stErr
		}
		if exclude != nil && exclude(pid, stat) {
			continue
		}
		if read && stErr != nil {
			continue // exited meanwhile
		}
		p, err := readProcStat(f, pid, st, withNet, prev)
		if err != nil {
			continue // exited meanwhile
		}
		s.Procs[pid] = p
	}
	if withNet {
		s.Socks = readSockets(s.Procs)
	}
	return s, nil
}

// snapshotOf reads processes pids, leaving out those that exited. It lists
// no cgroup and excludes nothing: the caller knows pids to be exactly the
// agent's processes (KnownBeginner).
func snapshotOf(f *Files, pids []int, withNet bool) *snapshot {
	defer f.retain(pids)
	s := &snapshot{Procs: make(map[int]*procInfo, len(pids))}
	for _, pid := range pids {
		if p, err := readProcStat(f, pid, nil, withNet, nil); err == nil {
			s.Procs[pid] = p
		}
	}
	if withNet {
		s.Socks = readSockets(s.Procs)
	}
	return s
}

// readProc reads one process from /proc. When prev holds the same process
// (pid and start time) and its threads have not been scheduled since
// (schedstat's run time and run count unchanged), its working directory and
// argv[0] are taken from prev instead of read again: only the process
// itself changes them (chdir, exec, writing its argument area), and it did
// not run. Sockets are always read: a descriptor can arrive while the
// process sleeps (another process's connect to a listening socket).
//
// stat, if not nil, is the process's stat, read already.
func readProcStat(f *Files, pid int, stat []byte, withNet bool, prev *snapshot) (*procInfo, error) {
	base := procfs.PIDPath(pid, "")
	b := stat
	if b == nil {
		var err error
		if b, err = f.stat(pid); err != nil {
			return nil, err
		}
	}
	p := &procInfo{PID: pid}
	threads, err := parseStat(b, p)
	if err != nil {
		return nil, fmt.Errorf("parse %sstat: %w", base, err)
	}
	p.RunNS, p.Slices = readSchedstat(f, pid, threads)
	if q := prev.proc(pid); q != nil && q.StartTime == p.StartTime && q.RunNS == p.RunNS && q.Slices == p.Slices {
		p.Cwd, p.Argv0 = q.Cwd, q.Argv0
	} else {
		p.Cwd, _ = os.Readlink(base + "cwd")
		if cl, err := procfs.ReadFile(base + "cmdline"); err == nil {
			if i := bytes.IndexByte(cl, 0); i >= 0 {
				cl = cl[:i]
			}
			p.Argv0 = string(cl)
		}
	}
	if withNet {
		p.NetNS, _ = os.Readlink(base + "ns/net")
		p.Sockets = readSocketInodes(base[:len(base)-1])
	}
	return p, nil
}

// excludePID returns t's exclusion test of one pid (nil: none), reading the
// stat itself when ExcludeStat asks for it.
func (t Target) excludePID() func(pid int) bool {
	ex := t.excluder()
	if ex == nil {
		return nil
	}
	return func(pid int) bool {
		return ex(pid, func() ([]byte, error) { return t.Files.stat(pid) })
	}
}

// readStat reads /proc/PID/stat.
func readStat(pid int) ([]byte, error) { return (*Files)(nil).stat(pid) }

// proc returns s's process pid, or nil (also when s is nil).
func (s *snapshot) proc(pid int) *procInfo {
	if s == nil {
		return nil
	}
	return s.Procs[pid]
}

// parseStat fills comm, ppid, minflt and starttime from /proc/PID/stat and
// returns the number of threads (a leader that exited before its other
// threads still counts: TestReadProcZombieLeader).
func parseStat(b []byte, p *procInfo) (threads int, err error) {
	open := bytes.IndexByte(b, '(')
	closeParen := bytes.LastIndexByte(b, ')')
	if open < 0 || closeParen < open {
		return 0, errors.New("malformed stat")
	}
	p.Comm = string(b[open+1 : closeParen])
	f := strings.Fields(string(b[closeParen+1:]))
	// f[0] is field 3 (state); field n is f[n-3].
	if len(f) < 20 {
		return 0, errors.New("short stat")
	}
	if p.PPID, err = strconv.Atoi(f[4-3]); err != nil {
		return 0, err
	}
	if p.MinFlt, err = strconv.ParseUint(f[10-3], 10, 64); err != nil {
		return 0, err
	}
	if threads, err = strconv.Atoi(f[20-3]); err != nil {
		return 0, err
	}
	if p.StartTime, err = strconv.ParseUint(f[22-3], 10, 64); err != nil {
		return 0, err
	}
	return threads, nil
}

// readSchedstat sums the on-CPU time and the run counts of every thread of
// process pid. A process of one thread is read from its own schedstat (its
// leader's, through f's kept file), with no listing of its task directory.
func readSchedstat(f *Files, pid, threads int) (runNS, slices uint64) {
	base := procfs.PIDPath(pid, "")
	if threads == 1 {
		if b, err := f.schedstat(pid); err == nil {
			if r, s, ok := parseSchedstatBytes(b); ok {
				return r, s
			}
		}
	}
	names, err := procfs.ReadDirNames(base + "task")
	if err != nil {
		return 0, 0
	}
	for _, name := range names {
		if r, s, ok := parseSchedstat(base + "task/" + name + "/schedstat"); ok {
			runNS += r
			slices += s
		}
	}
	return runNS, slices
}

// parseSchedstat reads a schedstat file: run time (ns), wait time, run count.
func parseSchedstat(path string) (runNS, slices uint64, ok bool) {
	b, err := procfs.ReadFile(path)
	if err != nil {
		return 0, 0, false
	}
	return parseSchedstatBytes(b)
}

// parseSchedstatBytes parses a schedstat file's content.
func parseSchedstatBytes(b []byte) (runNS, slices uint64, ok bool) {
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return 0, 0, false
	}
	runNS, err1 := strconv.ParseUint(f[0], 10, 64)
	slices, err2 := strconv.ParseUint(f[2], 10, 64)
	if err1 != nil || err2 != nil {
		return 0, 0, false
	}
	return runNS, slices, true
}

// readSocketInodes lists the socket inodes held by a process's fds.
func readSocketInodes(base string) map[uint64]struct{} {
	ents, err := os.ReadDir(base + "/fd")
	if err != nil {
		return nil
	}
	var out map[uint64]struct{}
	for _, e := range ents {
		l, err := os.Readlink(base + "/fd/" + e.Name())
		if err != nil || !strings.HasPrefix(l, "socket:[") {
			continue
		}
		ino, err := strconv.ParseUint(strings.TrimSuffix(l[len("socket:["):], "]"), 10, 64)
		if err != nil {
			continue
		}
		if out == nil {
			out = map[uint64]struct{}{}
		}
		out[ino] = struct{}{}
	}
	return out
}

// readSockets reads the inet socket tables of every network namespace the
// processes live in, keeping the sockets those processes hold.
func readSockets(procs map[int]*procInfo) map[uint64]sockInfo {
	held := map[uint64]struct{}{}
	byNS := map[string]int{}
	for pid, p := range procs {
		for ino := range p.Sockets {
			held[ino] = struct{}{}
		}
		if len(p.Sockets) > 0 {
			if _, ok := byNS[p.NetNS]; !ok {
				byNS[p.NetNS] = pid
			}
		}
	}
	out := map[uint64]sockInfo{}
	if len(held) == 0 {
		return out
	}
	for _, pid := range byNS {
		for _, tbl := range []string{"tcp", "tcp6", "udp", "udp6"} {
			f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/net/" + tbl)
			if err != nil {
				continue
			}
			parseSockTable(f, strings.HasPrefix(tbl, "tcp"), held, out)
			f.Close()
		}
	}
	return out
}

// parseSockTable parses one /proc/net/{tcp,udp}{,6} table.
func parseSockTable(f *os.File, tcp bool, held map[uint64]struct{}, out map[uint64]sockInfo) {
	sc := bufio.NewScanner(f)
	sc.Scan() // header
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 10 {
			continue
		}
		ino, err := strconv.ParseUint(fl[9], 10, 64)
		if err != nil || ino == 0 {
			continue
		}
		if _, ok := held[ino]; !ok {
			continue
		}
		st, _ := strconv.ParseUint(fl[3], 16, 8)
		var si sockInfo
		if tcp && st == 0x0A {
			si.Listen = true
		} else if ip, port, ok := parseHexAddr(fl[2]); ok && port != 0 && !isLoopbackOrUnspec(ip) {
			si.Remote = joinHostPort(ip, port)
		}
		out[ino] = si
	}
}

// parseHexAddr parses "0100007F:1F90" or its 32-hex-digit IPv6 form.
func parseHexAddr(s string) ([]byte, uint16, bool) {
	h, p, ok := strings.Cut(s, ":")
	if !ok || (len(h) != 8 && len(h) != 32) {
		return nil, 0, false
	}
	port, err := strconv.ParseUint(p, 16, 16)
	if err != nil {
		return nil, 0, false
	}
	ip := make([]byte, len(h)/2)
	// The kernel prints each 32-bit word in host (little-endian) order.
	for w := 0; w < len(h)/8; w++ {
		v, err := strconv.ParseUint(h[w*8:w*8+8], 16, 32)
		if err != nil {
			return nil, 0, false
		}
		ip[w*4+0] = byte(v)
		ip[w*4+1] = byte(v >> 8)
		ip[w*4+2] = byte(v >> 16)
		ip[w*4+3] = byte(v >> 24)
	}
	return ip, uint16(port), true
}

// CgroupID returns the cgroup v2 id of dir: its inode number, which is what
// bpf_get_current_cgroup_id reports for processes in it.
func CgroupID(dir string) (uint64, error) {
	var st syscall.Stat_t
	if err := syscall.Stat(dir, &st); err != nil {
		return 0, fmt.Errorf("cgroup id of %s: %w", dir, err)
	}
	return st.Ino, nil
}
