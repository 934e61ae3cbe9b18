package daemon

import (
	"context"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/api"
)

// TestSocketInSharedDir runs a daemon whose socket lies in a shared,
// sticky, world-writable directory (as /tmp is): the directory keeps its
// mode, the socket is 0600, a link planted at the state record's name is
// replaced rather than followed, and sandboxes are kept from the socket
// and its record only, not from the whole directory.
func TestSocketInSharedDir(t *testing.T) {
	root := t.TempDir()
	shared := filepath.Join(root, "shared")
	if err := os.Mkdir(shared, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(shared, os.ModePerm|os.ModeSticky); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(shared, "rw.sock")
	victim := filepath.Join(root, "victim")
	if err := os.WriteFile(victim, []byte("keep\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if err := os.Symlink(victim, api.StateRecord(sock)); err != nil {
		t.Fatal(err)
	}
	stateDir := filepath.Join(root, "state")
	cfg := Config{StateDir: stateDir, Socket: sock, Backend: "fake", Logger: slog.New(slog.DiscardHandler)}
	if h := hidden(cfg); !slices.Equal(h, []string{stateDir, sock, api.StateRecord(sock)}) {
		t.Errorf("hidden = %q, want the state dir, the socket and its record", h)
	}

	ctx, cancel := context.WithCancel(context.Background())
	ready := make(chan struct{})
	done := make(chan error, 1)
	cfg.Ready = func() { close(ready) }
	go func() { done <- Run(ctx, cfg) }()
	select {
	case <-ready:
	case err := <-done:
		t.Fatalf("daemon: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("daemon did not start")
	}
	st, err := os.Stat(shared)
	if err != nil {
		t.Fatal(err)
	}
	if got := st.Mode() & (os.ModePerm | os.ModeSticky); got != os.ModePerm|os.ModeSticky {
		t.Errorf("shared dir mode %v after start, want drwxrwxrwt", st.Mode())
	}
	if st, err := os.Stat(sock); err != nil || st.Mode().Perm() != 0o600 {
		t.Errorf("socket: %v, mode %v; want 0600", err, st.Mode().Perm())
	}
	if b, err := os.ReadFile(victim); err != nil || string(b) != "keep\n" {
		t.Errorf("the planted link was followed: %q, %v", b, err)
	}
	if st, err := os.Lstat(api.StateRecord(sock)); err != nil || !st.Mode().IsRegular() {
		t.Errorf("state record: %v, %v; want a regular file", err, st)
	} else if b, _ := os.ReadFile(api.StateRecord(sock)); string(b) != stateDir+"\n" {
		t.Errorf("state record holds %q, want %q", b, stateDir+"\n")
	}
	cancel()
	if err := <-done; err != nil {
		t.Fatalf("daemon: %v", err)
	}
	if st, err := os.Stat(shared); err != nil || st.Mode()&(os.ModePerm|os.ModeSticky) != os.ModePerm|os.ModeSticky {
		t.Errorf("shared dir after stop: %v, %v", st.Mode(), err)
	}
}

// TestHiddenOwnSocketDir: a socket directory that does not exist yet, or
// is the daemon's own (0700), is hidden whole; /run/rewind is each
// sandbox's own tmpfs and needs nothing.
func TestHiddenOwnSocketDir(t *testing.T) {
	root := t.TempDir()
	own := filepath.Join(root, "own")
	if err := os.Mkdir(own, 0o700); err != nil {
		t.Fatal(err)
	}
	open := filepath.Join(root, "open")
	if err := os.Mkdir(open, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, tc := range []struct {
		socket string
		want   []string
	}{
		{filepath.Join(root, "missing", "s.sock"), []string{"S", filepath.Join(root, "missing")}},
		{filepath.Join(own, "s.sock"), []string{"S", own}},
		{filepath.Join(open, "s.sock"), []string{"S", filepath.Join(open, "s.sock"), filepath.Join(open, "s.sock.state")}},
		{"/run/rewind/rewind.sock", []string{"S"}},
	} {
		got := hidden(Config{StateDir: "S", Socket: tc.socket})
		if !slices.Equal(got, tc.want) {
			t.Errorf("socket %s: hidden %q, want %q", tc.socket, got, tc.want)
		}
	}
}
