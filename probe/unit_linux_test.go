package probe

import (
	"bytes"
	"encoding/binary"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func TestParseHexAddr(t *testing.T) {
	for _, c := range []struct {
		in       string
		want     string
		loopback bool
	}{
		{"0100007F:1F90", "127.0.0.1:8080", true},
		{"0202000A:0050", "10.0.2.2:80", false},
		{"00000000:0000", "0.0.0.0:0", true},
		{"00000000000000000000000001000000:0016", "[::1]:22", true},
		{"0000000000000000FFFF00000100007F:0016", "127.0.0.1:22", true},
		{"0000000000000000FFFF00000202000A:01BB", "10.0.2.2:443", false},
		{"B80D0120000000000000000001000000:0035", "[2001:db8::1]:53", false},
	} {
		ip, port, ok := parseHexAddr(c.in)
		if !ok {
			t.Errorf("%s: not parsed", c.in)
			continue
		}
		if got := joinHostPort(ip, port); got != c.want {
			t.Errorf("%s: %s, want %s", c.in, got, c.want)
		}
		if got := isLoopbackOrUnspec(ip); got != c.loopback {
			t.Errorf("%s: loopback %v, want %v", c.in, got, c.loopback)
		}
	}
	for _, bad := range []string{"", "0100007F", "XYZ:0001", "0100007F:XYZ"} {
		if _, _, ok := parseHexAddr(bad); ok {
			t.Errorf("%q parsed", bad)
		}
	}
}

func TestSockaddrString(t *testing.T) {
	v4 := make([]byte, 24)
	binary.LittleEndian.PutUint16(v4, 2)
	binary.BigEndian.PutUint16(v4[2:], 443)
	copy(v4[4:], []byte{10, 1, 2, 3})
	v6 := make([]byte, 24)
	binary.LittleEndian.PutUint16(v6, 10)
	binary.BigEndian.PutUint16(v6[2:], 53)
	copy(v6[8:], []byte{0x20, 0x01, 0x0d, 0xb8, 15: 1})
	unix := make([]byte, 24)
	binary.LittleEndian.PutUint16(unix, 1)
	for _, c := range []struct {
		b    []byte
		want string
		ok   bool
	}{{v4, "10.1.2.3:443", true}, {v6, "[2001:db8::1]:53", true}, {unix, "", false}, {v4[:8], "", false}} {
		got, ok := sockaddrString(c.b)
		if got != c.want || ok != c.ok {
			t.Errorf("got %q %v, want %q %v", got, ok, c.want, c.ok)
		}
	}
}

func TestApplySnapshots(t *testing.T) {
	p := func(pid int, start, flt, run uint64, cwd, comm string) *procInfo {
		return &procInfo{PID: pid, StartTime: start, MinFlt: flt, RunNS: run, Cwd: cwd, Comm: comm}
	}
	begin := &snapshot{Procs: map[int]*procInfo{
		1:  p(1, 10, 100, 5, "/", "init"),
		20: p(20, 11, 50, 7, "/w", "bash"),
		21: p(21, 12, 10, 1, "/w", "sleep"),  // exits
		22: p(22, 13, 10, 1, "/w", "python"), // idle
		23: p(23, 14, 10, 1, "/w", "old"),    // pid reused below
		24: p(24, 15, 10, 1, "/w", "worker"), // scheduled in, still on CPU
	}}
	end := &snapshot{Procs: map[int]*procInfo{
		1:  p(1, 10, 900, 50, "/", "init"),     // init: excluded from memory
		20: p(20, 11, 50, 9, "/w/sub", "bash"), // ran, no fault, cd
		22: p(22, 13, 10, 1, "/w", "python"),   // idle: nothing
		23: p(23, 99, 40, 3, "/w", "server"),   // new process, reused pid
		30: p(30, 20, 0, 0, "/w", "new"),       // new, no faults yet
		24: p(24, 15, 10, 1, "/w", "worker"),
	}}
	begin.Procs[24].Slices, end.Procs[24].Slices = 7, 8
	var r effect.Report
	d := applySnapshots(&r, begin, end, 1)
	if r.Proc.Alive != 6 || r.Proc.Exited != 2 || r.Proc.NewLongLived != 2 || r.Proc.CwdChanges != 1 || d.New != 2 {
		t.Fatalf("proc %+v new %d", r.Proc, d.New)
	}
	if r.Mem.PagesWritten != 1+40+1+1 || len(r.Mem.PerProc) != 4 || r.Mem.PerProc[0].PID != 23 {
		t.Fatalf("mem %+v", r.Mem)
	}
	if len(r.Proc.LongLived) != 2 || r.Proc.LongLived[0].Comm != "server" {
		t.Fatalf("long lived %+v", r.Proc.LongLived)
	}
}

func TestDirSource(t *testing.T) {
	root := t.TempDir()
	must := func(err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
	}
	must(os.WriteFile(filepath.Join(root, "keep"), []byte("a"), 0o644))
	must(os.WriteFile(filepath.Join(root, "old"), []byte("a"), 0o644))
	must(os.WriteFile(filepath.Join(root, "gone"), []byte("a"), 0o644))
	must(os.WriteFile(filepath.Join(root, "mod"), []byte("a"), 0o644))
	s := NewDirSource(root)
	if f := s.TakeFSEffects(); f.Created+f.Modified+f.Deleted+f.Renamed+f.MetaChanged != 0 || f.UpperNonEmpty {
		t.Fatalf("fresh source: %+v", f)
	}
	must(os.Rename(filepath.Join(root, "old"), filepath.Join(root, "new")))
	must(os.Remove(filepath.Join(root, "gone")))
	must(os.WriteFile(filepath.Join(root, "mod"), []byte("abcd"), 0o644))
	must(os.Chmod(filepath.Join(root, "keep"), 0o600))
	must(os.Mkdir(filepath.Join(root, "dir"), 0o755))
	f := s.TakeFSEffects()
	want := effect.FS{Created: 1, Modified: 1, Deleted: 1, Renamed: 1, MetaChanged: 1, BytesWritten: 4, UpperNonEmpty: true}
	got := f
	got.Samples = nil
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("got %+v, want %+v", got, want)
	}
	if len(f.Samples) != 5 || f.Samples[0] != (effect.PathSample{Op: "create", Path: "dir"}) {
		t.Fatalf("samples %+v", f.Samples)
	}
	if f := s.TakeFSEffects(); f.Created+f.Modified+f.Deleted+f.Renamed+f.MetaChanged != 0 || !f.UpperNonEmpty {
		t.Fatalf("second take: %+v", f)
	}
}

// TestCgroupPIDs lists the processes of a cgroup with and without nested
// cgroups (the nested ones are found by the directory's link count).
func TestCgroupPIDs(t *testing.T) {
	for _, tc := range []struct {
		name   string
		nested []string // cgroups below the top one, in creation order
		in     []string // where each process runs: "" is the top cgroup
	}{
		{name: "flat", in: []string{"", ""}},
		{name: "empty nested", nested: []string{"a"}, in: nil},
		{name: "one nested", nested: []string{"a"}, in: []string{"a", "a"}},
		{name: "deep", nested: []string{"a", "a/b", "c"}, in: []string{"a/b", "c", "a/b"}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			top := newCgroup(t)
			for _, n := range tc.nested {
				d := filepath.Join(top, n)
				if err := os.Mkdir(d, 0o755); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { removeCgroup(t, d) })
			}
			var want []int
			for _, where := range tc.in {
				cmd := exec.Command("sleep", "3600")
				cmd.SysProcAttr = cgroupAttr(t, filepath.Join(top, where))
				if err := cmd.Start(); err != nil {
					t.Fatal(err)
				}
				t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
				want = append(want, cmd.Process.Pid)
			}
			got, err := cgroupPIDs(nil, top)
			if err != nil {
				t.Fatal(err)
			}
			slices.Sort(got)
			slices.Sort(want)
			if !slices.Equal(got, want) {
				t.Fatalf("cgroupPIDs = %v, want %v", got, want)
			}
		})
	}
}

// TestReadProcReusesUnscheduled: an end snapshot takes a process's cwd and
// argv[0] from the begin snapshot only while the process has not been
// scheduled since; a process that ran (here: a shell that changed
// directory) is read again, and so is a pid whose start time differs.
func TestReadProcReusesUnscheduled(t *testing.T) {
	dir := t.TempDir()
	sh := exec.Command("sh", "-c", "read line; cd \"$line\"; read more")
	sh.Dir = "/"
	in, err := sh.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := sh.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); sh.Process.Kill(); sh.Wait() })
	pid := sh.Process.Pid
	// Wait until the shell sleeps in its first read.
	var begin *procInfo
	for i := 0; ; i++ {
		if begin, err = readProcStat(nil, pid, nil, false, nil); err != nil {
			t.Fatal(err)
		}
		if st, _ := os.ReadFile(filepath.Join("/proc", itoa(pid), "stat")); begin.Cwd == "/" && bytes.Contains(st, []byte(") S ")) && i > 2 {
			break
		}
		if i > 200 {
			t.Fatalf("shell did not settle: %+v", begin)
		}
		time.Sleep(5 * time.Millisecond)
	}
	prev := &snapshot{Procs: map[int]*procInfo{pid: begin}}

	// Not scheduled since: a marked cwd in prev comes back.
	marked := *begin
	marked.Cwd, marked.Argv0 = "/marked", "marked"
	got, err := readProcStat(nil, pid, nil, false, &snapshot{Procs: map[int]*procInfo{pid: &marked}})
	if err != nil {
		t.Fatal(err)
	}
	if got.RunNS == begin.RunNS && got.Slices == begin.Slices && (got.Cwd != "/marked" || got.Argv0 != "marked") {
		t.Fatalf("unscheduled process read again: %+v", got)
	}
	// Another process under the same pid (another start time): read.
	other := marked
	other.StartTime++
	if got, err = readProcStat(nil, pid, nil, false, &snapshot{Procs: map[int]*procInfo{pid: &other}}); err != nil || got.Cwd != "/" {
		t.Fatalf("process with another start time: %+v, %v", got, err)
	}

	// The shell runs and changes directory: read again.
	if _, err := in.Write([]byte(dir + "\n")); err != nil {
		t.Fatal(err)
	}
	for i := 0; ; i++ {
		if got, err = readProcStat(nil, pid, nil, false, prev); err != nil {
			t.Fatal(err)
		}
		if got.Cwd == dir {
			break
		}
		if i > 200 {
			t.Fatalf("cwd after cd: %q (run %d -> %d ns, slices %d -> %d), want %q", got.Cwd, begin.RunNS, got.RunNS, begin.Slices, got.Slices, dir)
		}
		time.Sleep(5 * time.Millisecond)
	}
	if got.Slices == begin.Slices {
		t.Fatalf("the shell ran but its run count did not move: %+v", got)
	}
}

// TestReadProcZombieLeader: a process whose main thread exited while
// another thread runs has a zombie leader whose own schedstat no longer
// moves; its run time must still grow while the other thread runs (the
// kernel's thread count includes the zombie leader, so readSchedstat lists
// the threads).
func TestReadProcZombieLeader(t *testing.T) {
	cc, err := exec.LookPath("gcc")
	testenv.RequireNoErr(t, err, "gcc (builds the test program)")
	bin := filepath.Join(t.TempDir(), "zombieleader")
	if out, err := exec.Command(cc, "-O1", "-pthread", "-o", bin, "testdata/zombieleader.c").CombinedOutput(); err != nil {
		t.Fatalf("build: %v\n%s", err, out)
	}
	cmd := exec.Command(bin)
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
	pid := cmd.Process.Pid
	for i := 0; ; i++ {
		st, _ := os.ReadFile(filepath.Join("/proc", itoa(pid), "stat"))
		if bytes.Contains(st, []byte(") Z ")) {
			break
		}
		if i > 200 {
			t.Fatalf("main thread did not exit: %s", st)
		}
		time.Sleep(5 * time.Millisecond)
	}
	first, err := readProcStat(nil, pid, nil, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	time.Sleep(50 * time.Millisecond) // the spinning thread runs about half of it
	second, err := readProcStat(nil, pid, nil, false, nil)
	if err != nil {
		t.Fatal(err)
	}
	if second.RunNS <= first.RunNS || second.Slices <= first.Slices {
		t.Fatalf("run time %d -> %d ns, run count %d -> %d: the running thread was not counted", first.RunNS, second.RunNS, first.Slices, second.Slices)
	}
}

// TestSnapshotSharesStat: with Target.ExcludeStat the exclusion test reads
// a process's stat through the snapshot (once, however often it asks), the
// snapshot parses those bytes instead of reading them again, and what the
// test excludes stays out, as with Exclude.
func TestSnapshotSharesStat(t *testing.T) {
	cg := newCgroup(t)
	var pids []int
	for _, arg := range []string{"3601", "3602"} {
		cmd := exec.Command("sleep", arg)
		cmd.SysProcAttr = cgroupAttr(t, cg)
		if err := cmd.Start(); err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		pids = append(pids, cmd.Process.Pid)
	}
	cat := exec.Command("cat")
	cat.SysProcAttr = cgroupAttr(t, cg)
	in, err := cat.StdinPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cat.Start(); err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { in.Close(); cat.Process.Kill(); cat.Wait() })

	asked := map[int]int{}
	ex := func(pid int, stat func() ([]byte, error)) bool {
		var first []byte
		for i := 0; i < 2; i++ {
			b, err := stat()
			if err != nil {
				t.Errorf("stat of %d: %v", pid, err)
				return true
			}
			if i == 0 {
				first = b
			} else if &b[0] != &first[0] {
				t.Errorf("stat of %d read twice", pid)
			}
		}
		if !strings.HasPrefix(string(first), strconv.Itoa(pid)+" (") {
			t.Errorf("stat of %d is another process's: %q", pid, first)
		}
		asked[pid]++
		return strings.Contains(string(first), "(cat)")
	}
	s, err := takeSnapshot(nil, cg, false, Target{ExcludeStat: ex}.excluder(), nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, ok := s.Procs[cat.Process.Pid]; ok {
		t.Errorf("excluded cat %d is in the snapshot", cat.Process.Pid)
	}
	for _, pid := range pids {
		p, ok := s.Procs[pid]
		if !ok {
			t.Fatalf("sleep %d missing from the snapshot", pid)
		}
		if p.Comm != "sleep" || p.StartTime == 0 || p.PPID != os.Getpid() {
			t.Errorf("sleep %d parsed as %+v", pid, p)
		}
		if asked[pid] != 1 {
			t.Errorf("sleep %d asked %d times, want 1", pid, asked[pid])
		}
	}
}

// BenchmarkSnapshotExclude is a snapshot of a cgroup of one agent process
// and 15 helpers (as a sandbox with checkpoint templates), its exclusion
// test reading the agent's stat itself (Exclude) or through the snapshot
// (ExcludeStat).
func BenchmarkSnapshotExclude(b *testing.B) {
	cg := newCgroup(b)
	helpers := map[int]bool{}
	agent := 0
	for i := 0; i < 16; i++ {
		cmd := exec.Command("sleep", "3600")
		cmd.SysProcAttr = cgroupAttr(b, cg)
		if err := cmd.Start(); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { cmd.Process.Kill(); cmd.Wait() })
		if i == 0 {
			agent = cmd.Process.Pid
		} else {
			helpers[cmd.Process.Pid] = true
		}
	}
	check := func(b []byte) bool { return len(b) > 0 && strings.Contains(string(b), "(sleep)") }
	for _, bc := range []struct {
		name string
		t    Target
	}{
		{"exclude-reads-stat", Target{Exclude: func(pid int) bool {
			if helpers[pid] {
				return true
			}
			st, err := readStat(pid)
			return err != nil || !check(st)
		}}},
		{"shared-stat", Target{ExcludeStat: func(pid int, stat func() ([]byte, error)) bool {
			if helpers[pid] {
				return true
			}
			st, err := stat()
			return err != nil || !check(st)
		}}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			for i := 0; i < b.N; i++ {
				s, err := takeSnapshot(nil, cg, false, bc.t.excluder(), nil)
				if err != nil || len(s.Procs) != 1 || s.Procs[agent] == nil {
					b.Fatalf("snapshot: %v, %d processes", err, len(s.Procs))
				}
			}
		})
	}
}
