package cr

import (
	"fmt"
	"testing"
	"time"
)

// TestParkKeepsTheLiveTree: a parked checkpoint of a process tree (a shell
// with a background job: no template fork can copy it) holds the live
// processes themselves, stopped and no longer listed as live; restoring
// another checkpoint leaves them alone, restoring the parked one lets the
// very same processes run on, and dropping a parked checkpoint kills them.
func TestParkKeepsTheLiveTree(t *testing.T) {
	sb := startSandbox(t, "bash", "--norc", "--noprofile")
	live := session{in: sb.in, out: sb.out}
	x := t.TempDir()
	bashChat(t, live, "export V=0")
	e := newEngine(t, Config{Logger: testLogger()})
	if ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "plain"}); err != nil || ck.Mode != ModeTemplate {
		t.Fatalf("template checkpoint %+v: %v", ck, err)
	}
	bashChat(t, live, fmt.Sprintf("cd %s; export V=1; sleep 1000 & BG=$!", x))
	barrier := 0
	ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "undo", Ephemeral: true, Park: true, Barrier: func() error { barrier++; return nil }})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Mode != ModeParked || len(ck.Procs) != 2 || barrier != 1 {
		t.Fatalf("parked checkpoint %+v, barrier ran %d times", ck, barrier)
	}
	if ps, err := e.Processes(sb); err != nil || len(ps) != 0 {
		t.Fatalf("live processes while parked: %+v %v", ps, err)
	}
	for _, p := range ck.Procs {
		if st, err := procState(p.PID); err != nil || st != 't' {
			t.Fatalf("parked process %d: state %c %v, want a ptrace stop", p.PID, st, err)
		}
	}
	if parts, err := e.Parts("undo"); err != nil || !parts.Template {
		t.Fatalf("parts of the parked checkpoint %+v %v", parts, err)
	}

	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, "plain", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if res.Path != "template" || len(res.Procs) != 1 {
		t.Fatalf("restore of the template checkpoint %+v", res)
	}
	if got := bashChat(t, <-sessions, `echo "$V $(jobs -p | wc -l)"`); got != "0 0" {
		t.Fatalf("restored shell: %q", got)
	}
	for _, p := range ck.Procs {
		if exiting(p.PID) {
			t.Fatalf("parked process %d died in a restore of another checkpoint", p.PID)
		}
	}

	res2, err := e.Restore(ctxT(t), sb, "undo", RestoreOptions{})
	if err != nil {
		t.Fatal(err)
	}
	if len(res2.Procs) != 2 || res2.Procs[0].PID != ck.Procs[0].PID || res2.Procs[1].PID != ck.Procs[1].PID {
		t.Fatalf("restore of the parked checkpoint %+v, parked %+v", res2, ck.Procs)
	}
	want := x + " 1 1"
	if got := bashChat(t, live, `kill -0 $BG && echo "$PWD $V $(jobs -p | wc -l)"`); got != want {
		t.Fatalf("the parked shell after its restore: %q, want %q", got, want)
	}
	if !waitUntil(ctxT(t), 5*time.Second, func() bool { return exiting(res.Procs[0].PID) }) {
		t.Fatalf("the copy of the template checkpoint %d survived the restore", res.Procs[0].PID)
	}
	if ps, err := e.Processes(sb); err != nil || len(ps) != 2 {
		t.Fatalf("live processes after the parked restore: %+v %v", ps, err)
	}
	if _, err := e.Restore(ctxT(t), sb, "undo", RestoreOptions{}); err == nil {
		t.Fatal("a parked checkpoint restored twice")
	}
	e.Drop("undo") // resumed: dropping it kills nothing
	if got := bashChat(t, live, `kill -0 $BG && echo "$V"`); got != "1" {
		t.Fatalf("shell after dropping its resumed checkpoint: %q", got)
	}

	ck2, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "undo2", Ephemeral: true, Park: true})
	if err != nil || ck2.Mode != ModeParked {
		t.Fatalf("second park %+v: %v", ck2, err)
	}
	e.Drop("undo2")
	for _, p := range ck2.Procs {
		if !waitUntil(ctxT(t), 5*time.Second, func() bool { return exiting(p.PID) }) {
			t.Fatalf("parked process %d survived the drop of its checkpoint", p.PID)
		}
	}
	if ps, err := e.Processes(sb); err != nil || len(ps) != 0 {
		t.Fatalf("live processes after the drop: %+v %v", ps, err)
	}
}

// TestParkNeedsOneThreadEach: a multi-threaded process cannot be held by
// one ptrace stop, so Park is ignored and the checkpoint takes its usual
// path.
func TestParkNeedsOneThreadEach(t *testing.T) {
	needCRIU(t)
	sb := startSandbox(t, "python3", "-c", "import threading, time\nthreading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\ntime.sleep(1000)")
	e := newEngine(t, Config{ImagesDir: t.TempDir(), Logger: testLogger()})
	var ck *Checkpoint
	var err error
	if !waitUntil(ctxT(t), 10*time.Second, func() bool {
		ps, _ := e.Processes(sb)
		return len(ps) == 1 && ps[0].Threads == 2
	}) {
		t.Fatal("the second thread did not start")
	}
	ck, err = e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "mt", Ephemeral: true, Park: true})
	if err != nil {
		t.Fatal(err)
	}
	if ck.Mode != ModeCRIU {
		t.Fatalf("checkpoint of a multi-threaded process with Park: mode %s, want %s", ck.Mode, ModeCRIU)
	}
	if ps, err := e.Processes(sb); err != nil || len(ps) != 1 {
		t.Fatalf("live processes: %+v %v", ps, err)
	}
}
