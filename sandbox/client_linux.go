package sandbox

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sync"

	"golang.org/x/sys/unix"
)

// client is the daemon's end of the control channel.
type client struct {
	conn  *conn
	log   *slog.Logger
	ready chan *msg     // the init's ready message
	dead  chan struct{} // closed when the channel is gone

	mu       sync.Mutex
	nextID   uint64
	pending  map[uint64]chan *msg
	waiters  map[int]chan exitStatus // nspid -> exit
	orphans  map[uint64]bool         // spawn requests whose caller gave up
	unclaim  map[int]exitStatus      // exits nobody waited for (bounded)
	unclaimQ []int
	closed   bool
}

// exitStatus is a reaped process's raw wait status.
type exitStatus struct {
	ws      unix.WaitStatus
	unknown bool // the process is gone but was not reaped by init
}

// code returns the exit code, 128+signal when killed by a signal, -1 when
// unknown.
func (e exitStatus) code() int {
	if e.unknown {
		return -1
	}
	if e.ws.Signaled() {
		return 128 + int(e.ws.Signal())
	}
	return e.ws.ExitStatus()
}

const maxUnclaimed = 4096

func newClient(c *conn, log *slog.Logger) *client {
	cl := &client{
		conn: c, log: log,
		ready:   make(chan *msg, 1),
		dead:    make(chan struct{}),
		pending: map[uint64]chan *msg{},
		waiters: map[int]chan exitStatus{},
		unclaim: map[int]exitStatus{},
		orphans: map[uint64]bool{},
	}
	go cl.readLoop()
	return cl
}

func (cl *client) readLoop() {
	defer func() {
		cl.mu.Lock()
		cl.closed = true
		for id, ch := range cl.pending {
			close(ch)
			delete(cl.pending, id)
		}
		// The init is gone and took every process with it: their exit
		// statuses will never come.
		for pid, w := range cl.waiters {
			w <- exitStatus{unknown: true}
			delete(cl.waiters, pid)
		}
		cl.mu.Unlock()
		close(cl.dead)
	}()
	buf := make([]byte, maxMsg)
	oob := make([]byte, unix.CmsgSpace(16*4))
	for {
		m, fds, err := cl.conn.recv(buf, oob)
		if err != nil || m.Op != opReply {
			closeFDs(fds) // only replies carry fds (a terminal's master)
		}
		if err != nil {
			var bad badMsgError
			if errors.As(err, &bad) {
				cl.log.Warn("sandbox control", "err", err)
				continue
			}
			return
		}
		switch m.Op {
		case opReady:
			select {
			case cl.ready <- m:
			default:
			}
		case opExit:
			cl.mu.Lock()
			st := exitStatus{ws: unix.WaitStatus(m.Status)}
			if ch, ok := cl.waiters[m.PID]; ok {
				delete(cl.waiters, m.PID)
				ch <- st
			} else {
				if _, ok := cl.unclaim[m.PID]; !ok {
					cl.unclaimQ = append(cl.unclaimQ, m.PID)
				}
				cl.unclaim[m.PID] = st
				for len(cl.unclaimQ) > maxUnclaimed {
					delete(cl.unclaim, cl.unclaimQ[0])
					cl.unclaimQ = cl.unclaimQ[1:]
				}
			}
			cl.mu.Unlock()
		case opReply:
			cl.mu.Lock()
			if cl.orphans[m.ID] {
				// The caller was cancelled while the init spawned: kill
				// what it started.
				delete(cl.orphans, m.ID)
				cl.mu.Unlock()
				closeFDs(fds)
				if m.PID > 0 {
					go func(pid int) {
						_ = cl.conn.send(&msg{Op: opKill, PID: pid, Sig: int(unix.SIGKILL), Group: true})
						_ = cl.conn.send(&msg{Op: opKill, PID: pid, Sig: int(unix.SIGKILL)})
					}(m.PID)
				}
				continue
			}
			ch, ok := cl.pending[m.ID]
			delete(cl.pending, m.ID)
			if ok && m.Err == "" && m.PID > 0 {
				// A spawn reply: register the exit waiter before any later
				// exit message for this pid is read.
				delete(cl.unclaim, m.PID)
				w := make(chan exitStatus, 1)
				cl.waiters[m.PID] = w
				m.waiter = w
			}
			cl.mu.Unlock()
			if ok {
				m.fds = fds
				ch <- m
			} else {
				closeFDs(fds)
			}
		}
	}
}

// call sends a request and waits for its reply.
func (cl *client) call(ctx context.Context, m *msg, fds ...int) (*msg, chan exitStatus, error) {
	ch := make(chan *msg, 1)
	cl.mu.Lock()
	if cl.closed {
		cl.mu.Unlock()
		return nil, nil, ErrClosed
	}
	cl.nextID++
	m.ID = cl.nextID
	cl.pending[m.ID] = ch
	cl.mu.Unlock()
	if err := cl.conn.send(m, fds...); err != nil {
		cl.mu.Lock()
		delete(cl.pending, m.ID)
		cl.mu.Unlock()
		return nil, nil, fmt.Errorf("%s: %w", m.Op, err)
	}
	select {
	case r, ok := <-ch:
		if !ok {
			return nil, nil, ErrClosed
		}
		if r.Err != "" {
			closeFDs(r.fds)
			if r.waiter != nil {
				cl.forget(r.PID)
			}
			if r.BadCommand {
				return nil, nil, badCommandError(r.Err)
			}
			return nil, nil, errors.New(r.Err)
		}
		return r, r.waiter, nil
	case <-ctx.Done():
		cl.mu.Lock()
		if _, still := cl.pending[m.ID]; still {
			delete(cl.pending, m.ID)
			if m.Op == opSpawn {
				cl.orphans[m.ID] = true
			}
			cl.mu.Unlock()
		} else {
			// The reply raced with ctx: it is in ch.
			cl.mu.Unlock()
			r, ok := <-ch
			if ok {
				closeFDs(r.fds)
			}
			if ok && r.waiter != nil && r.Err == "" && m.Op == opSpawn {
				cl.forget(r.PID)
				_ = cl.conn.send(&msg{Op: opKill, PID: r.PID, Sig: int(unix.SIGKILL), Group: true})
				_ = cl.conn.send(&msg{Op: opKill, PID: r.PID, Sig: int(unix.SIGKILL)})
			}
		}
		return nil, nil, ctx.Err()
	}
}

func (cl *client) forget(pid int) {
	cl.mu.Lock()
	delete(cl.waiters, pid)
	cl.mu.Unlock()
}

// watch returns a channel that receives the exit of nspid, also if it
// exited before (alive reports whether the process is known to be alive now,
// in which case an older unclaimed exit of a recycled pid is ignored).
func (cl *client) watch(nspid int, alive bool) chan exitStatus {
	w := make(chan exitStatus, 1)
	cl.mu.Lock()
	defer cl.mu.Unlock()
	if cl.closed {
		w <- exitStatus{unknown: true}
		return w
	}
	if st, ok := cl.unclaim[nspid]; ok {
		delete(cl.unclaim, nspid)
		if !alive {
			w <- st
			return w
		}
	}
	cl.waiters[nspid] = w
	return w
}

func (cl *client) close() {
	_ = cl.conn.close()
}
