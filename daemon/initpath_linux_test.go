package daemon

import (
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// copyFile copies src to dst with mode perm.
func copyFile(t *testing.T, src, dst string, perm os.FileMode) {
	t.Helper()
	in, err := os.Open(src)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	out, err := os.OpenFile(dst, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, perm)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := io.Copy(out, in); err != nil {
		t.Fatal(err)
	}
	if err := out.Close(); err != nil {
		t.Fatal(err)
	}
	if err := os.Chmod(dst, perm); err != nil {
		t.Fatal(err)
	}
}

// TestResolveInit: the init beside the daemon is taken only when it is an
// executable only its owner can write, from the daemon's own build;
// otherwise the daemon runs its own binary, and says why.
func TestResolveInit(t *testing.T) {
	self, err := os.Executable()
	if err != nil {
		t.Fatal(err)
	}
	type initCase struct {
		name    string
		from    string // what rewind-init beside the daemon is a copy of ("": none)
		perm    os.FileMode
		want    string // "beside" or selfInit
		whyPart string
	}
	tests := []initCase{
		{"none", "", 0, selfInit, ""},
		{"same build", self, 0o755, "beside", ""},
		{"writable by others", self, 0o757, selfInit, "writable"},
		{"not executable", self, 0o644, selfInit, "not an executable"},
		{"not a Go binary", "/bin/sh", 0o755, selfInit, "no Go build information"},
	}
	if goTool, err := exec.LookPath("go"); err == nil {
		tests = append(tests, initCase{"another Go build", goTool, 0o755, selfInit, "another build"})
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			exe := filepath.Join(dir, "rewind")
			beside := filepath.Join(dir, InitName)
			if tc.from != "" {
				copyFile(t, tc.from, beside, tc.perm)
			}
			got, why, err := resolveInitBeside("", exe)
			if err != nil {
				t.Fatal(err)
			}
			want := tc.want
			if want == "beside" {
				want = beside
			}
			if got != want || !strings.Contains(why, tc.whyPart) || (tc.whyPart == "") != (why == "") {
				t.Fatalf("init %q (why %q), want %q (why containing %q)", got, why, want, tc.whyPart)
			}
		})
	}
	t.Run("explicit path", func(t *testing.T) {
		if got, _, err := resolveInitBeside(self, ""); err != nil || got != self {
			t.Fatalf("explicit %s: %q, %v", self, got, err)
		}
		if _, _, err := resolveInitBeside("/bin/sh", ""); err == nil {
			t.Fatal("an explicit init from another build was accepted")
		}
		if _, _, err := resolveInitBeside(filepath.Join(t.TempDir(), "missing"), ""); err == nil {
			t.Fatal("a missing explicit init was accepted")
		}
	})
}
