package probe

import (
	"bytes"
	"fmt"
	"io"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"
)

// startBlocked starts args in cgroup dir with stdin and waits until it
// blocks (in read or in a sleep): until then its run count moves between
// two snapshots taken one after the other. It is killed at the test's end.
func startBlocked(t testing.TB, dir string, stdin io.Reader, args ...string) *exec.Cmd {
	t.Helper()
	cmd := exec.Command(args[0], args[1:]...)
	cmd.SysProcAttr = cgroupAttr(t, dir)
	cmd.Stdin = stdin
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() {
		cmd.Process.Kill()
		cmd.Wait()
	})
	base := "/proc/" + strconv.Itoa(cmd.Process.Pid) + "/"
	blocked := func() bool {
		st, _ := os.ReadFile(base + "stat")
		sc, _ := os.ReadFile(base + "syscall")
		i := bytes.LastIndexByte(st, ')')
		if i < 0 || i+2 >= len(st) || st[i+2] != 'S' {
			return false
		}
		nr, _, _ := strings.Cut(string(sc), " ")
		return nr == "0" || nr == "35" || nr == "230" // read, nanosleep, clock_nanosleep
	}
	for deadline := time.Now().Add(10 * time.Second); time.Now().Before(deadline) && !blocked(); time.Sleep(time.Millisecond) {
	}
	return cmd
}

// TestFilesSnapshotsLikePaths: snapshots through kept files see what
// snapshots by path see, step after step: a process joining the cgroup,
// one running (its schedstat moves), one in a nested cgroup, one exiting,
// the nested cgroup removed; the files of a process that is gone are
// closed, and a kept file of a dead process is not read as the pid's.
func TestFilesSnapshotsLikePaths(t *testing.T) {
	cg := newCgroup(t)
	f := NewFiles()
	defer f.Close()
	var prev *snapshot
	check := func(step string, want ...int) *snapshot {
		t.Helper()
		got, err := takeSnapshot(f, cg, false, nil, prev)
		if err != nil {
			t.Fatalf("%s: %v", step, err)
		}
		byPath, err := takeSnapshot(nil, cg, false, nil, prev)
		if err != nil {
			t.Fatalf("%s: by path: %v", step, err)
		}
		var pids []int
		for pid, p := range got.Procs {
			pids = append(pids, pid)
			q := byPath.Procs[pid]
			if q == nil || p.Comm != q.Comm || p.StartTime != q.StartTime || p.PPID != q.PPID || p.Cwd != q.Cwd || p.Argv0 != q.Argv0 {
				t.Errorf("%s: process %d through kept files %+v, by path %+v", step, pid, p, q)
			}
		}
		slices.Sort(pids)
		slices.Sort(want)
		if !slices.Equal(pids, want) {
			t.Fatalf("%s: snapshot has %v, want %v", step, pids, want)
		}
		if len(byPath.Procs) != len(want) {
			t.Fatalf("%s: by path %d processes, want %d", step, len(byPath.Procs), len(want))
		}
		if n := f.Kept(); n != len(want) {
			t.Errorf("%s: files kept of %d processes, want %d", step, n, len(want))
		}
		prev = got
		return got
	}

	a := startBlocked(t, cg, nil, "sleep", "1000")
	check("one process", a.Process.Pid)
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	defer pw.Close()
	// Started blocked in its first read: the line below cannot be read
	// without cat being scheduled again.
	b := startBlocked(t, cg, pr, "cat")
	pr.Close()
	s := check("a second one joins", a.Process.Pid, b.Process.Pid)
	before := *s.Procs[b.Process.Pid]
	// cat runs: reads a line and writes it to nowhere.
	if _, err := pw.Write([]byte("line\n")); err != nil {
		t.Fatal(err)
	}
	var after procInfo
	for deadline := time.Now().Add(10 * time.Second); ; {
		s = check("cat ran", a.Process.Pid, b.Process.Pid)
		after = *s.Procs[b.Process.Pid]
		if after.Slices > before.Slices || time.Now().After(deadline) {
			break
		}
		time.Sleep(5 * time.Millisecond)
	}
	if after.Slices <= before.Slices || after.RunNS < before.RunNS {
		t.Errorf("cat ran, but its kept schedstat reads %d/%d, before %d/%d", after.RunNS, after.Slices, before.RunNS, before.Slices)
	}
	if s.Procs[a.Process.Pid].Slices != prev.Procs[a.Process.Pid].Slices {
		t.Errorf("sleep's run count moved")
	}

	nested := filepath.Join(cg, "nested")
	if err := os.Mkdir(nested, 0o755); err != nil {
		t.Fatal(err)
	}
	c := startBlocked(t, nested, nil, "sleep", "1001")
	check("a process in a nested cgroup", a.Process.Pid, b.Process.Pid, c.Process.Pid)

	// a exits; its kept stat is of a dead process now.
	aPid := a.Process.Pid
	a.Process.Kill()
	a.Wait()
	if _, err := f.stat(aPid); err == nil {
		// The pid may have been taken by another process meanwhile: then
		// the stat must be that one's, read by path.
		b, _ := os.ReadFile("/proc/" + strconv.Itoa(aPid) + "/stat")
		if len(b) == 0 {
			t.Errorf("stat of exited process %d read through its kept file", aPid)
		}
	}
	check("the first one exited", b.Process.Pid, c.Process.Pid)

	c.Process.Kill()
	c.Wait()
	for deadline := time.Now().Add(10 * time.Second); ; {
		if err := os.Remove(nested); err == nil || time.Now().After(deadline) {
			break
		}
		time.Sleep(10 * time.Millisecond)
	}
	check("the nested cgroup removed", b.Process.Pid)
	if err := f.Close(); err != nil {
		t.Fatal(err)
	}
	if n := f.Kept(); n != 0 {
		t.Fatalf("closed Files keeps %d processes", n)
	}
	got, err := takeSnapshot(f, cg, false, nil, nil)
	if err != nil || len(got.Procs) != 1 || f.Kept() != 0 {
		t.Fatalf("snapshot through closed Files: %v %v, keeps %d", got, err, f.Kept())
	}
}

// BenchmarkSnapshotFiles is a window's end snapshot of a cgroup of one
// process, by path and through kept files.
func BenchmarkSnapshotFiles(b *testing.B) {
	cg := newCgroup(b)
	startBlocked(b, cg, nil, "sleep", "1000")
	for _, bc := range []struct {
		name  string
		files *Files
	}{{"path", nil}, {"kept", NewFiles()}} {
		b.Run(bc.name, func(b *testing.B) {
			defer bc.files.Close()
			prev, err := takeSnapshot(bc.files, cg, false, nil, nil)
			if err != nil {
				b.Fatal(err)
			}
			for b.Loop() {
				if _, err := takeSnapshot(bc.files, cg, false, nil, prev); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

// TestFilesBound: a sandbox of more processes than Files keeps files of
// is snapshotted whole, the rest read by path.
func TestFilesBound(t *testing.T) {
	cg := newCgroup(t)
	f := NewFiles()
	defer f.Close()
	var want []int
	for i := 0; i < maxKeptPIDs+4; i++ {
		want = append(want, startBlocked(t, cg, nil, "sleep", "1000").Process.Pid)
	}
	for round := 0; round < 2; round++ {
		s, err := takeSnapshot(f, cg, false, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		var got []int
		for pid := range s.Procs {
			got = append(got, pid)
		}
		slices.Sort(got)
		slices.Sort(want)
		if !slices.Equal(got, want) {
			t.Fatalf("round %d: snapshot of %d processes has %v, want %v", round, len(want), got, want)
		}
		if n := f.Kept(); n != maxKeptPIDs {
			t.Fatalf("round %d: files kept of %d processes, want %d", round, n, maxKeptPIDs)
		}
	}
}

// TestFilesDifferential runs random sequences of process starts (in the
// cgroup or a nested one), exits, wake-ups and nested-cgroup removals,
// and after every step compares a snapshot through kept files with one by
// path: the same processes, the same identities, parents, cwds and
// argv[0]s, the same run counts for processes that did not run.
func TestFilesDifferential(t *testing.T) {
	for seed := uint64(1); seed <= 3; seed++ {
		t.Run(fmt.Sprint("seed=", seed), func(t *testing.T) {
			cg := newCgroup(t)
			f := NewFiles()
			defer f.Close()
			rng := rand.New(rand.NewPCG(seed, 42))
			type proc struct {
				cmd *exec.Cmd
				in  *os.File // cat's stdin, nil for sleep
			}
			var procs []proc
			nested := ""
			start := func(dir string, cat bool) {
				if !cat {
					procs = append(procs, proc{startBlocked(t, dir, nil, "sleep", "1000"), nil})
					return
				}
				r, w, err := os.Pipe()
				if err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { w.Close() })
				cmd := startBlocked(t, dir, r, "cat")
				r.Close()
				procs = append(procs, proc{cmd, w})
			}
			var prev *snapshot
			for step := 0; step < 40; step++ {
				var op string
				switch k := rng.IntN(10); {
				case k < 3 || len(procs) == 0:
					dir := cg
					if nested != "" && rng.IntN(2) == 0 {
						dir = nested
					}
					op = "start in " + filepath.Base(dir)
					start(dir, rng.IntN(2) == 0)
				case k < 5:
					i := rng.IntN(len(procs))
					op = fmt.Sprint("kill ", procs[i].cmd.Process.Pid)
					procs[i].cmd.Process.Kill()
					procs[i].cmd.Wait()
					procs = append(procs[:i], procs[i+1:]...)
				case k < 7:
					op = "wake the cats"
					for _, p := range procs {
						if p.in != nil {
							p.in.Write([]byte("x\n"))
						}
					}
				case k < 9:
					if nested == "" {
						nested = filepath.Join(cg, fmt.Sprint("n", step))
						if err := os.Mkdir(nested, 0o755); err != nil {
							t.Fatal(err)
						}
						op = "make a nested cgroup"
					} else {
						op = "remove the nested cgroup"
						b, _ := os.ReadFile(filepath.Join(nested, "cgroup.procs"))
						for _, fld := range strings.Fields(string(b)) {
							pid, _ := strconv.Atoi(fld)
							for i, p := range procs {
								if p.cmd.Process.Pid == pid {
									p.cmd.Process.Kill()
									p.cmd.Wait()
									procs = append(procs[:i], procs[i+1:]...)
									break
								}
							}
						}
						for deadline := time.Now().Add(10 * time.Second); ; time.Sleep(5 * time.Millisecond) {
							if err := os.Remove(nested); err == nil || time.Now().After(deadline) {
								break
							}
						}
						nested = ""
					}
				default:
					op = "nothing"
				}
				kept, err := takeSnapshot(f, cg, false, nil, prev)
				if err != nil {
					t.Fatalf("step %d (%s): %v", step, op, err)
				}
				byPath, err := takeSnapshot(nil, cg, false, nil, prev)
				if err != nil {
					t.Fatalf("step %d (%s): by path: %v", step, op, err)
				}
				if len(kept.Procs) != len(byPath.Procs) || len(kept.Procs) != len(procs) {
					t.Fatalf("step %d (%s): %d processes through kept files, %d by path, %d running", step, op, len(kept.Procs), len(byPath.Procs), len(procs))
				}
				for pid, p := range kept.Procs {
					q := byPath.Procs[pid]
					if q == nil || p.StartTime != q.StartTime || p.PPID != q.PPID || p.Comm != q.Comm || p.Cwd != q.Cwd || p.Argv0 != q.Argv0 {
						t.Fatalf("step %d (%s): process %d through kept files %+v, by path %+v", step, op, pid, p, q)
					}
					if p.Comm == "sleep" && p.Slices != q.Slices {
						t.Errorf("step %d (%s): sleep %d run count %d through kept files, %d by path", step, op, pid, p.Slices, q.Slices)
					}
				}
				if n := f.Kept(); n != min(len(procs), maxKeptPIDs) {
					t.Fatalf("step %d (%s): files kept of %d processes, %d running", step, op, n, len(procs))
				}
				prev = kept
			}
		})
	}
}
