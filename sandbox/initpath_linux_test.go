package sandbox

import (
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestInitPaths runs the init both ways it can drop privileges: in place on
// every thread (a binary without cgo) and by re-executing itself (with
// cgo), and checks that no thread of PID 1 keeps a capability the
// sandbox's processes lack.
func TestInitPaths(t *testing.T) {
	requireSandbox(t)
	self := stageFirst
	if _, _, e := syscall.AllThreadsSyscall(syscall.SYS_GETPID, 0, 0, 0); e == syscall.ENOTSUP {
		self = stageReexeced
	}
	goTool, err := exec.LookPath("go")
	testenv.Require(t, err == nil, "the go tool (to build a cgo-free init)")
	bin := filepath.Join(t.TempDir(), "rewind-init")
	build := exec.Command(goTool, "build", "-o", bin, "../cmd/rewind-init")
	build.Env = append(os.Environ(), "CGO_ENABLED=0")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("build cgo-free init: %v\n%s", err, out)
	}
	for _, tc := range []struct {
		name, initPath, stage string
	}{
		{"test binary", "", self},
		{"cgo-free", bin, stageFirst},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sb := startTest(t, func(c *Config) { c.InitPath = tc.initPath })
			env := sh(t, sb, "tr '\\0' '\\n' < /proc/1/environ | grep "+initEnv)
			if env != initEnv+"="+tc.stage+"\n" {
				t.Fatalf("init stage %q, want %s", env, tc.stage)
			}
			caps := sh(t, sb, "grep -h -E 'Cap(Eff|Prm|Bnd)' /proc/1/task/*/status /proc/self/status | cut -f2 | sort -u")
			if strings.Count(caps, "\n") != 1 || caps == "000001ffffffffff\n" || caps == "000001fffeffffff\n" {
				t.Fatalf("capabilities of init threads and sandbox processes: %q", caps)
			}
			// rewind-init holds no descriptor of the host's cgroup files
			// (the Go runtime's CPU-limit reads; see cmd/rewind-init),
			// which a sandbox process could reopen through /proc/1/fd.
			if tc.initPath != "" {
				if fds := sh(t, sb, "ls -l /proc/1/fd | grep -c -E 'cgroup|cpu[.]' || true"); fds != "0\n" {
					t.Errorf("the init holds cgroup files: %s", sh(t, sb, "ls -l /proc/1/fd"))
				}
			}
		})
	}
}
