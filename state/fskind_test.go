package state_test

import (
	"context"
	"testing"

	"github.com/rewind-sandbox/rewind/state"
	"github.com/rewind-sandbox/rewind/state/statefake"
)

// resolvingFS is the fake FS back end that resolves "auto" as a real one
// does at daemon start.
type resolvingFS struct{ *statefake.FS }

func (resolvingFS) ResolveKind(kind string) string {
	if kind == "auto" || kind == "" {
		return "fuse"
	}
	return kind
}

// A sandbox records the backend "auto" resolved to, and its forks keep it.
func TestSandboxRecordsResolvedFSKind(t *testing.T) {
	ctx := context.Background()
	b := statefake.New(nil)
	m, err := state.Open(ctx, state.Config{Dir: t.TempDir(), FS: resolvingFS{b.FS}, Proc: b.Proc, BootID: "boot-1", NoSync: true})
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close(ctx)
	for _, req := range []state.CreateRequest{{Name: "a"}, {Name: "b", FS: "auto"}, {Name: "c", FS: "kernel"}} {
		sb, err := m.Create(ctx, req)
		if err != nil {
			t.Fatal(err)
		}
		want := map[string]string{"a": "fuse", "b": "fuse", "c": "kernel"}[req.Name]
		if sb.FSKind != want {
			t.Errorf("create %s (fs %q): recorded fs %q, want %q", req.Name, req.FS, sb.FSKind, want)
		}
	}
	r, err := m.Turn(ctx, "a", state.TurnRequest{Mode: state.ModeFull, Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	kids, err := m.Fork(ctx, state.ForkRequest{Checkpoint: r.ID, Count: 1})
	if err != nil {
		t.Fatal(err)
	}
	if kids[0].FSKind != "fuse" {
		t.Errorf("fork of a: fs %q, want fuse", kids[0].FSKind)
	}
}
