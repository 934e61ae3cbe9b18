package daemon_test

import (
	"context"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
)

// The benchmarks below measure what one API call costs a harness, next to
// the floors of the transport, in the same run:
//
//	go test -run '^$' -bench Latency -benchtime 5000x ./daemon/
//
// The Proc variants put the server in another process (the test binary run
// again), as the daemon is for a real harness: cross-process wake-ups are
// where a unix-socket round trip spends most of its time on a VM.

func turnSkipLoop(b *testing.B, c *client.Client) {
	ctx := context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); err != nil {
		b.Fatal(err)
	}
	if _, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true}); err != nil {
		b.Fatal(err)
	}
	b.ResetTimer()
	for range b.N {
		if _, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "skip"}); err != nil {
			b.Fatal(err)
		}
	}
}

func versionLoop(b *testing.B, c *client.Client) {
	ctx := context.Background()
	b.ResetTimer()
	for range b.N {
		if _, err := c.Version(ctx); err != nil {
			b.Fatal(err)
		}
	}
}

// BenchmarkLatencyTurnSkip is one turn call (mode skip) through a daemon
// with fake back ends in this process, as client.Turn sees it.
func BenchmarkLatencyTurnSkip(b *testing.B) {
	c, _ := startFake(b)
	turnSkipLoop(b, c)
}

// BenchmarkLatencyTurnSkipProc is BenchmarkLatencyTurnSkip with the daemon
// in another process.
func BenchmarkLatencyTurnSkipProc(b *testing.B) {
	dir := b.TempDir()
	_, c := spawnDaemon(b, filepath.Join(dir, "state"), filepath.Join(dir, "s.sock"), "fake")
	defer c.Close()
	turnSkipLoop(b, c)
}

// BenchmarkLatencyVersion is the cheapest daemon call (GET /v1/version).
func BenchmarkLatencyVersion(b *testing.B) {
	c, _ := startFake(b)
	versionLoop(b, c)
}

// BenchmarkLatencyFloorHTTP is package client against a bare net/http
// server (in this process) whose handler writes a constant.
func BenchmarkLatencyFloorHTTP(b *testing.B) {
	sock := filepath.Join(b.TempDir(), "s.sock")
	go serveFloor(sock, "http")
	c := client.New(sock)
	defer c.Close()
	waitUp(b, func() error { _, err := c.Version(context.Background()); return err })
	versionLoop(b, c)
}

// BenchmarkLatencyFloorHTTPProc is BenchmarkLatencyFloorHTTP with the
// server in another process.
func BenchmarkLatencyFloorHTTPProc(b *testing.B) {
	sock := spawnFloor(b, "http")
	c := client.New(sock)
	defer c.Close()
	waitUp(b, func() error { _, err := c.Version(context.Background()); return err })
	versionLoop(b, c)
}

// BenchmarkLatencyFloorSocket is one 64-byte ping-pong on a unix socket
// with an echo goroutine: the floor under any protocol.
func BenchmarkLatencyFloorSocket(b *testing.B) {
	sock := filepath.Join(b.TempDir(), "s.sock")
	go serveFloor(sock, "echo")
	pingPong(b, sock)
}

// BenchmarkLatencyFloorSocketProc is BenchmarkLatencyFloorSocket with the
// echo server in another process.
func BenchmarkLatencyFloorSocketProc(b *testing.B) {
	pingPong(b, spawnFloor(b, "echo"))
}

func pingPong(b *testing.B, sock string) {
	var c net.Conn
	waitUp(b, func() (err error) { c, err = net.Dial("unix", sock); return err })
	defer c.Close()
	buf := make([]byte, 64)
	b.ResetTimer()
	for range b.N {
		if _, err := c.Write(buf); err != nil {
			b.Fatal(err)
		}
		if _, err := io.ReadFull(c, buf); err != nil {
			b.Fatal(err)
		}
	}
}

func waitUp(b *testing.B, try func() error) {
	deadline := time.Now().Add(30 * time.Second)
	for {
		err := try()
		if err == nil {
			return
		}
		if time.Now().After(deadline) {
			b.Fatalf("floor server did not come up: %v", err)
		}
		time.Sleep(10 * time.Millisecond)
	}
}

// spawnFloor runs serveFloor in another process and returns its socket.
func spawnFloor(b *testing.B, kind string) string {
	sock := filepath.Join(b.TempDir(), "s.sock")
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), "REWIND_TEST_FLOOR_SOCKET="+sock, "REWIND_TEST_FLOOR_KIND="+kind)
	cmd.Stderr = os.Stderr
	if err := cmd.Start(); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	return sock
}

// serveFloor serves a trivial server on sock: "http" answers every request
// with a constant JSON body, "echo" echoes 64-byte messages.
func serveFloor(sock, kind string) error {
	ln, err := net.Listen("unix", sock)
	if err != nil {
		return err
	}
	if kind == "http" {
		return http.Serve(ln, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
			io.Copy(io.Discard, r.Body)
			w.Header().Set("Content-Type", "application/json")
			io.WriteString(w, `{"version":"floor"}`)
		}))
	}
	for {
		s, err := ln.Accept()
		if err != nil {
			return err
		}
		go func() {
			defer s.Close()
			buf := make([]byte, 64)
			for {
				if _, err := io.ReadFull(s, buf); err != nil {
					return
				}
				if _, err := s.Write(buf); err != nil {
					return
				}
			}
		}()
	}
}
