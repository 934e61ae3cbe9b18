package sandbox

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Control protocol between the daemon and the sandbox init: one JSON object
// per SOCK_SEQPACKET message, file descriptors attached with SCM_RIGHTS.

const (
	opHello   = "hello"   // init->daemon: runtime up, waiting for the setup
	opSetup   = "setup"   // daemon->init: mount table and hostname
	opReady   = "ready"   // init->daemon: setup done (or Err)
	opSpawn   = "spawn"   // daemon->init: start a process; fds attached
	opKill    = "kill"    // daemon->init: signal a pid or process group
	opHold    = "hold"    // daemon->init: keep the attached fds, reply with their numbers
	opRelease = "release" // daemon->init: close held fds
	opPing    = "ping"    // daemon->init: round trip
	opExit    = "exit"    // init->daemon: a child was reaped
	opReply   = "reply"   // init->daemon: answer to request ID
)

// maxMsg bounds one control message (argv + env of a spawn); the socket's
// default send buffer (~208 KiB) is the real limit.
const maxMsg = 192 << 10

type msg struct {
	ID uint64 `json:"id,omitempty"`
	Op string `json:"op"`

	Setup *setupConfig `json:"setup,omitempty"`

	// spawn
	Argv  []string `json:"argv,omitempty"`
	Env   []string `json:"env,omitempty"`
	Dir   string   `json:"dir,omitempty"`
	Stdio []int    `json:"stdio,omitempty"` // index into attached fds per stdio slot, -1 = /dev/null

	// kill / spawn reply / exit
	PID    int  `json:"pid,omitempty"`
	Sig    int  `json:"sig,omitempty"`
	Group  bool `json:"group,omitempty"`
	Status int  `json:"status,omitempty"` // raw wait status

	// hold reply / release
	FDs []int `json:"fds,omitempty"`

	Err string `json:"err,omitempty"`
	// BadCommand marks a spawn's Err as the command's own fault (a
	// program or working directory that is not there): see ErrBadCommand.
	BadCommand bool `json:"bad_command,omitempty"`

	// spawn: run on a new terminal (stdio = its slave side); the reply
	// carries the master.
	TTY  bool `json:"tty,omitempty"`
	Rows int  `json:"rows,omitempty"`
	Cols int  `json:"cols,omitempty"`

	waiter chan exitStatus // daemon side: exit of a spawned pid
	fds    []int           // daemon side: fds that came with a reply
}

type setupConfig struct {
	Root     string   `json:"root"`
	Hostname string   `json:"hostname"`
	Net      bool     `json:"net"`
	Tmpfs    []string `json:"tmpfs,omitempty"`
	Hide     []string `json:"hide,omitempty"`
	Binds    []Bind   `json:"binds,omitempty"`
	KeepCaps bool     `json:"keep_caps,omitempty"`
	// RootFD: the message carries Root as a detached mount tree
	// (open_tree), attached in the init's own tree (a spare, which has
	// none of the host's paths). BindFDs: then the sources of Binds
	// follow, in order, as detached trees too.
	RootFD  bool `json:"root_fd,omitempty"`
	BindFDs bool `json:"bind_fds,omitempty"`
	// PIDCounterMin: see Config.PIDCounterMin.
	PIDCounterMin int `json:"pid_counter_min,omitempty"`
}

// conn is a SOCK_SEQPACKET unix connection carrying msg values. It works
// on the descriptor through the runtime's poller (os.File, RawConn), not
// package net: an init must not wait for net's package initialization,
// which a binary's init order puts near the end (see MaybeRunInit).
type conn struct {
	f   *os.File
	rc  syscall.RawConn
	wmu sync.Mutex
}

// newConn wraps a duplicate of f, which must be a SOCK_SEQPACKET unix
// socket; the caller keeps (and closes) f.
func newConn(f *os.File) (*conn, error) {
	var fd int
	var derr error
	sc, err := f.SyscallConn()
	if err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	if err := sc.Control(func(raw uintptr) { fd, derr = unix.FcntlInt(raw, unix.F_DUPFD_CLOEXEC, 0) }); err != nil {
		return nil, fmt.Errorf("control socket: %w", err)
	}
	if derr != nil {
		return nil, fmt.Errorf("control socket: %w", derr)
	}
	if typ, err := unix.GetsockoptInt(fd, unix.SOL_SOCKET, unix.SO_TYPE); err != nil || typ != unix.SOCK_SEQPACKET {
		unix.Close(fd)
		if err == nil {
			err = errors.New("not a SOCK_SEQPACKET socket")
		}
		return nil, fmt.Errorf("control socket: %w", err)
	}
	// Non-blocking (the flag is the shared description's): os.NewFile
	// then registers it with the poller, so reads park the goroutine and
	// honour deadlines.
	if err := unix.SetNonblock(fd, true); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("control socket: %w", err)
	}
	nf := os.NewFile(uintptr(fd), "control")
	rc, err := nf.SyscallConn()
	if err != nil {
		nf.Close()
		return nil, fmt.Errorf("control socket: %w", err)
	}
	return &conn{f: nf, rc: rc}, nil
}

func (c *conn) send(m *msg, fds ...int) error {
	b, err := json.Marshal(m)
	if err != nil {
		return err
	}
	if len(b) > maxMsg {
		return fmt.Errorf("control message too large (%d bytes, max %d): argv and env too long", len(b), maxMsg)
	}
	var oob []byte
	if len(fds) > 0 {
		oob = unix.UnixRights(fds...)
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	var serr error
	err = c.rc.Write(func(fd uintptr) bool {
		for {
			serr = unix.Sendmsg(int(fd), b, oob, nil, unix.MSG_NOSIGNAL)
			if serr != unix.EINTR {
				return serr != unix.EAGAIN
			}
		}
	})
	if err != nil {
		return err
	}
	return serr
}

// recv returns the next message and the fds attached to it (close-on-exec).
func (c *conn) recv(buf, oob []byte) (*msg, []int, error) {
	var n, oobn, flags int
	var rerr error
	err := c.rc.Read(func(fd uintptr) bool {
		for {
			n, oobn, flags, _, rerr = unix.Recvmsg(int(fd), buf, oob, unix.MSG_CMSG_CLOEXEC)
			if rerr != unix.EINTR {
				return rerr != unix.EAGAIN
			}
		}
	})
	if err == nil {
		err = rerr
	}
	if err != nil {
		return nil, nil, err
	}
	var fds []int
	if oobn > 0 {
		scms, perr := unix.ParseSocketControlMessage(oob[:oobn])
		if perr == nil {
			for _, scm := range scms {
				got, rerr := unix.ParseUnixRights(&scm)
				if rerr == nil {
					fds = append(fds, got...)
				}
			}
		}
	}
	if n == 0 {
		closeFDs(fds)
		return nil, nil, errEOF
	}
	if flags&(unix.MSG_TRUNC|unix.MSG_CTRUNC) != 0 {
		closeFDs(fds)
		return nil, nil, badMsgError{errors.New("truncated")}
	}
	var m msg
	if err := json.Unmarshal(buf[:n], &m); err != nil {
		closeFDs(fds)
		return nil, nil, badMsgError{err}
	}
	return &m, fds, nil
}

func (c *conn) close() error { return c.f.Close() }

// setReadDeadline sets the deadline of recv (zero: none).
func (c *conn) setReadDeadline(t time.Time) error { return c.f.SetReadDeadline(t) }

var errEOF = errors.New("control channel closed")

func closeFDs(fds []int) {
	for _, fd := range fds {
		unix.Close(fd)
	}
}

// badMsgError is a malformed message; the channel itself is still usable.
type badMsgError struct{ err error }

func (e badMsgError) Error() string { return "control message: " + e.err.Error() }
