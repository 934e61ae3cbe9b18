package main

import (
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
)

// TestAutostartKeepsStateDir: with no daemon on a socket whose last daemon
// used another state dir than $REWIND_STATE, the CLI starts none (it would
// not know the last one's sandboxes) and says how to start the right one.
func TestAutostartKeepsStateDir(t *testing.T) {
	dir := t.TempDir()
	sock := filepath.Join(dir, "rewind.sock")
	last := filepath.Join(dir, "stateA")
	if err := os.Mkdir(last, 0o700); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(api.StateRecord(sock), []byte(last+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	other := filepath.Join(dir, "stateB")
	t.Setenv("REWIND_STATE", other)
	pid, _, err := startDaemon(sock)
	if err == nil {
		t.Fatalf("a daemon (pid %d) was started on %s, not the last one's %s", pid, other, last)
	}
	for _, want := range []string{last, "--state " + last, api.StateRecord(sock)} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not name %q", err, want)
		}
	}
	if _, err := os.Stat(other); !os.IsNotExist(err) {
		t.Errorf("the refused state dir %s was made (%v)", other, err)
	}
}
