package sandbox

import (
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/mountinfo"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

// TestSparesHoldNoHostMounts: a waiting spare holds none of the host's
// mounts. A mount the host had when the spare was made (its namespace
// started as a copy of the host's) and one made while it waits are both
// gone, for good, once the host unmounts them; an ext4 on an autoclear
// loop device (a loop-mounted store, an operator's image) lets its device
// detach. Before, the spare's copy kept every mount of the host from its
// spawn until it was used or exited, and the loop device stayed attached.
// A sandbox on such a spare still gets its root and binds.
func TestSparesHoldNoHostMounts(t *testing.T) {
	requireSandbox(t)
	_, err := exec.LookPath("mkfs.ext4")
	testenv.RequireNoErr(t, err, "mkfs.ext4")
	_, err = os.Stat("/dev/loop-control")
	testenv.RequireNoErr(t, err, "loop devices")

	dir := t.TempDir()
	before, during, loopMnt := dir+"/before", dir+"/during", dir+"/loop"
	for _, d := range []string{before, during, loopMnt} {
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { _ = unix.Unmount(d, unix.MNT_DETACH) })
	}
	if err := unix.Mount("tmpfs", before, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}
	loopN := mountLoopExt4(t, dir+"/img", loopMnt)
	bound := func() bool {
		_, err := os.Stat(fmt.Sprintf("/sys/block/loop%d/loop/backing_file", loopN))
		return err == nil
	}
	if !bound() {
		t.Fatalf("loop%d is not bound after its mount", loopN)
	}

	sp := NewSpares(2, "", fmt.Sprintf("test-sphost-%d-", os.Getpid()), nil)
	defer sp.Close()
	waitFor(t, "spares", func() bool { return sp.Ready() == 2 })
	sp.mu.Lock()
	var pids []int
	for _, ip := range sp.ready {
		pids = append(pids, ip.cmd.Process.Pid)
	}
	sp.mu.Unlock()
	if err := unix.Mount("tmpfs", during, "tmpfs", 0, "size=1m"); err != nil {
		t.Fatal(err)
	}

	// What a waiting spare has: its own small root and its own /proc.
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, m := range mountinfo.Parse(b) {
			if !(m.MountPoint == "/" && m.FSType == "tmpfs") && !(m.MountPoint == "/proc" && m.FSType == "proc") {
				t.Errorf("waiting spare %d holds %s (%s)", pid, m.MountPoint, m.FSType)
			}
		}
	}

	for _, d := range []string{before, during, loopMnt} {
		if err := unix.Unmount(d, 0); err != nil {
			t.Fatalf("umount %s: %v", d, err)
		}
	}
	for _, pid := range pids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", pid))
		if err != nil {
			t.Fatal(err)
		}
		for _, d := range []string{before, during, loopMnt} {
			if strings.Contains(string(b), " "+d+" ") {
				t.Errorf("spare %d still holds %s after the host unmounted it", pid, d)
			}
		}
	}
	deadline := time.Now().Add(5 * time.Second)
	for bound() && time.Now().Before(deadline) {
		time.Sleep(5 * time.Millisecond)
	}
	if bound() {
		t.Errorf("autoclear loop%d still attached after the host unmounted its only mount", loopN)
	}

	// The spares still start sandboxes, with binds.
	sp.mu.Lock()
	first := sp.ready[0].cmd.Process.Pid
	sp.mu.Unlock()
	root, binds := testRoot(t)
	sb, err := sp.Start(testCtx(t), Config{Root: root, Binds: binds})
	if err != nil {
		t.Fatal(err)
	}
	defer sb.Close()
	if sb.InitPID() != first {
		t.Fatal("the start did not use a spare")
	}
	if out := sh(t, sb, "ls /usr/bin/env && echo x > /tmp/f && cat /tmp/f"); out != "/usr/bin/env\nx\n" {
		t.Fatalf("sandbox on a spare: %q", out)
	}
	if b, err := os.ReadFile(filepath.Join(root, "tmp/f")); err != nil || string(b) != "x\n" {
		t.Fatalf("a write in the sandbox reached %q (%v), not its root", b, err)
	}
}

// mountLoopExt4 makes an ext4 image at img, attaches it to a free loop
// device with autoclear (the device detaches when its last user goes, as
// mount -o loop sets it) and mounts it on mnt. It returns the device's
// number; cleanup detaches what is left.
func mountLoopExt4(t *testing.T, img, mnt string) int {
	t.Helper()
	f, err := os.Create(img)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if err := f.Truncate(16 << 20); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command("mkfs.ext4", "-q", "-F", img).CombinedOutput(); err != nil {
		t.Fatalf("mkfs.ext4: %v: %s", err, out)
	}
	ctl, err := os.OpenFile("/dev/loop-control", os.O_RDWR, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer ctl.Close()
	for try := 0; ; try++ {
		n, err := unix.IoctlRetInt(int(ctl.Fd()), unix.LOOP_CTL_GET_FREE)
		if err != nil {
			t.Fatalf("free loop device: %v", err)
		}
		dev := fmt.Sprintf("/dev/loop%d", n)
		lf, err := os.OpenFile(dev, os.O_RDWR, 0)
		if err != nil {
			t.Fatal(err)
		}
		err = unix.IoctlLoopConfigure(int(lf.Fd()), &unix.LoopConfig{
			Fd:   uint32(f.Fd()),
			Info: unix.LoopInfo64{Flags: unix.LO_FLAGS_AUTOCLEAR},
		})
		if errors.Is(err, unix.EBUSY) && try < 20 {
			lf.Close() // taken by someone else meanwhile
			continue
		}
		if err != nil {
			lf.Close()
			t.Fatalf("configure %s: %v", dev, err)
		}
		t.Cleanup(func() {
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
			if g, err := os.OpenFile(dev, os.O_RDWR, 0); err == nil {
				if _, err := os.Stat(fmt.Sprintf("/sys/block/loop%d/loop/backing_file", n)); err == nil {
					_ = unix.IoctlSetInt(int(g.Fd()), unix.LOOP_CLR_FD, 0)
				}
				g.Close()
			}
		})
		err = unix.Mount(dev, mnt, "ext4", 0, "")
		lf.Close() // the mount holds the device now (or, failing, autoclear frees it)
		if err != nil {
			t.Fatalf("mount %s: %v", dev, err)
		}
		return n
	}
}
