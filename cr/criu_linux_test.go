package cr

import (
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/testenv"
	"golang.org/x/sys/unix"
)

func needCRIU(t *testing.T) *criu.Runner {
	t.Helper()
	r, err := criu.NewRunner("")
	testenv.RequireNoErr(t, err, "criu")
	t.Cleanup(func() { _ = r })
	return r
}

func TestCRIURunnerInNamespace(t *testing.T) {
	sb := startSandbox(t, "sleep", "1000")
	r := needCRIU(t)
	procs, err := descendants(sb.InitPID(), nil)
	if err != nil || len(procs) != 1 {
		t.Fatalf("procs %+v %v", procs, err)
	}
	p := procs[0]
	if err := unix.Kill(p.PID, unix.SIGSTOP); err != nil {
		t.Fatal(err)
	}
	waitUntil(ctxT(t), 10*time.Second, func() bool { st, _ := procState(p.PID); return st == 'T' })
	dir := filepath.Join(t.TempDir(), "img")
	if err := r.Dump(ctxT(t), criu.DumpOptions{NSInit: sb.InitPID(), Pid: p.NSPID, Dir: dir}); err != nil {
		t.Fatal(err)
	}
	// Without LeaveRunning criu killed it; init reaps it.
	if !waitUntil(ctxT(t), 10*time.Second, func() bool { _, err := os.Stat("/proc/" + itoa(p.PID)); return err != nil }) {
		t.Fatal("dumped process still there")
	}
	nspid, err := r.Restore(ctxT(t), criu.RestoreOptions{NSInit: sb.InitPID(), Dir: dir})
	if err != nil {
		t.Fatal(err)
	}
	if nspid != p.NSPID {
		t.Fatalf("restored ns pid %d, want %d", nspid, p.NSPID)
	}
	var got []Proc
	waitUntil(ctxT(t), 10*time.Second, func() bool {
		got, _ = descendants(sb.InitPID(), nil)
		return len(got) == 1 && got[0].PPID == sb.InitPID()
	})
	if len(got) != 1 || got[0].NSPID != p.NSPID || got[0].PPID != sb.InitPID() {
		t.Fatalf("after restore: %+v", got)
	}
	if st, _ := procState(got[0].PID); st != 'T' {
		t.Fatalf("restored state %c, want T", st)
	}
}
