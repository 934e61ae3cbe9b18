package client

import (
	"context"
	"errors"
	"io"
	"net"
	"net/http"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"
)

// floorServer serves h on a unix socket and counts the connections it
// accepted.
func floorServer(t *testing.T, sock string, h http.HandlerFunc) (*http.Server, *atomic.Int64) {
	t.Helper()
	ln, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	var conns atomic.Int64
	hs := &http.Server{Handler: h, ConnState: func(_ net.Conn, s http.ConnState) {
		if s == http.StateNew {
			conns.Add(1)
		}
	}}
	go hs.Serve(ln)
	t.Cleanup(func() { hs.Close() })
	return hs, &conns
}

func handler(w http.ResponseWriter, r *http.Request) {
	io.Copy(io.Discard, r.Body)
	switch r.URL.Path {
	case "/close":
		w.Header().Set("Connection", "close")
		io.WriteString(w, "closing")
	case "/big":
		io.WriteString(w, strings.Repeat("x", 1<<20))
	case "/stream":
		fl := w.(http.Flusher)
		for i := range 3 {
			io.WriteString(w, strings.Repeat("s", i+1)+"\n")
			fl.Flush()
		}
	case "/hang":
		<-r.Context().Done()
	default:
		io.WriteString(w, "ok:"+r.Method)
	}
}

func get(t *testing.T, c *Client, ctx context.Context, path string, readAll bool) (string, error) {
	t.Helper()
	resp, err := c.send(ctx, "POST", path, map[string]int{"n": 1})
	if err != nil {
		return "", err
	}
	defer resp.Body.Close()
	if !readAll {
		b := make([]byte, 10)
		n, _ := io.ReadFull(resp.Body, b)
		return string(b[:n]), nil
	}
	b, err := io.ReadAll(resp.Body)
	return string(b), err
}

func TestTransport(t *testing.T) {
	for _, tc := range []struct {
		name string
		// first is the first request's path; whether it reads its body
		// to the end.
		first   string
		readAll bool
		// conns is how many connections two calls (first, then "/") took.
		conns int64
		want  string
	}{
		{"kept alive", "/", true, 1, "ok:POST"},
		{"streamed answer read to its end", "/stream", true, 1, "s\nss\nsss\n"},
		{"connection close", "/close", true, 2, "closing"},
		{"body closed early", "/big", false, 2, "xxxxxxxxxx"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sock := filepath.Join(t.TempDir(), "s.sock")
			_, conns := floorServer(t, sock, handler)
			c := New(sock)
			defer c.Close()
			ctx := context.Background()
			got, err := get(t, c, ctx, tc.first, tc.readAll)
			if err != nil || got != tc.want {
				t.Fatalf("first call: %q %v, want %q", got, err, tc.want)
			}
			if got, err := get(t, c, ctx, "/", true); err != nil || got != "ok:POST" {
				t.Fatalf("second call: %q %v", got, err)
			}
			if n := conns.Load(); n != tc.conns {
				t.Fatalf("%d connections, want %d", n, tc.conns)
			}
		})
	}
}

// TestTransportDaemonRestart: a kept-alive connection the daemon closed
// while idle is not reused, and the call goes out once, on a new one.
func TestTransportDaemonRestart(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	var calls atomic.Int64
	count := func(w http.ResponseWriter, r *http.Request) { calls.Add(1); handler(w, r) }
	hs, _ := floorServer(t, sock, count)
	c := New(sock)
	defer c.Close()
	ctx := context.Background()
	if _, err := get(t, c, ctx, "/", true); err != nil {
		t.Fatal(err)
	}
	hs.Close()
	floorServer(t, sock, count)
	if got, err := get(t, c, ctx, "/", true); err != nil || got != "ok:POST" {
		t.Fatalf("after restart: %q %v", got, err)
	}
	if n := calls.Load(); n != 2 {
		t.Fatalf("the handler ran %d times, want 2", n)
	}
}

// TestTransportCancel: cancelling a call in flight returns at once with
// the context's error, and the next call works on a new connection.
func TestTransportCancel(t *testing.T) {
	sock := filepath.Join(t.TempDir(), "s.sock")
	_, conns := floorServer(t, sock, handler)
	c := New(sock)
	defer c.Close()
	ctx, cancel := context.WithCancel(context.Background())
	go func() { time.Sleep(50 * time.Millisecond); cancel() }()
	if _, err := get(t, c, ctx, "/hang", true); !errors.Is(err, context.Canceled) {
		t.Fatalf("cancelled call: %v", err)
	}
	if got, err := get(t, c, context.Background(), "/", true); err != nil || got != "ok:POST" {
		t.Fatalf("after cancel: %q %v", got, err)
	}
	if n := conns.Load(); n != 2 {
		t.Fatalf("%d connections, want 2", n)
	}
}

// TestTransportNoDaemon: nothing listening is ErrNoDaemon.
func TestTransportNoDaemon(t *testing.T) {
	c := New(filepath.Join(t.TempDir(), "none.sock"))
	if _, err := c.Version(context.Background()); !errors.Is(err, ErrNoDaemon) {
		t.Fatalf("no daemon: %v", err)
	}
}
