package cr

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// Proc describes a sandbox process as it was at checkpoint time.
type Proc struct {
	// PID is the host pid.
	PID int
	// NSPID is the pid inside the sandbox's PID namespace (0 if unknown).
	NSPID int
	// PPID is the host pid of the parent.
	PPID int
	// Threads is the number of threads.
	Threads int
	// Comm is the command name.
	Comm string
}

// readProc reads /proc/<pid>/status.
func readProc(pid int) (Proc, error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/status")
	if err != nil {
		return Proc{}, err
	}
	p := Proc{PID: pid}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		v = strings.TrimSpace(v)
		switch k {
		case "Name":
			p.Comm = v
		case "PPid":
			p.PPID, _ = strconv.Atoi(v)
		case "Threads":
			p.Threads, _ = strconv.Atoi(v)
		case "NSpid":
			f := strings.Fields(v)
			if len(f) > 1 {
				p.NSPID, _ = strconv.Atoi(f[len(f)-1])
			}
		}
	}
	return p, nil
}

// children returns the host pids of the children of pid (all its threads).
func children(pid int) ([]int, error) {
	dir := "/proc/" + strconv.Itoa(pid) + "/task"
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []int
	for _, e := range ents {
		b, err := os.ReadFile(dir + "/" + e.Name() + "/children")
		if err != nil {
			continue
		}
		for _, f := range strings.Fields(string(b)) {
			if c, err := strconv.Atoi(f); err == nil {
				out = append(out, c)
			}
		}
	}
	return out, nil
}

// descendants lists every process below init (init excluded), parents
// before children, skipping the pids in skip (and their subtrees).
func descendants(init int, skip map[int]bool) ([]Proc, error) {
	var out []Proc
	queue := []int{init}
	seen := map[int]bool{init: true}
	for len(queue) > 0 {
		pid := queue[0]
		queue = queue[1:]
		kids, err := children(pid)
		if err != nil {
			if pid == init {
				return nil, fmt.Errorf("list children of init %d: %w", init, err)
			}
			continue
		}
		for _, c := range kids {
			if seen[c] || skip[c] {
				continue
			}
			seen[c] = true
			p, err := readProc(c)
			if err != nil {
				continue // exited meanwhile
			}
			out = append(out, p)
			queue = append(queue, c)
		}
	}
	return out, nil
}

func itoa(i int) string { return strconv.Itoa(i) }
