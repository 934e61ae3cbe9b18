package cr

import (
	"os"
	"os/exec"
	"runtime"
	"slices"
	"sync"
	"testing"
)

// TestChildren lists the children of this test process, started from
// several threads (each thread has its own list of children).
func TestChildren(t *testing.T) {
	for _, tc := range []struct {
		name    string
		threads int // each locked to its own OS thread, starting one child
	}{
		{name: "none"},
		{name: "one thread", threads: 1},
		{name: "four threads", threads: 4},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before, err := children(os.Getpid())
			if err != nil {
				t.Fatal(err)
			}
			var mu sync.Mutex
			var want []int
			var wg sync.WaitGroup
			// The threads live until the listing is done: a thread that
			// exits hands its children to another thread of the process,
			// and a listing racing that hand-over can miss them.
			listed := make(chan struct{})
			var ended sync.WaitGroup
			t.Cleanup(ended.Wait)
			for i := 0; i < tc.threads; i++ {
				wg.Add(1)
				ended.Add(1)
				go func() {
					defer ended.Done()
					runtime.LockOSThread() // the thread exits with the goroutine
					defer func() { <-listed }()
					defer wg.Done()
					cmd := exec.Command("sleep", "1000")
					if err := cmd.Start(); err != nil {
						t.Error(err)
						return
					}
					t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
					mu.Lock()
					want = append(want, cmd.Process.Pid)
					mu.Unlock()
				}()
			}
			wg.Wait()
			got, err := children(os.Getpid())
			close(listed)
			if err != nil {
				t.Fatal(err)
			}
			got = slices.DeleteFunc(got, func(p int) bool { return slices.Contains(before, p) })
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("children = %v, want %v", got, want)
			}
		})
	}
	if _, err := children(1 << 30); err == nil {
		t.Error("children of a pid that does not exist: no error")
	}
}

func TestStatIDs(t *testing.T) {
	cmd := exec.Command("sleep", "60")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cmd.Process.Kill(); _ = cmd.Wait() })
	ppid, start, err := statIDs(cmd.Process.Pid)
	if err != nil || ppid != os.Getpid() {
		t.Fatalf("statIDs(child): ppid %d, %v; want %d", ppid, err, os.Getpid())
	}
	_, self, err := statIDs(os.Getpid())
	if err != nil || self == 0 || start < self {
		t.Fatalf("start times: child %d, self %d (%v): the child started after this process", start, self, err)
	}
	if _, _, err := statIDs(1 << 30); err == nil {
		t.Fatal("statIDs of a pid that cannot exist succeeded")
	}
}
