package state_test

import (
	"context"
	"errors"
	"os"
	"path/filepath"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// TestCreateRefusesHiddenBases: a base that would show a sandbox the
// daemon's hidden state (the state dir itself, a directory inside it, one
// holding it, or a symbolic link to one of those) is refused; the host's
// root and directories beside the state dir are not.
func TestCreateRefusesHiddenBases(t *testing.T) {
	top := t.TempDir()
	stateDir := filepath.Join(top, "lib", "rewind")
	beside := filepath.Join(top, "lib", "other")
	for _, d := range []string{filepath.Join(stateDir, "images"), beside} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	link := filepath.Join(top, "link")
	if err := os.Symlink(stateDir, link); err != nil {
		t.Fatal(err)
	}
	b := statefake.New(nil)
	ctx := context.Background()
	m, err := state.Open(ctx, state.Config{Dir: t.TempDir(), FS: b.FS, Proc: b.Proc, BootID: "boot-1", NoSync: true, Hide: []string{stateDir}})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(ctx)
	for i, tc := range []struct {
		base string
		ok   bool
	}{
		{stateDir, false},
		{filepath.Join(stateDir, "images"), false},
		{filepath.Join(top, "lib"), false},
		{top, false},
		{link, false},
		{stateDir + "/../rewind", false},
		{beside, true},
		{"/", true},
	} {
		_, err := m.Create(ctx, state.CreateRequest{Name: "s" + string(rune('a'+i)), Bases: []string{tc.base}})
		if tc.ok && err != nil {
			t.Errorf("base %s: %v, want it accepted", tc.base, err)
		}
		if !tc.ok && !errors.Is(err, state.ErrBadRequest) {
			t.Errorf("base %s: %v, want a bad request", tc.base, err)
		}
	}
}
