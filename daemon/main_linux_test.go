package daemon_test

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/signal"
	"syscall"
	"testing"

	"github.com/rewind-sandbox/rewind/daemon"
	"github.com/rewind-sandbox/rewind/sandbox"
)

func TestMain(m *testing.M) {
	sandbox.MaybeRunInit()
	if dir := os.Getenv("REWIND_TEST_DAEMON_STATE"); dir != "" {
		// This process is a daemon started by a test (crash recovery).
		ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM)
		defer stop()
		err := daemon.Run(ctx, daemon.Config{
			StateDir: dir, Socket: os.Getenv("REWIND_TEST_DAEMON_SOCKET"), Backend: os.Getenv("REWIND_TEST_DAEMON_BACKEND"),
			Logger: slog.New(slog.NewTextHandler(os.Stderr, nil)),
		})
		if err != nil {
			fmt.Fprintln(os.Stderr, "daemon:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	if sock := os.Getenv("REWIND_TEST_FLOOR_SOCKET"); sock != "" {
		// This process is the trivial server of a latency floor benchmark.
		if err := serveFloor(sock, os.Getenv("REWIND_TEST_FLOOR_KIND")); err != nil {
			fmt.Fprintln(os.Stderr, "floor server:", err)
			os.Exit(1)
		}
		os.Exit(0)
	}
	os.Exit(m.Run())
}
