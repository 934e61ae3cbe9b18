package fs

import (
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// maxHolders bounds the processes fuseHolders names.
const maxHolders = 16

// fuseHolders explains why the FUSE connection of device dev is still
// alive after an unmount: the tasks blocked in the kernel on a FUSE request
// (their kernel stack is in fuse client code; /proc does not say on which
// connection), and the mount namespaces
// that still hold the mount (a namespace of a process that has not died,
// or a process that has the file system open). It is for logs: a bounded,
// best-effort description read from /proc.
func fuseHolders(dev uint64) string {
	if dev == 0 {
		return "no device number recorded"
	}
	want := fmt.Sprintf(" %d:%d ", unix.Major(dev), unix.Minor(dev))
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return err.Error()
	}
	var blocked, holders []string
	seenNS := map[string]bool{}
	self := strconv.Itoa(os.Getpid())
	for _, e := range ents {
		pid := e.Name()
		if _, err := strconv.Atoi(pid); err != nil {
			continue
		}
		comm, _ := os.ReadFile("/proc/" + pid + "/comm")
		name := pid + "(" + strings.TrimSpace(string(comm)) + ")"
		if len(blocked) < maxHolders && pid != self {
			tasks, _ := os.ReadDir("/proc/" + pid + "/task")
			for _, t := range tasks {
				st, _ := os.ReadFile("/proc/" + pid + "/task/" + t.Name() + "/stack")
				// A server waiting for requests (fuse_dev_read) is not
				// blocked on one.
				if strings.Contains(string(st), "fuse") && !strings.Contains(string(st), "fuse_dev_") {
					blocked = append(blocked, name+" in "+firstFuseFrame(string(st)))
					break
				}
			}
		}
		if len(holders) >= maxHolders {
			continue
		}
		ns, err := os.Readlink("/proc/" + pid + "/ns/mnt")
		if err != nil || seenNS[ns] {
			continue
		}
		seenNS[ns] = true
		mi, _ := os.ReadFile("/proc/" + pid + "/mountinfo")
		if strings.Contains(string(mi), want) {
			holders = append(holders, name+" "+ns)
		}
	}
	return fmt.Sprintf("blocked in FUSE requests: [%s]; mount namespaces holding the mount: [%s]",
		strings.Join(blocked, ", "), strings.Join(holders, ", "))
}

// firstFuseFrame returns the first frame of a kernel stack that names fuse
// code ("request_wait_answer" and the like).
func firstFuseFrame(stack string) string {
	for _, l := range strings.Split(stack, "\n") {
		if strings.Contains(l, "fuse") {
			f := strings.Fields(l)
			if len(f) > 1 {
				return f[1]
			}
		}
	}
	return "?"
}
