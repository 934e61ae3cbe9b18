package daemon_test

import (
	"context"
	"os"
	"path/filepath"
	"sort"
	"testing"

	"github.com/rewind-sandbox/rewind/api"
)

// imageDirs lists <sandbox>/<checkpoint> under a state dir's images dir,
// and <sandbox>/ for a sandbox's directory that holds none.
func imageDirs(t *testing.T, images string) []string {
	t.Helper()
	var out []string
	sbs, err := os.ReadDir(images)
	if err != nil && !os.IsNotExist(err) {
		t.Fatal(err)
	}
	for _, sb := range sbs {
		cks, _ := os.ReadDir(filepath.Join(images, sb.Name()))
		if len(cks) == 0 {
			out = append(out, sb.Name()+"/")
		}
		for _, ck := range cks {
			out = append(out, sb.Name()+"/"+ck.Name())
		}
	}
	sort.Strings(out)
	return out
}

// TestRealImagesSwept: process image directories no checkpoint uses go,
// and those of durable checkpoints stay. The failed CRIU dumps of a
// process holding SysV shared memory (its directories hold criu's logs)
// go with the next GC once their sandbox is removed, with the sandbox's
// directory; image directories a daemon killed in a dump or in a GC left
// (no record, no complete image) go when the next daemon starts. The
// durable checkpoint's image stays and restores after the restart.
func TestRealImagesSwept(t *testing.T) {
	dir := t.TempDir()
	images := filepath.Join(dir, "state", "images")
	d := startReal(t, dir)
	c, ctx := d.c, context.Background()

	bad, err := c.Create(ctx, api.CreateRequest{Name: "bad"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "bad", api.SessionRequest{ID: "py", Argv: []string{"python3", "-q", "-u", "-i"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "bad", "py", `import ctypes; libc = ctypes.CDLL(None); libc.shmat.restype = ctypes.c_void_p; a = libc.shmat(libc.shmget(0, 1 << 20, 0o1600), None, 0); print("@@done@@")`)
	if _, err := c.Turn(ctx, "bad", api.TurnRequest{Mode: "full", Wait: true}); err == nil {
		t.Fatal("a full checkpoint of a process holding SysV shared memory succeeded: the test needs a failing dump")
	}
	failed := 0
	for _, p := range imageDirs(t, images) {
		if filepath.Dir(p) == bad.ID {
			failed++
		}
	}
	if failed == 0 {
		t.Fatalf("no image dir of the failed dumps under %s: %q", images, imageDirs(t, images))
	}

	good, err := c.Create(ctx, api.CreateRequest{Name: "good"})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := c.StartSession(ctx, "good", api.SessionRequest{ID: "sh", Argv: []string{"bash", "--norc"}}); err != nil {
		t.Fatal(err)
	}
	send(t, c, "good", "sh", "export V=kept; echo @@done@@")
	ck, err := c.Turn(ctx, "good", api.TurnRequest{Mode: "full", Wait: true})
	if err != nil {
		t.Fatal(err)
	}
	goodDirs := func() []string {
		var out []string
		for _, p := range imageDirs(t, images) {
			if filepath.Dir(p) == good.ID {
				out = append(out, p)
			}
		}
		return out
	}
	kept := goodDirs()
	if len(kept) != 1 {
		t.Fatalf("image dirs of the durable checkpoint: %q", kept)
	}
	if _, err := os.Stat(filepath.Join(images, kept[0], "checkpoint.json")); err != nil {
		t.Fatal(err)
	}

	if err := c.Remove(ctx, "bad"); err != nil {
		t.Fatal(err)
	}
	if res, err := c.GC(ctx, false); err != nil || len(res.Errors) > 0 {
		t.Fatalf("gc: %+v %v", res, err)
	}
	if got := imageDirs(t, images); len(got) != 1 || got[0] != kept[0] {
		t.Fatalf("image dirs after rm and gc: %q, want only %q", got, kept)
	}

	// What a daemon killed in a dump (no metadata, no record) or in a
	// GC's removal left.
	d.stop()
	for _, f := range []string{"sb-gone/p-cut/0/pages-1.img", filepath.Join(good.ID, "p-halfgone", "0", "pages-1.img")} {
		p := filepath.Join(images, f)
		if err := os.MkdirAll(filepath.Dir(p), 0o700); err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(p, make([]byte, 64<<10), 0o600); err != nil {
			t.Fatal(err)
		}
	}
	d = startReal(t, dir)
	c = d.c
	if got := imageDirs(t, images); len(got) != 1 || got[0] != kept[0] {
		t.Fatalf("image dirs after a restart: %q, want only %q", got, kept)
	}
	if _, err := c.Restore(ctx, "good", ck.ID, 0); err != nil {
		t.Fatalf("restore of the durable checkpoint after the restart: %v", err)
	}
	if got := send(t, c, "good", "sh", "echo $V @@done@@"); got != "kept" {
		t.Fatalf("restored shell: V=%q", got)
	}
}
