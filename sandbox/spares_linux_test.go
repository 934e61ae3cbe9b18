package sandbox

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestSpares(t *testing.T) {
	requireSandbox(t)
	sp := NewSpares(2, "", "test-spare-", nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 2 })
	sp.mu.Lock()
	var sparePIDs []int
	for _, ip := range sp.ready {
		sparePIDs = append(sparePIDs, ip.cmd.Process.Pid)
	}
	sp.mu.Unlock()
	for i := 0; i < 4; i++ {
		root, binds := testRoot(t)
		cfg := Config{Root: root, Binds: binds}
		if i%2 == 1 {
			cfg.ID = fmt.Sprintf("spare-%d-%d", os.Getpid(), i) // the spare's cgroups get renamed
		}
		sb, err := sp.Start(testCtx(t), cfg)
		if err != nil {
			t.Fatal(err)
		}
		if i < 2 && sb.InitPID() != sparePIDs[i] {
			t.Errorf("start %d did not use a spare", i)
		}
		if (cfg.ID == "" && !strings.HasPrefix(sb.ID(), "test-spare-")) || (cfg.ID != "" && sb.ID() != cfg.ID) {
			t.Errorf("sandbox id %q for Config.ID %q", sb.ID(), cfg.ID)
		}
		if out := sh(t, sb, "hostname; cat /proc/1/cmdline; echo; ls /run/rewind | wc -l"); out != sb.ID()+"\nrewind-init\x00\n0\n" {
			t.Errorf("sandbox on a spare: %q", out)
		}
		cg, _ := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", sb.InitPID()))
		for _, want := range []string{":freezer:/rewind/" + sb.ID() + "\n", "0::/rewind/" + sb.ID() + "\n", ":pids:/rewind/" + sb.ID() + "\n"} {
			if !strings.Contains(string(cg), want) {
				t.Errorf("spare init not in the sandbox's cgroup %q:\n%s", want, cg)
			}
		}
		var st syscall.Stat_t
		if err := syscall.Stat(sb.CgroupV2Dir(), &st); err != nil || st.Ino != sb.CgroupID() {
			t.Errorf("cgroup id %d, v2 dir inode %d (%v)", sb.CgroupID(), st.Ino, err)
		}
		dirs := sb.cgroupDirs()
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
		for _, d := range dirs {
			if _, err := os.Stat(d); !os.IsNotExist(err) {
				t.Errorf("cgroup %s left", d)
			}
		}
	}
	waitFor(t, "refill", func() bool { return sp.Ready() == 2 })
	sp.mu.Lock()
	var left []proc
	for _, ip := range sp.ready {
		left = append(left, procOf(ip.cmd.Process.Pid))
	}
	sp.mu.Unlock()
	sp.Close()
	for _, p := range left {
		deadline := time.Now().Add(10 * time.Second)
		for alive(p) && time.Now().Before(deadline) {
			time.Sleep(5 * time.Millisecond)
		}
		if alive(p) {
			t.Fatalf("spare %d survived Close", p.pid)
		}
	}
	// Start after Close still works (no spares).
	root, binds := testRoot(t)
	sb, err := sp.Start(context.Background(), Config{Root: root, Binds: binds})
	if err != nil {
		t.Fatal(err)
	}
	sb.Close()
	// No spare cgroup is left behind.
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent} {
		ents, _ := os.ReadDir(parent)
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), "test-spare-") {
				t.Errorf("spare cgroup %s/%s left", parent, e.Name())
			}
		}
	}
}

// TestSparesCaps: a spare init drops setupCaps from its bounding set
// before its setup, so a sandbox on a spare runs with the reduced set; a
// KeepCaps sandbox is never put on a spare (it needs an init started for
// it) and keeps what it asked for.
func TestSparesCaps(t *testing.T) {
	requireSandbox(t)
	sp := NewSpares(1, "", "test-spcaps-", nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
	for _, tc := range []struct {
		name      string
		keepCaps  bool
		spare     bool
		mountCode int
	}{
		{"spare", false, true, 1},
		{"keep caps", true, false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sp.mu.Lock()
			var sparePID int
			if len(sp.ready) > 0 {
				sparePID = sp.ready[0].cmd.Process.Pid
			}
			sp.mu.Unlock()
			root, binds := testRoot(t)
			sb, err := sp.Start(testCtx(t), Config{Root: root, Binds: binds, KeepCaps: tc.keepCaps})
			if err != nil {
				t.Fatal(err)
			}
			defer sb.Close()
			if onSpare := sparePID != 0 && sb.InitPID() == sparePID; onSpare != tc.spare {
				t.Fatalf("on a spare: %v, want %v", onSpare, tc.spare)
			}
			_, _, code := run(t, sb, "sh", "-c", "mkdir -p /tmp/m && mount -t tmpfs x /tmp/m 2>/dev/null")
			if (code == 0) != (tc.mountCode == 0) {
				t.Errorf("mount in the sandbox: exit %d, want %d", code, tc.mountCode)
			}
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/status", sb.InitPID()))
			if err != nil {
				t.Fatal(err)
			}
			const sysAdmin = 1 << 21
			for _, line := range strings.Split(string(st), "\n") {
				if v, ok := strings.CutPrefix(line, "CapBnd:"); ok {
					var bnd uint64
					fmt.Sscanf(strings.TrimSpace(v), "%x", &bnd)
					if (bnd&sysAdmin != 0) != tc.keepCaps {
						t.Errorf("init's bounding set %x: CAP_SYS_ADMIN kept %v, want %v", bnd, bnd&sysAdmin != 0, tc.keepCaps)
					}
				}
			}
		})
	}
}

// TestSparesRootMountedLater: a sandbox's root is often a mount made for
// it (a FUSE view), after the spare's mount namespace was copied from the
// host's; the sandbox on the spare still gets that mount as its root.
func TestSparesRootMountedLater(t *testing.T) {
	requireSandbox(t)
	sp := NewSpares(1, "", "test-splate-", nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
	sp.mu.Lock()
	sparePID := sp.ready[0].cmd.Process.Pid
	sp.mu.Unlock()
	root := t.TempDir()
	if err := syscall.Mount("tmpfs", root, "tmpfs", 0, "mode=0755"); err != nil {
		t.Fatal(err)
	}
	defer syscall.Unmount(root, syscall.MNT_DETACH)
	binds, err := MinimalRoot(root)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(root+"/marker", []byte("mounted after the spare"), 0o644); err != nil {
		t.Fatal(err)
	}
	sb, err := sp.Start(testCtx(t), Config{Root: root, Binds: binds})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if sb.InitPID() != sparePID {
		t.Fatal("the start did not use the spare")
	}
	if out := sh(t, sb, "cat /marker; echo; echo x > /written"); out != "mounted after the spare\n" {
		t.Fatalf("sandbox root: %q", out)
	}
	if b, err := os.ReadFile(root + "/written"); err != nil || string(b) != "x\n" {
		t.Fatalf("a write in the sandbox reached %q (%v), not the mount", b, err)
	}
}

// TestSparesDropViewMounts: a waiting spare holds no copy of the host's
// FUSE or overlay mounts (other sandboxes' views), whose unmounts would
// otherwise wait for it.
func TestSparesDropViewMounts(t *testing.T) {
	requireSandbox(t)
	dir := t.TempDir()
	for _, d := range []string{"lower", "upper", "work", "view"} {
		if err := os.Mkdir(dir+"/"+d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	view := dir + "/view"
	if err := syscall.Mount("overlay", view, "overlay", 0, "lowerdir="+dir+"/lower,upperdir="+dir+"/upper,workdir="+dir+"/work"); err != nil {
		t.Fatal(err)
	}
	defer syscall.Unmount(view, syscall.MNT_DETACH)
	sp := NewSpares(1, "", "test-spdrop-", nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
	sp.mu.Lock()
	pid := sp.ready[0].cmd.Process.Pid
	sp.mu.Unlock()
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
	if err != nil {
		t.Fatal(err)
	}
	if !strings.Contains(string(mi), " / / ") {
		t.Fatalf("spare's mountinfo looks wrong:\n%s", mi)
	}
	if strings.Contains(string(mi), " "+view+" ") {
		t.Fatalf("the spare holds a copy of the overlay at %s:\n%s", view, mi)
	}
}

// TestPIDFloor: in a sandbox started fresh or from a spare, every thread of
// the init has an id of at most pidFloor and sandbox processes get pids
// above it, so an exact pid of one sandbox's process is never an init
// thread's in another.
func TestPIDFloor(t *testing.T) {
	requireSandbox(t)
	sp := NewSpares(1, "", "test-floor-", nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
	for _, spare := range []bool{false, true} {
		t.Run(fmt.Sprintf("spare=%v", spare), func(t *testing.T) {
			var sb *Sandbox
			if spare {
				root, binds := testRoot(t)
				var err error
				if sb, err = sp.Start(testCtx(t), Config{Root: root, Binds: binds}); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { sb.Close() })
			} else {
				sb = startTest(t, nil)
			}
			tids, err := os.ReadDir(fmt.Sprintf("/proc/%d/task", sb.InitPID()))
			if err != nil {
				t.Fatal(err)
			}
			for _, e := range tids {
				st, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/status", sb.InitPID(), e.Name()))
				if err != nil {
					continue
				}
				for _, l := range strings.Split(string(st), "\n") {
					if v, ok := strings.CutPrefix(l, "NSpid:"); ok {
						f := strings.Fields(v)
						if id, _ := strconv.Atoi(f[len(f)-1]); id > pidFloor {
							t.Errorf("init thread %s has id %d in the sandbox, above the floor %d", e.Name(), id, pidFloor)
						}
					}
				}
			}
			if out := sh(t, sb, "echo $$"); out == "" {
				t.Fatal("no pid")
			} else if pid, _ := strconv.Atoi(strings.TrimSpace(out)); pid <= pidFloor {
				t.Fatalf("a sandbox process has pid %d, at or below the floor %d", pid, pidFloor)
			}
		})
	}
}

// TestSparesCloseRemovesCgroups: closing the pool while it makes a
// replacement spare (a start took the ready one) leaves none of the
// spares' cgroups behind. It left one set (freezer, v2, pids) per close
// before: thousands of empty cgroups after a day of test runs, and one
// per daemon that stopped while refilling.
func TestSparesCloseRemovesCgroups(t *testing.T) {
	requireSandbox(t)
	prefix := fmt.Sprintf("test-close-%d-", os.Getpid())
	for round := 0; round < 3; round++ {
		sp := NewSpares(1, "", prefix, nil)
		waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
		root, binds := testRoot(t)
		sb, err := sp.Start(testCtx(t), Config{Root: root, Binds: binds, ID: fmt.Sprintf("close-%d-%d", os.Getpid(), round)})
		if err != nil {
			sp.Close()
			t.Fatal(err)
		}
		sp.Close() // the replacement is being made now
		if err := sb.Close(); err != nil {
			t.Fatal(err)
		}
	}
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent} {
		ents, err := os.ReadDir(parent)
		if err != nil {
			continue // a hierarchy this host lacks
		}
		for _, e := range ents {
			if strings.HasPrefix(e.Name(), prefix) {
				t.Errorf("cgroup %s/%s left behind", parent, e.Name())
			}
		}
	}
}

// TestPIDCounterMin: a sandbox started with Config.PIDCounterMin, on a
// fresh init or a spare, gives its first process a pid above it (its init
// moved the counter while it could), reports the value once, and leaves
// its init's threads below the pid floor. Without it, the first process
// gets the pid just above the floor.
func TestPIDCounterMin(t *testing.T) {
	requireSandbox(t)
	sp := NewSpares(1, "", "test-counter-", nil)
	defer sp.Close()
	for _, tc := range []struct {
		name  string
		spare bool
		min   int
	}{
		{"fresh", false, 5000},
		{"spare", true, 7000},
		{"none", false, 0},
	} {
		t.Run(tc.name, func(t *testing.T) {
			root, binds := testRoot(t)
			cfg := Config{Root: root, Binds: binds, PIDCounterMin: tc.min}
			var sb *Sandbox
			var err error
			if tc.spare {
				waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
				sb, err = sp.Start(testCtx(t), cfg)
			} else {
				cfg.ID = fmt.Sprintf("counter-%d-%s", os.Getpid(), tc.name)
				sb, err = Start(testCtx(t), cfg)
			}
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { sb.Close() })
			pid, _ := strconv.Atoi(strings.TrimSpace(sh(t, sb, "echo $$")))
			want := max(tc.min, pidFloor)
			if pid <= want || pid > want+50 {
				t.Errorf("first process has pid %d, want just above %d", pid, want)
			}
			if got := sb.TakePIDCounterMin(); got != tc.min {
				t.Errorf("TakePIDCounterMin() = %d, want %d", got, tc.min)
			}
			if got := sb.TakePIDCounterMin(); got != 0 {
				t.Errorf("a second TakePIDCounterMin() = %d, want 0", got)
			}
		})
	}
}

// TestRemoveStaleSpares: the empty cgroups of a spare whose init died
// (its daemon killed) are removed once old enough; a running spare's are
// kept, and so are young ones and names that are not spare ids.
func TestRemoveStaleSpares(t *testing.T) {
	requireSandbox(t)
	prefix := fmt.Sprintf("test-stale-%d-", os.Getpid())
	// A running spare: its cgroups hold its init.
	sp := NewSpares(1, "", prefix, nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 1 })
	// A dead one: the empty cgroups a killed daemon leaves.
	var dead, other []string
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent} {
		d := filepath.Join(parent, prefix+"0123456789ab")
		o := filepath.Join(parent, prefix+"not-a-spare")
		for _, dir := range []string{d, o} {
			if err := os.Mkdir(dir, 0o755); err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { _ = syscall.Rmdir(dir) })
		}
		dead, other = append(dead, d), append(other, o)
	}
	live := func() int {
		n := 0
		for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent} {
			ents, _ := os.ReadDir(parent)
			for _, e := range ents {
				if rest, ok := strings.CutPrefix(e.Name(), prefix); ok && len(rest) == 12 && rest != "0123456789ab" {
					n++
				}
			}
		}
		return n
	}
	before := live()
	if before == 0 {
		t.Fatal("the running spare has no cgroups")
	}
	if n := RemoveStaleSpares(prefix, time.Hour); n != 0 {
		t.Fatalf("removed %d cgroups younger than the minimum age", n)
	}
	if n := RemoveStaleSpares(prefix, 0); n != len(dead) {
		t.Fatalf("removed %d cgroups, want the dead spare's %d", n, len(dead))
	}
	for _, d := range dead {
		if _, err := os.Stat(d); !os.IsNotExist(err) {
			t.Errorf("%s is still there (%v)", d, err)
		}
	}
	for _, o := range other {
		if _, err := os.Stat(o); err != nil {
			t.Errorf("%s, not a spare's, was removed (%v)", o, err)
		}
	}
	if after := live(); after != before {
		t.Fatalf("the running spare's cgroups: %d, before %d", after, before)
	}
}
