package probe

import (
	"errors"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/internal/testenv"
)

func openBoth(t *testing.T) []Probe {
	testenv.RequireRoot(t)
	u, err := Open(Options{Backend: BackendUserspace})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { u.Close() })
	e, err := Open(Options{Backend: BackendEBPF})
	testenv.RequireNoErr(t, err, "eBPF probe")
	t.Cleanup(func() { e.Close() })
	return []Probe{u, e}
}

func TestWindowRules(t *testing.T) {
	for _, p := range openBoth(t) {
		t.Run(p.Backend(), func(t *testing.T) {
			cg := newCgroup(t)
			tg := Target{Sandbox: "rules", CgroupV2Dir: cg, FS: NewDirSource(t.TempDir())}
			w, err := p.Begin(tg)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := p.Begin(tg); !errors.Is(err, ErrWindowOpen) {
				t.Fatalf("second Begin: %v, want ErrWindowOpen", err)
			}
			w.Abort()
			w.Abort()
			if _, err := w.End(); !errors.Is(err, ErrClosed) {
				t.Fatalf("End after Abort: %v", err)
			}
			var last uint64
			for i := 0; i < 3; i++ {
				w, err := p.Begin(tg)
				if err != nil {
					t.Fatal(err)
				}
				r, err := w.End()
				if err != nil {
					t.Fatal(err)
				}
				// Turns are numbered 1, 2, 3: the aborted window's number
				// went back.
				if r.Turn != last+1 {
					t.Fatalf("turn %d after %d", r.Turn, last)
				}
				last = r.Turn
				if _, err := w.End(); !errors.Is(err, ErrClosed) {
					t.Fatalf("second End: %v", err)
				}
			}
			// The daemon's turn: End opens the next window (Next), which
			// rewind's own work then replaces (Abort, Begin): still one
			// number per turn.
			w, err = p.Begin(tg)
			if err != nil {
				t.Fatal(err)
			}
			for i := 0; i < 3; i++ {
				r, next, err := w.Next()
				if err != nil {
					t.Fatal(err)
				}
				if r.Turn != last+1 {
					t.Fatalf("turn %d after %d (Next, Abort, Begin)", r.Turn, last)
				}
				last = r.Turn
				next.Abort()
				if w, err = p.Begin(tg); err != nil {
					t.Fatal(err)
				}
			}
			w.Abort()
		})
	}
}

func TestUserspaceWithoutFSSourceIsNeverSkippable(t *testing.T) {
	testenv.RequireRoot(t)
	p, _ := NewUserspace(Options{})
	defer p.Close()
	w, err := p.Begin(Target{Sandbox: "nofs", CgroupV2Dir: newCgroup(t)})
	if err != nil {
		t.Fatal(err)
	}
	r, err := w.End()
	if err != nil {
		t.Fatal(err)
	}
	if r.LostEvents != 1 {
		t.Fatalf("LostEvents = %d, want 1", r.LostEvents)
	}
}

func TestExclude(t *testing.T) {
	for _, p := range openBoth(t) {
		t.Run(p.Backend(), func(t *testing.T) {
			cg, dir := newCgroup(t), t.TempDir()
			bash := startShell(t, cg, dir, false)
			isSleep := func(pid int) bool {
				b, _ := os.ReadFile("/proc/" + itoa(pid) + "/comm")
				return strings.TrimSpace(string(b)) == "sleep"
			}
			w, err := p.Begin(Target{Sandbox: "excl", CgroupV2Dir: cg, FS: NewDirSource(dir), Exclude: isSleep})
			if err != nil {
				t.Fatal(err)
			}
			bash.run("sleep 3600 & while [ \"$(cat /proc/$!/comm)\" != sleep ]; do :; done")
			r, err := w.End()
			if err != nil {
				t.Fatal(err)
			}
			if r.Proc.NewLongLived != 0 || r.Proc.Alive != 1 {
				t.Fatalf("excluded process counted: %+v", r.Proc)
			}
		})
	}
}

func itoa(i int) string { return strconv.Itoa(i) }

func TestEBPFSandboxesAreIsolated(t *testing.T) {
	testenv.RequireRoot(t)
	p, err := OpenEBPF(Options{})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer p.Close()
	cgA, cgB := newCgroup(t), newCgroup(t)
	dirA, dirB := t.TempDir(), t.TempDir()
	bashB := startShell(t, cgB, dirB, false)
	wA, err := p.Begin(Target{Sandbox: "A", CgroupV2Dir: cgA})
	if err != nil {
		t.Fatal(err)
	}
	wB, err := p.Begin(Target{Sandbox: "B", CgroupV2Dir: cgB})
	if err != nil {
		t.Fatal(err)
	}
	runIn(t, cgA, dirA, "mkdir", "x")
	rA, err := wA.End()
	if err != nil {
		t.Fatal(err)
	}
	bashB.run("true")
	rB, err := wB.End()
	if err != nil {
		t.Fatal(err)
	}
	if rA.FS.Created != 1 || rA.Proc.Execs != 1 || len(rA.Proc.ExecSamples) != 1 || rA.Proc.ExecSamples[0].Comm != "mkdir" {
		t.Errorf("A: %+v %+v", rA.FS, rA.Proc)
	}
	if rB.FSChanged() || rB.Proc.Execs != 0 || len(rB.Proc.ExecSamples) != 0 || rB.Proc.Alive != 1 {
		t.Errorf("B saw A's effects: %+v %+v", rB.FS, rB.Proc)
	}
}

func TestEBPFForkStormIsBounded(t *testing.T) {
	testenv.RequireRoot(t)
	p, err := OpenEBPF(Options{})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer p.Close()
	cg := newCgroup(t)
	w, err := p.Begin(Target{Sandbox: "storm", CgroupV2Dir: cg})
	if err != nil {
		t.Fatal(err)
	}
	runIn(t, cg, t.TempDir(), "sh", "-c", "i=0; while [ $i -lt 300 ]; do /bin/true; i=$((i+1)); done")
	r, err := w.End()
	if err != nil {
		t.Fatal(err)
	}
	if r.Proc.Forked < 300 || r.Proc.Execs < 301 || len(r.Proc.ExecSamples) != effect.MaxSamples || r.LostEvents != 0 {
		t.Fatalf("forked %d execs %d samples %d lost %d", r.Proc.Forked, r.Proc.Execs, len(r.Proc.ExecSamples), r.LostEvents)
	}
}

func TestEBPFLostEventsAreReported(t *testing.T) {
	testenv.RequireRoot(t)
	pr, err := OpenEBPF(Options{RingBufferBytes: os.Getpagesize()})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer pr.Close()
	p := pr.(*ebpfProbe)
	cg, dir := newCgroup(t), t.TempDir()
	w, err := p.Begin(Target{Sandbox: "lossy", CgroupV2Dir: cg})
	if err != nil {
		t.Fatal(err)
	}
	// Stall the ring-buffer reader (it blocks dispatching its first
	// record) while the turn emits more samples than a page holds.
	p.mu.Lock()
	runIn(t, cg, dir, "sh", "-c", "mkdir d && cd d && i=0; while [ $i -lt 100 ]; do echo $i > f$i; i=$((i+1)); done")
	p.mu.Unlock()
	r, err := w.End()
	if err != nil {
		t.Fatal(err)
	}
	if r.LostEvents == 0 || r.FS.Created != 101 {
		t.Fatalf("lost %d created %d", r.LostEvents, r.FS.Created)
	}
	if _, err := os.Stat(filepath.Join(dir, "d", "f99")); err != nil {
		t.Fatal(err)
	}
}

func TestNextSplitsTurns(t *testing.T) {
	for _, p := range openBoth(t) {
		t.Run(p.Backend(), func(t *testing.T) {
			cg, dir := newCgroup(t), t.TempDir()
			bash := startShell(t, cg, dir, false)
			tg := Target{Sandbox: "next", CgroupV2Dir: cg, FS: NewDirSource(dir)}
			w, err := p.Begin(tg)
			if err != nil {
				t.Fatal(err)
			}
			turns := []struct {
				cmd              string
				created, cwd, nl uint64
			}{
				{"mkdir a", 1, 0, 0},
				{"cd a", 0, 1, 0},
				{"true", 0, 0, 0},
				{"sleep 3600 &", 0, 0, 1},
			}
			var last uint64
			for i, tc := range turns {
				bash.run(tc.cmd)
				r, nw, err := w.Next()
				if err != nil {
					t.Fatalf("turn %d: %v", i, err)
				}
				if _, _, err := w.Next(); !errors.Is(err, ErrClosed) {
					t.Fatalf("Next on a finished window: %v", err)
				}
				w = nw
				if r.Turn <= last {
					t.Fatalf("turn %d after %d", r.Turn, last)
				}
				last = r.Turn
				if r.FS.Created != tc.created || r.Proc.CwdChanges != tc.cwd || r.Proc.NewLongLived != tc.nl {
					t.Errorf("%q: created %d cwd %d new %d, want %d %d %d", tc.cmd, r.FS.Created, r.Proc.CwdChanges, r.Proc.NewLongLived, tc.created, tc.cwd, tc.nl)
				}
			}
			if _, err := w.End(); err != nil {
				t.Fatal(err)
			}
			if _, err := p.Begin(tg); err != nil {
				t.Fatalf("Begin after End: %v", err)
			}
		})
	}
}

// TestShortLivedProcesses checks that both backends count processes born
// and dead within the turn (the userspace backend through the proc
// connector).
func TestShortLivedProcesses(t *testing.T) {
	for _, p := range openBoth(t) {
		t.Run(p.Backend(), func(t *testing.T) {
			cg, dir := newCgroup(t), t.TempDir()
			writeFile(t, filepath.Join(dir, "f"), "x\n")
			bash := startShell(t, cg, dir, false)
			w, err := p.Begin(Target{Sandbox: "short", CgroupV2Dir: cg, FS: NewDirSource(dir)})
			if err != nil {
				t.Fatal(err)
			}
			bash.run("cat f >/dev/null; ls >/dev/null; (sleep 0.3)")
			r, err := w.End()
			if err != nil {
				t.Fatal(err)
			}
			// The userspace backend reads comm from /proc when the exec is
			// reported: a process that ran briefly may be gone by then.
			comms := map[string]bool{}
			for _, x := range r.Proc.ExecSamples {
				comms[x.Comm] = true
			}
			okComms := comms["sleep"] && (p.Backend() == BackendUserspace || comms["cat"] && comms["ls"])
			if r.Proc.Forked < 3 || r.Proc.Execs < 3 || !okComms || r.Proc.NewLongLived != 0 || r.LostEvents != 0 {
				t.Fatalf("forked %d execs %d samples %+v new %d lost %d", r.Proc.Forked, r.Proc.Execs, r.Proc.ExecSamples, r.Proc.NewLongLived, r.LostEvents)
			}
		})
	}
}

// TestEBPFSamplesTaken: a window knows from its counters whether any
// sample was taken (End then waits for the reader), and the samples of a
// window that took some are all in its report.
func TestEBPFSamplesTaken(t *testing.T) {
	testenv.RequireRoot(t)
	p, err := OpenEBPF(Options{})
	testenv.RequireNoErr(t, err, "eBPF probe")
	defer p.Close()
	cg, dir := newCgroup(t), t.TempDir()
	bash := startShell(t, cg, dir, false)
	for _, tc := range []struct {
		name  string
		cmd   string // run in the persistent shell; "" runs nothing
		taken bool
		execs int
	}{
		{name: "idle", taken: false},
		{name: "builtin", cmd: "x=1", taken: false},
		{name: "exec", cmd: "/bin/true", taken: true, execs: 1},
		{name: "two execs", cmd: "/bin/true; /bin/true", taken: true, execs: 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			w, err := p.Begin(Target{Sandbox: "samples", CgroupV2Dir: cg, FS: NewDirSource(dir)})
			if err != nil {
				t.Fatal(err)
			}
			if tc.cmd != "" {
				bash.run(tc.cmd)
			}
			if got := w.(*ebpfWindow).samplesTaken(); got != tc.taken {
				t.Errorf("samplesTaken = %v, want %v", got, tc.taken)
			}
			r, err := w.End()
			if err != nil {
				t.Fatal(err)
			}
			if int(r.Proc.Execs) != tc.execs || len(r.Proc.ExecSamples) != tc.execs {
				t.Errorf("execs %d, samples %+v, want %d of each", r.Proc.Execs, r.Proc.ExecSamples, tc.execs)
			}
		})
	}
}
