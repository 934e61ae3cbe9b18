package main

import (
	"bytes"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"github.com/rewind-sandbox/rewind/compat"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

var (
	buildOnce sync.Once
	binDir    string // the temp dir rewindBinary builds into; TestMain removes it
	binPath   string
	buildErr  error
)

func TestMain(m *testing.M) {
	code := m.Run()
	if binDir != "" {
		os.RemoveAll(binDir)
	}
	os.Exit(code)
}

// rewindBinary builds the rewind command once per test run.
func rewindBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "rewind-cli-test-")
		if err != nil {
			buildErr = err
			return
		}
		binDir = dir
		binPath = filepath.Join(dir, "rewind")
		out, err := exec.Command("go", "build", "-o", binPath, ".").CombinedOutput()
		if err != nil {
			buildErr = err
			binPath = string(out)
		}
	})
	if buildErr != nil {
		t.Fatalf("go build: %v\n%s", buildErr, binPath)
	}
	return binPath
}

func TestDoctorJSON(t *testing.T) {
	bin := rewindBinary(t)
	out, err := exec.Command(bin, "doctor", "--json", "--state", t.TempDir()).Output()
	if err != nil {
		t.Fatalf("rewind doctor --json: %v", err)
	}
	var r compat.Report
	if err := json.Unmarshal(out, &r); err != nil {
		t.Fatalf("doctor output is not a JSON report: %v\n%s", err, out)
	}
	groups := map[string]bool{}
	for _, c := range r.Checks {
		groups[c.Group] = true
		if c.Status != compat.OK && c.Status != compat.Missing && c.Status != compat.Degraded {
			t.Errorf("%s/%s has status %q", c.Group, c.Name, c.Status)
		}
		if c.Detail == "" {
			t.Errorf("%s/%s has no detail", c.Group, c.Name)
		}
	}
	for _, g := range []string{"kernel", "fuse", "overlayfs", "statedir", "ebpf", "criu"} {
		if !groups[g] {
			t.Errorf("doctor reported no %s checks", g)
		}
	}
	for _, ch := range []compat.Choice{r.Chosen.FS, r.Chosen.CR, r.Chosen.Probe} {
		if ch.Backend == "" || ch.Reason == "" {
			t.Errorf("a chosen backend lacks a name or reason: %+v", r.Chosen)
		}
	}
	// This machine kind has every capability below: under CI a missing one
	// means the install steps (make deps) are broken.
	testenv.RequireRoot(t)
	for _, need := range []string{
		"fuse/mount", "overlayfs/mount", "statedir/xfs-reflink-loop",
		"ebpf/tracepoints", "ebpf/raw-tracepoints", "criu/version", "criu/check",
	} {
		g, n, _ := strings.Cut(need, "/")
		c, _ := r.Get(g, n)
		testenv.Require(t, c.Status == compat.OK, need+" ok (got "+string(c.Status)+": "+c.Detail+")")
	}
}

// TestDoctorTable runs doctor with the state dir given by $REWIND_STATE
// (as the daemon and init-store take it too), which it must probe instead
// of the default.
func TestDoctorTable(t *testing.T) {
	bin := rewindBinary(t)
	dir := t.TempDir()
	cmd := exec.Command(bin, "doctor", "--no-loop")
	cmd.Env = append(os.Environ(), "REWIND_STATE="+dir)
	out, err := cmd.Output()
	if err != nil {
		t.Fatalf("rewind doctor: %v", err)
	}
	for _, want := range []string{"CAPABILITY", "fuse/mount", "criu/check", "chosen: fs = ", "cr = ", "probe = ", "state dir " + dir + " "} {
		if !bytes.Contains(out, []byte(want)) {
			t.Errorf("doctor table lacks %q:\n%s", want, out)
		}
	}
}

func TestBadInput(t *testing.T) {
	bin := rewindBinary(t)
	tests := []struct {
		args []string
		want string
	}{
		{[]string{"doctor", "--no-such-flag"}, "unknown flag"},
		{[]string{"no-such-command"}, "unknown command"},
		{[]string{"version", "extra"}, "unknown command"},
	}
	for _, tt := range tests {
		cmd := exec.Command(bin, tt.args...)
		var stderr bytes.Buffer
		cmd.Stderr = &stderr
		err := cmd.Run()
		if err == nil {
			t.Errorf("rewind %v succeeded, want a non-zero exit", tt.args)
			continue
		}
		msg := strings.TrimSpace(stderr.String())
		if !strings.Contains(msg, tt.want) || strings.Contains(msg, "goroutine") || strings.Count(msg, "\n") > 0 {
			t.Errorf("rewind %v: stderr = %q, want one line containing %q", tt.args, msg, tt.want)
		}
	}
}

// TestVersionJSON: `rewind version --json` prints the version, the Go
// version and the API version as JSON, like every command's --json.
func TestVersionJSON(t *testing.T) {
	out, err := exec.Command(rewindBinary(t), "version", "--json").Output()
	if err != nil {
		t.Fatalf("rewind version --json: %v", err)
	}
	var v map[string]string
	if err := json.Unmarshal(out, &v); err != nil || v["version"] == "" || !strings.HasPrefix(v["go"], "go") || v["api"] == "" {
		t.Fatalf("version --json: %q (%v)", out, err)
	}
}
