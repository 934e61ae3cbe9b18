package probe

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"syscall"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// The proc connector (NETLINK_CONNECTOR, CN_IDX_PROC) reports every fork,
// exec, comm change and exit of the host. The userspace backend uses it to
// count the short-lived processes its /proc snapshots cannot see.
const (
	cnIdxProc         = 1
	cnValProc         = 1
	procCnMcastListen = 1
	procEventFork     = 0x00000001
	procEventExec     = 0x00000002
	procEventComm     = 0x00000200
	procEventExit     = 0x80000000
	nlmsgHdrLen       = 16
	cnMsgLen          = 20
	procEventHdrLen   = 16 // what, cpu, timestamp
)

// procConn is one proc-connector socket shared by the windows of a probe.
type procConn struct {
	fd   int
	stop chan struct{}
	done chan struct{}

	mu   sync.Mutex // guards subs and the socket's reads
	subs map[*connSub]struct{}
	buf  []byte
}

// connSub accumulates the events of one sandbox during one window.
type connSub struct {
	cgPath  string // the cgroup as /proc/PID/cgroup shows it ("/rewind/x")
	exclude func(int) bool
	members map[int]bool // tgids known to be the sandbox's

	forked, execs, lost uint64
	samples             []effect.Exec
}

// openProcConn subscribes to the proc connector.
func openProcConn() (*procConn, error) {
	fd, err := unix.Socket(unix.AF_NETLINK, unix.SOCK_DGRAM|unix.SOCK_CLOEXEC|unix.SOCK_NONBLOCK, unix.NETLINK_CONNECTOR)
	if err != nil {
		return nil, fmt.Errorf("proc connector socket: %w", err)
	}
	_ = unix.SetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_RCVBUFFORCE, 8<<20)
	if err := unix.Bind(fd, &unix.SockaddrNetlink{Family: unix.AF_NETLINK, Groups: cnIdxProc}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("proc connector bind: %w", err)
	}
	msg := make([]byte, nlmsgHdrLen+cnMsgLen+4)
	le := binary.LittleEndian
	le.PutUint32(msg[0:], uint32(len(msg)))
	le.PutUint16(msg[4:], unix.NLMSG_DONE)
	le.PutUint32(msg[12:], uint32(os.Getpid()))
	le.PutUint32(msg[16:], cnIdxProc)
	le.PutUint32(msg[20:], cnValProc)
	le.PutUint16(msg[32:], 4)
	le.PutUint32(msg[36:], procCnMcastListen)
	if err := unix.Sendto(fd, msg, 0, &unix.SockaddrNetlink{Family: unix.AF_NETLINK}); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("proc connector listen: %w", err)
	}
	c := &procConn{fd: fd, stop: make(chan struct{}), done: make(chan struct{}), subs: map[*connSub]struct{}{}, buf: make([]byte, 64<<10)}
	go c.loop()
	return c, nil
}

// loop handles events as they come, so that the comm and argv[0] of a
// short-lived process can still be read from /proc, and the socket does not
// overflow between windows' ends.
func (c *procConn) loop() {
	defer close(c.done)
	for {
		select {
		case <-c.stop:
			return
		default:
		}
		fds := []unix.PollFd{{Fd: int32(c.fd), Events: unix.POLLIN}}
		if n, err := unix.Poll(fds, 50); err != nil || n == 0 {
			continue
		}
		c.drain()
	}
}

func (c *procConn) close() {
	close(c.stop)
	<-c.done
	c.mu.Lock()
	unix.Close(c.fd)
	c.fd = -1
	c.mu.Unlock()
}

// subscribe starts accumulating events for the processes of a cgroup.
func (c *procConn) subscribe(cgDir string, exclude func(int) bool) (*connSub, error) {
	rel, err := cgroupPath(cgDir)
	if err != nil {
		return nil, err
	}
	s := &connSub{cgPath: rel, exclude: exclude, members: map[int]bool{}}
	c.drain() // older events belong to no window
	c.mu.Lock()
	c.subs[s] = struct{}{}
	c.mu.Unlock()
	return s, nil
}

// addMembers records processes found by a snapshot.
func (c *procConn) addMembers(s *connSub, snap *snapshot) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for pid := range snap.Procs {
		s.members[pid] = true
	}
}

// take drains the socket and returns what s accumulated, resetting it
// (rotate) or unsubscribing it.
func (c *procConn) take(s *connSub, rotate bool) (forked, execs, lost uint64, samples []effect.Exec) {
	c.drain()
	c.mu.Lock()
	defer c.mu.Unlock()
	forked, execs, lost, samples = s.forked, s.execs, s.lost, s.samples
	s.forked, s.execs, s.lost, s.samples = 0, 0, 0, nil
	if !rotate {
		delete(c.subs, s)
	}
	return forked, execs, lost, samples
}

func (c *procConn) unsubscribe(s *connSub) {
	c.mu.Lock()
	defer c.mu.Unlock()
	delete(c.subs, s)
}

// drain reads every queued message and dispatches it.
func (c *procConn) drain() {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.fd < 0 {
		return
	}
	for {
		n, _, err := unix.Recvfrom(c.fd, c.buf, 0)
		if err != nil {
			if errors.Is(err, unix.ENOBUFS) {
				for s := range c.subs {
					s.lost++ // the kernel dropped events: the window cannot be trusted
				}
				continue
			}
			return // EAGAIN: drained
		}
		c.parse(c.buf[:n])
	}
}

// parse handles one datagram; c.mu is held.
func (c *procConn) parse(b []byte) {
	le := binary.LittleEndian
	for len(b) >= nlmsgHdrLen {
		l := int(le.Uint32(b))
		if l < nlmsgHdrLen || l > len(b) {
			return
		}
		m := b[nlmsgHdrLen:l]
		b = b[(l+3)&^3:]
		if len(m) < cnMsgLen+procEventHdrLen || le.Uint32(m) != cnIdxProc {
			continue
		}
		ev := m[cnMsgLen:]
		what, data := le.Uint32(ev), ev[procEventHdrLen:]
		if len(c.subs) == 0 {
			continue
		}
		switch what {
		case procEventFork:
			if len(data) < 16 {
				continue
			}
			parent, child, childTGID := int(le.Uint32(data[4:])), int(le.Uint32(data[8:])), int(le.Uint32(data[12:]))
			if child != childTGID {
				continue // a thread
			}
			for s := range c.subs {
				if s.members[parent] && !s.excluded(child) {
					s.members[child] = true
					s.forked++
				}
			}
		case procEventExec:
			if len(data) < 8 {
				continue
			}
			tgid := int(le.Uint32(data[4:]))
			var cg string
			cgRead := false
			for s := range c.subs {
				if !s.members[tgid] {
					// Spawned into the cgroup from outside (CLONE_INTO_CGROUP).
					if !cgRead {
						cg, cgRead = procCgroup(tgid), true
					}
					if cg == "" || (cg != s.cgPath && !strings.HasPrefix(cg, s.cgPath+"/")) {
						continue
					}
					s.members[tgid] = true
				}
				if s.excluded(tgid) {
					continue
				}
				s.execs++
				if len(s.samples) < effect.MaxSamples {
					s.samples = append(s.samples, effect.Exec{PID: tgid, Comm: procComm(tgid), Argv0: procArgv0(tgid)})
				}
			}
		case procEventComm:
			if len(data) < 8+16 {
				continue
			}
			tgid, comm := int(le.Uint32(data[4:])), cstr(data[8:24])
			for s := range c.subs {
				for i := len(s.samples) - 1; i >= 0; i-- {
					if s.samples[i].PID == tgid {
						if s.samples[i].Comm == "" {
							s.samples[i].Comm = comm
						}
						break
					}
				}
			}
		case procEventExit:
			if len(data) < 8 {
				continue
			}
			pid, tgid := int(le.Uint32(data)), int(le.Uint32(data[4:]))
			if pid == tgid {
				for s := range c.subs {
					delete(s.members, tgid)
				}
			}
		}
	}
}

func (s *connSub) excluded(pid int) bool { return s.exclude != nil && s.exclude(pid) }

// procCgroup returns a process's cgroup v2 path, "" if unknown.
func procCgroup(pid int) string {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "cgroup"))
	if err != nil {
		return ""
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			return p
		}
	}
	return ""
}

func procComm(pid int) string {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "comm"))
	if err != nil {
		return ""
	}
	return strings.TrimSuffix(string(b), "\n")
}

func procArgv0(pid int) string {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "cmdline"))
	if err != nil {
		return ""
	}
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

// cgroupPath returns dir as /proc/PID/cgroup shows it: relative to the
// cgroup2 mount that holds it, with a leading slash.
func cgroupPath(dir string) (string, error) {
	dir = filepath.Clean(dir)
	const cgroup2Magic = 0x63677270
	isCg2 := func(p string) bool {
		var st syscall.Statfs_t
		return syscall.Statfs(p, &st) == nil && st.Type == cgroup2Magic
	}
	if !isCg2(dir) {
		return "", fmt.Errorf("%s is not in a cgroup2 file system", dir)
	}
	root := dir
	for root != "/" && isCg2(filepath.Dir(root)) {
		root = filepath.Dir(root)
	}
	rel, err := filepath.Rel(root, dir)
	if err != nil {
		return "", err
	}
	if rel == "." {
		return "/", nil
	}
	return "/" + rel, nil
}
