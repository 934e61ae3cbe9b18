package sandbox

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestMain(m *testing.M) {
	MaybeRunInit()
	maybeDirtySignals()
	os.Exit(m.Run())
}

var sandboxSeq atomic.Int64

// requireSandbox skips unless the host can run sandboxes.
func requireSandbox(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat(filepath.Join(DefaultFreezerParent, ".."))
	testenv.Require(t, err == nil, "cgroup v1 freezer at /sys/fs/cgroup/freezer")
	_, err = os.Stat(filepath.Join(DefaultCgroupV2Parent, ".."))
	testenv.Require(t, err == nil, "cgroup v2 at /sys/fs/cgroup/unified")
}

// testRoot builds a minimal root (see MinimalRoot) in a temp dir.
func testRoot(t testing.TB) (string, []Bind) {
	t.Helper()
	root := t.TempDir()
	binds, err := MinimalRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	return root, binds
}

// startTest starts a sandbox on a fresh test root and closes it at cleanup.
func startTest(t testing.TB, mod func(*Config)) *Sandbox {
	t.Helper()
	requireSandbox(t)
	root, binds := testRoot(t)
	cfg := Config{
		ID:    fmt.Sprintf("test-%d-%d", os.Getpid(), sandboxSeq.Add(1)),
		Root:  root,
		Binds: binds,
	}
	if mod != nil {
		mod(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	sb, err := Start(ctx, cfg)
	if err != nil {
		t.Fatalf("Start: %v", err)
	}
	t.Cleanup(func() {
		if err := sb.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	return sb
}

func testCtx(t testing.TB) context.Context {
	ctx, cancel := context.WithTimeout(context.Background(), 60*time.Second)
	t.Cleanup(cancel)
	return ctx
}

// run execs argv and returns stdout, stderr and the exit code.
func run(t testing.TB, sb *Sandbox, argv ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	code, err := sb.Exec(testCtx(t), ExecRequest{Argv: argv, Stdout: &out, Stderr: &errb})
	if err != nil {
		t.Fatalf("Exec %q: %v", argv, err)
	}
	return out.String(), errb.String(), code
}

func sh(t testing.TB, sb *Sandbox, script string) string {
	t.Helper()
	out, errs, code := run(t, sb, "/bin/sh", "-c", script)
	if code != 0 {
		t.Fatalf("sh -c %q: exit %d, stderr %q", script, code, errs)
	}
	return out
}

// waitFor polls cond until it holds or a generous timeout passes.
func waitFor(t testing.TB, what string, cond func() bool) {
	t.Helper()
	deadline := time.Now().Add(30 * time.Second)
	for !cond() {
		if time.Now().After(deadline) {
			t.Fatalf("timed out waiting for %s", what)
		}
		time.Sleep(5 * time.Millisecond)
	}
}

// proc identifies a process across pid reuse (this host's pid_max is
// small): its pid and start time.
type proc struct {
	pid   int
	start string
}

func procOf(pid int) proc {
	return proc{pid, startTime(pid)}
}

func startTime(pid int) string {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return ""
	}
	s := string(b)
	f := strings.Fields(s[strings.LastIndexByte(s, ')')+1:])
	if len(f) < 20 {
		return ""
	}
	return f[19] // starttime
}

// alive reports whether the very process p still exists (zombies count as
// gone).
func alive(p proc) bool {
	if p.start == "" || startTime(p.pid) != p.start {
		return false
	}
	st, err := readProcess(p.pid)
	return err == nil && st.State != "Z"
}
