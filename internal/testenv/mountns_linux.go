package testenv

import (
	"fmt"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// ForeignMountNS starts a process in a new, private mount namespace, as any
// program on a host may make one (unshare, a container start): it holds a
// copy of every mount that exists now. It returns the path of the
// process's root (/proc/PID/root), through which those copies are reached;
// the process is killed at cleanup.
func ForeignMountNS(t testing.TB) string {
	t.Helper()
	_, err := exec.LookPath("unshare")
	RequireNoErr(t, err, "unshare")
	holder := exec.Command("unshare", "--mount", "--propagation", "private", "sleep", "600")
	if err := holder.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = holder.Process.Kill(); _ = holder.Wait() })
	pid := holder.Process.Pid
	// unshare has made the namespace once it has exec'd sleep.
	for i := 0; ; i++ {
		comm, _ := os.ReadFile(fmt.Sprintf("/proc/%d/comm", pid))
		if strings.TrimSpace(string(comm)) == "sleep" {
			return fmt.Sprintf("/proc/%d/root", pid)
		}
		if i == 1000 {
			t.Fatalf("unshare (pid %d) did not start sleep", pid)
		}
		time.Sleep(5 * time.Millisecond)
	}
}
