package cr

import (
	"fmt"
	"os"
	"strconv"
	"strings"
	"testing"
	"time"
)

// rollup returns a field of /proc/pid/smaps_rollup in bytes.
func rollup(t testing.TB, pid int, field string) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/smaps_rollup")
	if err != nil {
		t.Fatalf("smaps_rollup of %d: %v", pid, err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if k, v, ok := strings.Cut(l, ":"); ok && k == field {
			return kbField(v)
		}
	}
	t.Fatalf("no %s in smaps_rollup of %d", field, pid)
	return 0
}

// hugeAllocFailures returns how often the kernel could not allocate a huge
// page for a collapse (all processes; /proc/vmstat).
func hugeAllocFailures(t testing.TB) int64 {
	t.Helper()
	b, err := os.ReadFile("/proc/vmstat")
	if err != nil {
		t.Fatal(err)
	}
	for _, l := range strings.Split(string(b), "\n") {
		if v, ok := strings.CutPrefix(l, "thp_collapse_alloc_failed "); ok {
			n, err := strconv.ParseInt(v, 10, 64)
			if err != nil {
				t.Fatalf("vmstat %q: %v", l, err)
			}
			return n
		}
	}
	return 0
}

// compactMemory asks the kernel to compact free memory (as root), so that
// a test's collapses find free huge pages after a run of other tests.
func compactMemory(t testing.TB) {
	t.Helper()
	if err := os.WriteFile("/proc/sys/vm/compact_memory", []byte("1"), 0); err != nil {
		t.Logf("compact_memory: %v", err)
	}
}

// waitHuge waits until e's background collapses in sb are done and returns
// how much anonymous memory pid has in huge pages then.
func waitHuge(t testing.TB, e *Engine, sb string, pid int) int64 {
	t.Helper()
	for deadline := time.Now().Add(20 * time.Second); e.Collapsing(sb) && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	return rollup(t, pid, "AnonHugePages")
}

// TestCollapseAfterCheckpoint: after a checkpoint the live process's and
// the template's dense anonymous memory end up in huge pages (so the next
// template forks copy PMDs), a sparse mapping does not (its resident size
// stays), the contents are unchanged, a restore from the collapsed template
// gives them back, and with NoCollapse nothing is collapsed.
func TestCollapseAfterCheckpoint(t *testing.T) {
	const probe = "print(len(buf), sum(buf[::4096]), buf[12345], bytes(m[i] for i in range(0, len(m), 2 << 20)).count(7))"
	setup := func(t *testing.T) (*testSandbox, session, int, string) {
		sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
		live := session{in: sb.in, out: sb.out}
		pyChat(t, live, "import mmap; buf = bytearray(b'\\x03') * (64 << 20); buf[12345] = 9")
		// A sparse private anonymous mapping: one page in every 2 MiB.
		pyChat(t, live, "m = mmap.mmap(-1, 64 << 20, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS); [m.__setitem__(i, 7) for i in range(0, len(m), 2 << 20)]")
		want := pyChat(t, live, probe)
		if want != fmt.Sprintf("%d %d 9 32", 64<<20, 3*(64<<20)/4096) {
			t.Fatalf("unexpected baseline %q", want)
		}
		compactMemory(t)
		e := newEngine(t, Config{})
		procs, err := e.Processes(sb)
		if err != nil || len(procs) != 1 {
			t.Fatalf("processes: %v %v", procs, err)
		}
		return sb, live, procs[0].PID, want
	}
	t.Run("collapse", func(t *testing.T) {
		sb, live, pid, want := setup(t)
		rss0 := rollup(t, pid, "Rss")
		e := newEngine(t, Config{})
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "a"}); err != nil {
			t.Fatal(err)
		}
		tp := e.TemplatePIDs(sb.ID())
		if len(tp) != 1 {
			t.Fatalf("template pids %v", tp)
		}
		// Most of the 64 MiB (see TestCollapseSpare).
		if got := waitHuge(t, e, sb.ID(), pid); got < 44<<20 {
			t.Fatalf("live process: %d MiB in huge pages, want >= 44", got>>20)
		}
		if got := waitHuge(t, e, sb.ID(), tp[0]); got < 44<<20 {
			t.Fatalf("template: %d MiB in huge pages, want >= 44", got>>20)
		}
		// The sparse mapping stayed sparse: 32 touched pages, not 32
		// huge pages (64 MiB).
		if rss := rollup(t, pid, "Rss"); rss > rss0+8<<20 {
			t.Fatalf("live rss grew from %d to %d MiB", rss0>>20, rss>>20)
		}
		if got := pyChat(t, live, probe); got != want {
			t.Fatalf("live after collapse: %q, want %q", got, want)
		}
		// The next template shares the huge pages.
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "b"}); err != nil {
			t.Fatal(err)
		}
		pyChat(t, live, "buf[12345] = 1; m[0] = 0")
		stdio, sessions := freshStdio(t, sb)
		for _, id := range []string{"a", "b"} {
			if _, err := e.Restore(ctxT(t), sb, id, RestoreOptions{Stdio: stdio}); err != nil {
				t.Fatal(err)
			}
			if got := pyChat(t, <-sessions, probe); got != want {
				t.Fatalf("restored %s: %q, want %q", id, got, want)
			}
		}
	})
	t.Run("not-again-at-once", func(t *testing.T) {
		// A process that wrote all over its memory after a collapse is
		// not collapsed again by the next checkpoint (recollapseAfter):
		// each collapse would copy it again.
		sb, live, pid, _ := setup(t)
		e := newEngine(t, Config{})
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "a"}); err != nil {
			t.Fatal(err)
		}
		if got := waitHuge(t, e, sb.ID(), pid); got < 44<<20 {
			t.Fatalf("live process: %d MiB in huge pages, want >= 44", got>>20)
		}
		// Template b shares the huge pages; the writes split them.
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "b"}); err != nil {
			t.Fatal(err)
		}
		waitHuge(t, e, sb.ID(), pid)
		pyChat(t, live, "[buf.__setitem__(i, 4) for i in range(0, len(buf), 4096)]")
		split := rollup(t, pid, "AnonHugePages")
		if split > 16<<20 {
			t.Fatalf("writes to shared huge pages left %d MiB huge", split>>20)
		}
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c"}); err != nil {
			t.Fatal(err)
		}
		if got := waitHuge(t, e, sb.ID(), pid); got > split {
			t.Fatalf("collapsed again at once: %d MiB huge, was %d", got>>20, split>>20)
		}
	})
	t.Run("off", func(t *testing.T) {
		sb, live, pid, want := setup(t)
		e := newEngine(t, Config{NoCollapse: true})
		if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "a"}); err != nil {
			t.Fatal(err)
		}
		time.Sleep(300 * time.Millisecond)
		if got := rollup(t, pid, "AnonHugePages"); got != 0 {
			t.Fatalf("NoCollapse: %d MiB in huge pages", got>>20)
		}
		if got := pyChat(t, live, probe); got != want {
			t.Fatalf("live: %q, want %q", got, want)
		}
	})
}

// TestCollapseSpare: a warm spare's dense memory is its own huge pages
// (the warm-up by collapse), its contents are the template's.
func TestCollapseSpare(t *testing.T) {
	sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
	live := session{in: sb.in, out: sb.out}
	pyChat(t, live, "buf = bytearray(b'\\x05') * (48 << 20); buf[777] = 1")
	const probe = "print(len(buf), sum(buf[::4096]), buf[777])"
	want := pyChat(t, live, probe)
	compactMemory(t)
	failed0 := hugeAllocFailures(t)
	e := newEngine(t, Config{Warm: true})
	if _, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "w"}); err != nil {
		t.Fatal(err)
	}
	for deadline := time.Now().Add(20 * time.Second); !e.SparesReady(sb.ID()); time.Sleep(10 * time.Millisecond) {
		if time.Now().After(deadline) {
			t.Fatal("no spare")
		}
	}
	pyChat(t, live, "buf[777] = 2")
	stdio, sessions := freshStdio(t, sb)
	res, err := e.Restore(ctxT(t), sb, "w", RestoreOptions{Stdio: stdio})
	if err != nil {
		t.Fatal(err)
	}
	if len(res.Procs) != 1 {
		t.Fatalf("restored %v", res.Procs)
	}
	// Most of it: a range stays small when the kernel has no free huge
	// page for it even when asked again (beside other tests), which the
	// kernel counts; at most 8 such ranges are allowed for.
	failed := min(hugeAllocFailures(t)-failed0, 8)
	if got, want := rollup(t, res.Procs[0].PID, "AnonHugePages"), 32<<20-failed*hugeSize; got < want {
		t.Fatalf("restored spare: %d MiB in huge pages, want >= %d (%d huge-page allocations failed meanwhile)", got>>20, want>>20, failed)
	}
	if got := pyChat(t, <-sessions, probe); got != want {
		t.Fatalf("restored: %q, want %q", got, want)
	}
}
