package daemon_test

import (
	"bufio"
	"context"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
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

// timed runs call b.N times and reports the median and 99th percentile
// of one call next to the mean (ns/op): the machine is shared, and the
// median is what a loaded machine's outliers do not move.
func timed(b *testing.B, call func() error) {
	ds := make([]time.Duration, b.N)
	b.ResetTimer()
	for i := range b.N {
		t := time.Now()
		if err := call(); err != nil {
			b.Fatal(err)
		}
		ds[i] = time.Since(t)
	}
	b.StopTimer()
	slices.Sort(ds)
	b.ReportMetric(float64(ds[len(ds)/2].Microseconds()), "p50-us")
	b.ReportMetric(float64(ds[len(ds)*99/100].Microseconds()), "p99-us")
}

func turnSkipLoop(b *testing.B, c *client.Client) {
	ctx := context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); err != nil {
		b.Fatal(err)
	}
	if _, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true}); err != nil {
		b.Fatal(err)
	}
	timed(b, func() error {
		_, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "skip"})
		return err
	})
}

func versionLoop(b *testing.B, c *client.Client) {
	ctx := context.Background()
	timed(b, func() error {
		_, err := c.Version(ctx)
		return err
	})
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

// BenchmarkLatencyFloorRawHTTPProc is package client against a hand-made
// HTTP/1.1 loop in another process: what net/http's server costs.
func BenchmarkLatencyFloorRawHTTPProc(b *testing.B) {
	sock := spawnFloor(b, "rawhttp")
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
	timed(b, func() error {
		if _, err := c.Write(buf); err != nil {
			return err
		}
		_, err := io.ReadFull(c, buf)
		return err
	})
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
	if kind == "rawhttp" {
		// One goroutine per connection that parses requests and writes a
		// constant answer itself: net/http's server without its
		// per-request machinery (the background reader among it).
		for {
			s, err := ln.Accept()
			if err != nil {
				return err
			}
			go func() {
				defer s.Close()
				br, bw := bufio.NewReader(s), bufio.NewWriter(s)
				const body = `{"version":"floor"}`
				for {
					req, err := http.ReadRequest(br)
					if err != nil {
						return
					}
					io.Copy(io.Discard, req.Body)
					fmt.Fprintf(bw, "HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s", len(body), body)
					if bw.Flush() != nil {
						return
					}
				}
			}()
		}
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

// stepLoop times one tree-search step on a fake-back-end daemon in another
// process — back to the root checkpoint, run a command in the session, end
// the turn — as three calls (oneCall false) or as one send carrying the
// restore and the turn.
func stepLoop(b *testing.B, oneCall bool) {
	dir := b.TempDir()
	_, c := spawnDaemon(b, filepath.Join(dir, "state"), filepath.Join(dir, "s.sock"), "fake")
	defer c.Close()
	ctx := context.Background()
	if _, err := c.Create(ctx, api.CreateRequest{Name: "a"}); err != nil {
		b.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "a", api.SessionRequest{ID: "sh", Argv: []string{"bash"}}); err != nil {
		b.Fatal(err)
	}
	root, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		b.Fatal(err)
	}
	send := api.SendRequest{Text: "echo x", Until: "x\n"}
	timed(b, func() error {
		if oneCall {
			req := send
			req.Restore, req.Turn = root.ID, &api.TurnRequest{Mode: "skip"}
			_, err := c.Step(ctx, "a", "sh", req)
			return err
		}
		if _, err := c.Restore(ctx, "a", root.ID, 0); err != nil {
			return err
		}
		if _, err := c.Send(ctx, "a", "sh", send); err != nil {
			return err
		}
		_, err := c.Turn(ctx, "a", api.TurnRequest{Mode: "skip"})
		return err
	})
}

// BenchmarkLatencyStepThreeCallsProc is a step as restore, send and turn.
func BenchmarkLatencyStepThreeCallsProc(b *testing.B) { stepLoop(b, false) }

// BenchmarkLatencyStepOneCallProc is the same step as one send.
func BenchmarkLatencyStepOneCallProc(b *testing.B) { stepLoop(b, true) }
