package main

import (
	"bytes"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func runRoot(t *testing.T, args ...string) (string, error) {
	t.Helper()
	root := newRootCmd()
	var out bytes.Buffer
	root.SetOut(&out)
	root.SetErr(&out)
	root.SetArgs(args)
	err := root.Execute()
	return out.String(), err
}

func TestProbeWatch(t *testing.T) {
	testenv.RequireRoot(t)
	b := make([]byte, 6)
	rand.Read(b)
	cg := filepath.Join("/sys/fs/cgroup/unified", "rewind-clitest-"+hex.EncodeToString(b))
	testenv.RequireNoErr(t, os.Mkdir(cg, 0o755), "cgroup v2 at /sys/fs/cgroup/unified")
	fd, err := syscall.Open(cg, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	sleep := exec.Command("sleep", "60")
	sleep.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	if err := sleep.Start(); err != nil {
		t.Fatal(err)
	}
	syscall.Close(fd)
	t.Cleanup(func() {
		sleep.Process.Kill()
		sleep.Wait()
		for i := 0; i < 500 && os.Remove(cg) != nil; i++ {
			time.Sleep(10 * time.Millisecond)
		}
	})
	for _, backend := range []string{"userspace", "ebpf"} {
		out, err := runRoot(t, "probe", "watch", "--cgroup", cg, "--backend", backend, "--every", "20ms", "--count", "2", "--dir", t.TempDir())
		if err != nil {
			t.Fatalf("%s: %v\n%s", backend, err, out)
		}
		lines := strings.Split(strings.TrimSpace(out), "\n")
		if len(lines) != 2 {
			t.Fatalf("%s: %d lines:\n%s", backend, len(lines), out)
		}
		for i, l := range lines {
			var r effect.Report
			if err := json.Unmarshal([]byte(l), &r); err != nil {
				t.Fatalf("%s: %v: %s", backend, err, l)
			}
			if r.Backend != backend || r.Proc.Alive != 1 || r.Turn != uint64(i+1) || r.LostEvents != 0 {
				t.Errorf("%s report %d: %s", backend, i, l)
			}
		}
	}
	if _, err := runRoot(t, "probe", "watch"); err == nil || !strings.Contains(err.Error(), "--cgroup") {
		t.Errorf("watch without --cgroup: %v", err)
	}
	if out, err := runRoot(t, "probe", "check"); err != nil || !strings.Contains(out, "ok") {
		t.Errorf("check: %v %s", err, out)
	}
}
