package main

import (
	"bytes"
	"context"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/client"
	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestDemoTrajectory runs `rewind demo`'s agent trajectory against a
// daemon with the real back ends and checks every assertion it makes:
// files, the persistent shell, the server after restores, and rollouts.
func TestDemoTrajectory(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.Require(t, err == nil, "/dev/fuse")
	_, err = exec.LookPath("python3")
	testenv.Require(t, err == nil, "python3")
	testenv.Require(t, exec.Command("python3", "-c", "import venv, ensurepip").Run() == nil, "python3-venv")

	dir := t.TempDir()
	sock := filepath.Join(dir, "run", "rewind.sock")
	ctx, cancel := context.WithCancel(context.Background())
	ready, done := make(chan struct{}), make(chan error, 1)
	go func() {
		done <- daemon.Run(ctx, daemon.Config{StateDir: filepath.Join(dir, "state"), Socket: sock,
			DefaultPolicy: "effects", Logger: slog.New(slog.DiscardHandler), Ready: func() { close(ready) }})
	}()
	t.Cleanup(func() {
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
	}
	c := client.New(sock)
	defer c.Close()
	var out bytes.Buffer
	d := &demo{c: c, ctx: context.Background(), out: &out, name: "demo-test"}
	err = d.run(2)
	d.cleanup()
	t.Log("\n" + out.String())
	if err != nil {
		t.Fatal(err)
	}
	// The trajectory has read-only and file-only steps: with the probe and
	// the effects policy they must not all be full checkpoints.
	count := map[string]int{}
	for _, r := range d.rows {
		if r.step != "R" {
			count[r.decision]++
		}
	}
	if count["skip"]+count["fs"] < 3 || count["full"] == 0 {
		t.Errorf("decisions %v: want at least 3 skip or fs-only turns and some full ones", count)
	}
	if !strings.Contains(out.String(), "0 problem(s)") {
		t.Errorf("demo reported problems")
	}
}
