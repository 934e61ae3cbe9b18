package client

import (
	"bufio"
	"context"
	"io"
	"net"
	"net/http"
	"sync"
	"time"
)

// transport is an http.RoundTripper for one unix socket that runs each
// exchange on the caller's goroutine: it writes the request and reads the
// answer itself on a kept-alive connection. net/http's Transport hands
// every request to a writer goroutine and every answer back from a reader
// goroutine; on a small VM those hand-offs (each a thread wake-up) cost
// more than the daemon's work for a turn.
type transport struct {
	socket  string
	maxIdle int

	mu   sync.Mutex
	idle []*pconn
}

// pconn is one connection with its buffers.
type pconn struct {
	c  net.Conn
	br *bufio.Reader
	bw *bufio.Writer
}

// aLongTimeAgo is a deadline in the past: it makes pending I/O fail.
var aLongTimeAgo = time.Unix(1, 0)

func (t *transport) dial(ctx context.Context) (*pconn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", t.socket)
	if err != nil {
		return nil, err
	}
	return &pconn{c: c, br: bufio.NewReaderSize(c, 16<<10), bw: bufio.NewWriterSize(c, 8<<10)}, nil
}

// get returns an idle connection the daemon has not closed, or a new one.
func (t *transport) get(ctx context.Context) (*pconn, error) {
	for {
		var pc *pconn
		t.mu.Lock()
		if n := len(t.idle); n > 0 {
			pc = t.idle[n-1]
			t.idle = t.idle[:n-1]
		}
		t.mu.Unlock()
		if pc == nil {
			return t.dial(ctx)
		}
		if pc.br.Buffered() == 0 && idleAlive(pc.c) {
			return pc, nil
		}
		pc.c.Close()
	}
}

// put keeps a connection whose last answer was read to its end.
func (t *transport) put(pc *pconn) {
	t.mu.Lock()
	if len(t.idle) < t.maxIdle {
		t.idle = append(t.idle, pc)
		pc = nil
	}
	t.mu.Unlock()
	if pc != nil {
		pc.c.Close()
	}
}

// CloseIdleConnections closes the kept-alive connections (http.Client
// calls it from its own CloseIdleConnections).
func (t *transport) CloseIdleConnections() {
	t.mu.Lock()
	idle := t.idle
	t.idle = nil
	t.mu.Unlock()
	for _, pc := range idle {
		pc.c.Close()
	}
}

// RoundTrip implements http.RoundTripper. A request is written once: a
// kept-alive connection is checked before reuse (see idleAlive), so a
// daemon that restarted meanwhile costs a new connection, not a replay.
func (t *transport) RoundTrip(req *http.Request) (*http.Response, error) {
	ctx := req.Context()
	pc, err := t.get(ctx)
	if err != nil {
		if req.Body != nil {
			req.Body.Close()
		}
		return nil, err
	}
	return t.exchange(ctx, pc, req)
}

// exchange writes req on pc and reads the answer's head; the body is read
// by the caller through the returned response, which hands pc back.
func (t *transport) exchange(ctx context.Context, pc *pconn, req *http.Request) (*http.Response, error) {
	// Cancelling the context fails the connection's pending I/O; no
	// goroutine waits for it meanwhile.
	stop := context.AfterFunc(ctx, func() { pc.c.SetDeadline(aLongTimeAgo) })
	fail := func(err error) (*http.Response, error) {
		stop()
		pc.c.Close()
		if cerr := ctx.Err(); cerr != nil {
			return nil, cerr
		}
		return nil, err
	}
	if err := req.Write(pc.bw); err != nil {
		return fail(err)
	}
	if err := pc.bw.Flush(); err != nil {
		return fail(err)
	}
	resp, err := http.ReadResponse(pc.br, req)
	if err != nil {
		return fail(err)
	}
	resp.Body = &body{rc: resp.Body, t: t, pc: pc, stop: stop, keep: !resp.Close}
	return resp, nil
}

// body is an answer's body; once read to its end it hands the connection
// back for reuse, and closing it early closes the connection.
type body struct {
	rc   io.ReadCloser
	t    *transport
	pc   *pconn
	stop func() bool
	keep bool
	done bool
}

func (b *body) Read(p []byte) (int, error) {
	if b.done {
		return 0, io.EOF
	}
	n, err := b.rc.Read(p)
	if err == io.EOF {
		b.release(true)
	} else if err != nil {
		b.release(false)
	}
	return n, err
}

// Close ends the answer. A small unread rest (a JSON decoder stops before
// the final newline) is drained so the connection can be reused.
func (b *body) Close() error {
	if b.done {
		return nil
	}
	_, err := io.CopyN(io.Discard, b.rc, 4<<10)
	b.release(err == io.EOF)
	return nil
}

func (b *body) release(atEOF bool) {
	if b.done {
		return
	}
	b.done = true
	b.rc.Close()
	// stop is false when the context already fired: the connection's
	// deadline is in the past, it cannot be reused.
	if b.stop() && atEOF && b.keep {
		b.t.put(b.pc)
		return
	}
	b.pc.c.Close()
}
