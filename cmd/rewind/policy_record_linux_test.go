package main

import (
	"bytes"
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/policy"
)

// startRealDaemon runs a daemon with the real back ends (probe and WASM
// policy host included) on a private state directory.
func startRealDaemon(t *testing.T) *client.Client {
	t.Helper()
	c, _ := startRealDaemonAt(t)
	return c
}

// startRealDaemonAt is startRealDaemon that also returns the socket.
func startRealDaemonAt(t *testing.T) (*client.Client, string) {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.Require(t, err == nil, "/dev/fuse")
	dir := t.TempDir()
	sock := filepath.Join(dir, "run", "rewind.sock")
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() {
		done <- daemon.Run(ctx, daemon.Config{StateDir: filepath.Join(dir, "state"), Socket: sock,
			DefaultPolicy: "effects", Logger: slog.New(slog.DiscardHandler), Ready: func() { close(ready) }})
	}()
	c := client.New(sock)
	t.Cleanup(func() {
		c.Close()
		cancel()
		select {
		case <-done:
		case <-time.After(60 * time.Second):
			t.Error("daemon did not stop")
		}
	})
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("daemon: %v", err)
	case <-time.After(60 * time.Second):
		t.Fatal("daemon did not start")
	}
	return c, sock
}

// TestPolicyRecordReplaysDaemonDecisions drives a real sandbox through
// turns of every kind, records them with `rewind policy record`, and replays
// the recording with `rewind policy test effects`: the built-in policy run
// offline must take exactly the decisions (mode and reason) the daemon took.
func TestPolicyRecordReplaysDaemonDecisions(t *testing.T) {
	c := startRealDaemon(t)
	ctx := context.Background()
	const name = "rec"
	if _, err := c.Create(ctx, api.CreateRequest{Name: name}); err != nil {
		t.Fatal(err)
	}
	dir := t.TempDir()
	// --follow runs alongside and must see the same turns.
	fctx, stopFollow := context.WithCancel(ctx)
	followed := filepath.Join(dir, "followed.jsonl")
	followDone := make(chan error, 1)
	go func() {
		followDone <- runPolicyRecord(fctx, c, &bytes.Buffer{}, &bytes.Buffer{}, name,
			policyRecordOpts{out: followed, follow: true, poll: 2 * time.Second})
	}()

	shell := func(script string) {
		t.Helper()
		var out bytes.Buffer
		code, err := c.Exec(ctx, name, api.ExecRequest{Argv: []string{"sh", "-c", script}}, &out, &out)
		if err != nil || code != 0 {
			t.Fatalf("exec %q: %d %v %s", script, code, err, out.String())
		}
	}
	steps := []func(){
		func() { shell("mkdir -p /work && echo one > /work/a") },
		func() { shell("cat /work/a >/dev/null; ls / >/dev/null") },
		func() { shell("echo two >> /work/a && rm -f /work/a && echo b > /work/b") },
		func() {
			if _, err := c.StartSession(ctx, name, api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc"}}); err != nil {
				t.Fatal(err)
			}
		},
		func() {
			if _, err := c.Send(ctx, name, "sh", api.SendRequest{Text: "cd /work; X=1; echo @@done@@", Until: "@@done@@", TimeoutMS: 30000}); err != nil {
				t.Fatal(err)
			}
		},
		func() { shell("true") },
		func() { shell("grep -r one /work >/dev/null || true") },
	}
	var want []string // the decisions the daemon answered, by turn
	for _, step := range steps {
		step()
		res, err := c.Turn(ctx, name, api.TurnRequest{Mode: "auto"})
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, string(res.Decision))
	}
	t.Logf("daemon's decisions: %v", want)

	reports, expect := filepath.Join(dir, "reports.jsonl"), filepath.Join(dir, "expect.jsonl")
	var errOut bytes.Buffer
	if err := runPolicyRecord(ctx, c, &bytes.Buffer{}, &errOut, name, policyRecordOpts{out: reports, expect: expect}); err != nil {
		t.Fatal(err)
	}
	t.Log(strings.TrimSpace(errOut.String()))
	reps := readFileJSONL(t, reports, policy.ReadReports)
	exps := readFileJSONL(t, expect, policy.ReadExpectations)
	if len(reps) != len(steps) {
		t.Fatalf("recorded %d reports of %d turns", len(reps), len(steps))
	}
	modes := map[policy.Mode]int{}
	for _, e := range exps {
		modes[e.Mode]++
		if e.Reason == "" {
			t.Errorf("turn %d: the expectation has no reason", e.Turn)
		}
	}
	// A policy failure (a missed deadline on a loaded host) leaves its turn
	// out of the expectations; the rest must still cover every mode.
	if len(exps) < len(steps)-1 || modes[policy.Skip] == 0 || modes[policy.FS] == 0 || modes[policy.Full] == 0 {
		t.Fatalf("%d decisions recorded for %d turns, modes %v: want skip, fs and full", len(exps), len(steps), modes)
	}

	var out, sum bytes.Buffer
	err := runPolicyTest(ctx, &out, &sum, "effects", policyTestOpts{reports: reports, expect: expect, timeout: 5 * time.Second, memory: policy.DefaultMemoryLimit})
	t.Logf("rewind policy test:\n%s%s", out.String(), sum.String())
	if err != nil {
		t.Fatalf("offline decisions differ from the daemon's: %v", err)
	}
	if !strings.Contains(sum.String(), "0 differences") {
		t.Fatalf("summary: %s", sum.String())
	}

	// The follower saw every turn too.
	deadline := time.Now().Add(30 * time.Second)
	for {
		b, _ := os.ReadFile(followed)
		if n := bytes.Count(b, []byte("\n")); n >= len(steps) || time.Now().After(deadline) {
			break
		}
		time.Sleep(20 * time.Millisecond)
	}
	stopFollow()
	if err := <-followDone; err != nil {
		t.Fatalf("--follow: %v", err)
	}
	fl := readFileJSONL(t, followed, policy.ReadReports)
	if len(fl) != len(reps) {
		t.Fatalf("--follow wrote %d reports, want %d", len(fl), len(reps))
	}
	for i := range fl {
		if fl[i].Turn != reps[i].Turn || fl[i].Sandbox != reps[i].Sandbox {
			t.Errorf("--follow report %d: turn %d, want %d", i, fl[i].Turn, reps[i].Turn)
		}
	}
}

func readFileJSONL[T any](t *testing.T, path string, read func(r io.Reader) ([]T, error)) []T {
	t.Helper()
	v, err := readJSONL(path, read)
	if err != nil {
		t.Fatal(err)
	}
	return v
}
