package daemon

import (
	"os"
	"os/exec"
	"reflect"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

func TestStaleFUSEMounts(t *testing.T) {
	info := `22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
39 22 0:39 / /var/lib/rewind/mnt/sb-1 rw,nosuid,nodev shared:20 - fuse.rewind rewind:sb-1 rw,user_id=0,group_id=0
40 22 0:40 / /var/lib/rewind/mnt/sb-2 rw shared:21 - fuse rewind rw
41 22 0:41 / /var/lib/rewind/mntx/sb-3 rw shared:22 - fuse.rewind rewind rw
42 22 0:42 / /var/lib/rewind/mnt/sb-4 rw shared:23 - overlay overlay rw,lowerdir=/a
43 22 0:43 / /home/u/my\040state/mnt/sb-5 rw shared:24 - fuse.rewind rewind rw
44 22 0:44 / /other/fuse rw shared:25 - fuse.sshfs host: rw
`
	for _, tc := range []struct {
		dir  string
		want []fuseMount
	}{
		{"/var/lib/rewind/mnt", []fuseMount{{"/var/lib/rewind/mnt/sb-1", 39}, {"/var/lib/rewind/mnt/sb-2", 40}}},
		{"/home/u/my state/mnt", []fuseMount{{"/home/u/my state/mnt/sb-5", 43}}},
		{"/nowhere", nil},
	} {
		if got := staleFUSEMounts([]byte(info), tc.dir); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("under %s: %v, want %v", tc.dir, got, tc.want)
		}
	}
}

func TestLockHolders(t *testing.T) {
	locks := `1: FLOCK  ADVISORY  WRITE 22017 fe:00:9977884 0 EOF
1: -> FLOCK  ADVISORY  WRITE 22500 fe:00:9977884 0 EOF
2: FLOCK  ADVISORY  WRITE 22017 fe:00:9977869 0 EOF
3: POSIX  ADVISORY  WRITE 812 00:1a:9977884 0 EOF
4: OFDLCK ADVISORY  READ  -1 fe:00:9977884 0 EOF
garbage
`
	dev := unix.Mkdev(0xfe, 0)
	for _, tc := range []struct {
		dev, ino uint64
		want     []int
	}{
		{dev, 9977884, []int{22017, 22500, -1}},
		{dev, 9977869, []int{22017}},
		{unix.Mkdev(0, 0x1a), 9977884, []int{812}},
		{dev, 1, nil},
	} {
		if got := lockHolders([]byte(locks), tc.dev, tc.ino); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("dev %x ino %d: %v, want %v", tc.dev, tc.ino, got, tc.want)
		}
	}
}

func TestProcessDead(t *testing.T) {
	if processDead(os.Getpid()) || processDead(-1) {
		t.Error("this test's process, or pid -1 (an OFD lock's), reads as dead")
	}
	cmd := exec.Command("true")
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	pid := cmd.Process.Pid
	// Exited but not yet waited for: a zombie.
	if !waitFor(5*time.Second, func() bool { return processDead(pid) }) {
		t.Errorf("exited child %d (a zombie) reads as alive", pid)
	}
	_ = cmd.Wait()
	if !processDead(pid) {
		t.Errorf("reaped child %d reads as alive", pid)
	}
}

func waitFor(d time.Duration, ok func() bool) bool {
	for end := time.Now().Add(d); time.Now().Before(end); time.Sleep(5 * time.Millisecond) {
		if ok() {
			return true
		}
	}
	return ok()
}
