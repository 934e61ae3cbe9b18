package cr

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"sync"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Huge pages for checkpointed memory.
//
// fork() copies a process's page tables, so a template fork, a restore
// from a template and the kill of a live process all grow with the number
// of 4 KiB pages mapped: a fork of a 200 MB Python heap costs 4-6 ms on the
// CI machine. The same heap mapped with transparent huge pages forks in
// about 0.2 ms (one PMD per 2 MiB instead of 512 PTEs), and a write to a
// huge page shared with a copy only splits that 2 MiB (about 20 µs) before
// the usual 4 KiB copy-on-write. The host's THP mode is usually "madvise",
// so anonymous memory stays in small pages; MADV_COLLAPSE (through
// process_madvise, on another process, Linux >= 6.1) asks the kernel to
// move a range into a huge page now, with its contents unchanged. It is
// best effort, the kernel refuses ranges the process opted out of
// (MADV_NOHUGEPAGE, PR_SET_THP_DISABLE, THP "never"), and it ignores the
// khugepaged limits on empty ptes, so only dense ranges are asked for:
// collapsing a sparse range would turn each present page into 2 MiB of
// resident memory.

const (
	hugeSize = 2 << 20
	// madvCollapse is MADV_COLLAPSE (Linux 6.1).
	madvCollapse = 25
	// collapseMinPresent is how many of a 2 MiB range's 512 pages must be
	// present for the range to be collapsed (at most 6% more memory).
	collapseMinPresent = 480
	// collapseWorth is how much dense anonymous memory not yet in huge
	// pages makes a collapse worth its copying (about 0.4 ms of page-table
	// copying per fork on the CI machine).
	collapseWorth = 16 << 20
	// recollapseAfter is how long after a collapse of a live process its
	// memory is not collapsed again: each collapse copies the ranges its
	// writes split since, and the older templates keep their own copy of
	// those, so a process writing all over its memory would otherwise make
	// every checkpoint cost a copy of it.
	recollapseAfter = 10 * time.Second
	// collapseRetryAfter is how long a collapse waits before asking again
	// for the ranges the kernel refused for a passing reason.
	collapseRetryAfter = 20 * time.Millisecond
)

// hugeRange is a 2 MiB-aligned range of a process's anonymous memory.
type hugeRange struct{ start uint64 }

// anonArea is one private anonymous writable mapping and the memory of it
// that is not mapped with huge pages yet (from smaps).
type anonArea struct {
	start, end uint64
	small      int64 // Anonymous - AnonHugePages, bytes
}

// anonAreas lists pid's private anonymous writable mappings (the heap and
// unnamed mappings; not the stack, file-backed or special ones) with the
// anonymous memory of each that is not in huge pages.
func anonAreas(pid int) ([]anonArea, error) {
	f, err := os.Open("/proc/" + strconv.Itoa(pid) + "/smaps")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	var out []anonArea
	var cur *anonArea
	var anon, huge int64
	flush := func() {
		if cur != nil {
			cur.small = anon - huge
			out = append(out, *cur)
		}
		cur, anon, huge = nil, 0, 0
	}
	s := bufio.NewScanner(f)
	s.Buffer(make([]byte, 64<<10), 1<<20)
	for s.Scan() {
		line := s.Text()
		k, v, ok := strings.Cut(line, ":")
		if ok && !strings.Contains(k, " ") && !strings.Contains(k, "-") {
			// A "Key:   value kB" line of the current mapping.
			if cur == nil {
				continue
			}
			switch k {
			case "Anonymous":
				anon = kbField(v)
			case "AnonHugePages":
				huge = kbField(v)
			}
			continue
		}
		// A mapping header: "start-end perms offset dev inode [name]".
		flush()
		fs := strings.Fields(line)
		if len(fs) < 5 || fs[1] != "rw-p" {
			continue
		}
		if len(fs) >= 6 && fs[5] != "[heap]" && !strings.HasPrefix(fs[5], "[anon:") {
			continue
		}
		start, end, ok := parseRange(fs[0])
		if !ok {
			continue
		}
		cur = &anonArea{start: start, end: end}
	}
	flush()
	return out, s.Err()
}

func kbField(v string) int64 {
	fs := strings.Fields(v)
	if len(fs) == 0 {
		return 0
	}
	n, _ := strconv.ParseInt(fs[0], 10, 64)
	return n << 10
}

// smallAnon is how much of pid's anonymous memory in collapsible mappings
// is not mapped with huge pages.
func smallAnon(pid int) int64 {
	areas, err := anonAreas(pid)
	if err != nil {
		return 0
	}
	var n int64
	for _, a := range areas {
		if a.end-a.start >= hugeSize {
			n += a.small
		}
	}
	return n
}

// denseRanges returns the 2 MiB-aligned ranges of pid's anonymous mappings
// that have at least minPresent of their 512 pages present (from pagemap;
// ranges already mapped by a huge page are among them).
func denseRanges(pid int, minPresent int) ([]hugeRange, error) {
	areas, err := anonAreas(pid)
	if err != nil {
		return nil, err
	}
	pm, err := os.Open("/proc/" + strconv.Itoa(pid) + "/pagemap")
	if err != nil {
		return nil, err
	}
	defer pm.Close()
	const per = hugeSize / pageSize
	ents := make([]byte, per*8)
	var out []hugeRange
	for _, a := range areas {
		for r := (a.start + hugeSize - 1) &^ (hugeSize - 1); r+hugeSize <= a.end; r += hugeSize {
			if _, err := pm.ReadAt(ents, int64(r/pageSize*8)); err != nil {
				break
			}
			present := 0
			for i := 0; i < per; i++ {
				if binary.LittleEndian.Uint64(ents[i*8:])&(1<<63) != 0 {
					present++
				}
			}
			if present >= minPresent {
				out = append(out, hugeRange{start: r})
			}
		}
	}
	return out, nil
}

// collapser collapses ranges of one process, found by its pidfd so that a
// pid reused after the process exits is never touched.
type collapser struct{ pidfd int }

func openCollapser(pid int) (*collapser, error) {
	fd, err := unix.PidfdOpen(pid, 0)
	if err != nil {
		return nil, fmt.Errorf("pidfd_open %d: %w", pid, err)
	}
	return &collapser{pidfd: fd}, nil
}

func (c *collapser) close() { unix.Close(c.pidfd) }

// collapse asks for one range; already huge ranges succeed at once.
func (c *collapser) collapse(r hugeRange) error {
	// Addresses of another process: a raw iovec, never a Go pointer.
	iov := struct{ base, len uint64 }{r.start, hugeSize}
	_, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(c.pidfd), uintptr(unsafe.Pointer(&iov)), 1, madvCollapse, 0, 0)
	if errno != 0 {
		return errno
	}
	return nil
}

// CollapseStats says what Collapse did.
type CollapseStats struct {
	// Ranges is how many dense 2 MiB ranges were asked for; Collapsed how
	// many of them are now mapped with a huge page; Refused how many the
	// kernel refused (even when asked again).
	Ranges, Collapsed, Refused int
}

// Collapse maps the dense anonymous memory of pid (a running or stopped
// process) with transparent huge pages, 2 MiB at a time, without changing
// its contents; see the comment at the top of collapse_linux.go. keepOn is
// asked before each range and stops the work when it returns false (nil:
// never). Ranges the kernel refuses are skipped; the error is nil unless
// pid's memory could not be read or no range could be collapsed because
// the kernel lacks MADV_COLLAPSE.
func Collapse(pid int, keepOn func() bool) (CollapseStats, error) {
	st, _, err := collapse(pid, keepOn)
	return st, err
}

func collapse(pid int, keepOn func() bool) (CollapseStats, map[uint64]bool, error) {
	c, err := openCollapser(pid)
	if err != nil {
		return CollapseStats{}, nil, err
	}
	defer c.close()
	return c.run(pid, keepOn, nil, false)
}

// run collapses the dense ranges of c's process (pid, as c was opened for),
// each while holding guard when it is not nil. With unshare (pid must be
// stopped) each range's first page is written back first: a range mapped
// by a huge page that pid shares with another process (a spare and its
// template) is then split and collapsed into a huge page of pid's own,
// where MADV_COLLAPSE alone would leave it shared.
func (c *collapser) run(pid int, keepOn func() bool, guard sync.Locker, unshare bool) (CollapseStats, map[uint64]bool, error) {
	var st CollapseStats
	rs, err := denseRanges(pid, collapseMinPresent)
	if err != nil || len(rs) == 0 {
		return st, nil, err
	}
	done := make(map[uint64]bool, len(rs))
	page := make([]byte, pageSize)
	one := func(r hugeRange) error {
		if guard != nil {
			guard.Lock()
			defer guard.Unlock()
		}
		if unshare {
			_ = rewrite(pid, r.start, page)
		}
		err := c.collapse(r)
		for try := 0; try < 2 && errors.Is(err, unix.EAGAIN); try++ {
			// A page was busy (locked, or not on an LRU list yet).
			err = c.collapse(r)
		}
		return err
	}
	// Ranges refused for a passing reason are asked for once more after
	// the others: EAGAIN (a page was locked or isolated, as by another
	// collapse of a page both processes share), ENOMEM (no huge page
	// free then; compaction may have made one since).
	var again []hugeRange
	for pass := 0; pass < 2; pass++ {
		todo := rs
		if pass == 1 {
			if len(again) == 0 {
				break
			}
			todo, again = again, nil
			time.Sleep(collapseRetryAfter)
		}
		for _, r := range todo {
			if keepOn != nil && !keepOn() {
				return st, done, nil
			}
			if pass == 0 {
				st.Ranges++
			}
			err := one(r)
			switch {
			case err == nil:
				st.Collapsed++
				done[r.start] = true
			case errors.Is(err, unix.ESRCH):
				return st, done, fmt.Errorf("collapse %d: %w", pid, err)
			case errors.Is(err, unix.EINVAL) && st.Collapsed == 0 && st.Ranges == 1:
				// No MADV_COLLAPSE, THP off, or the process opted out:
				// asking for the other ranges would fail the same way.
				return st, done, fmt.Errorf("collapse %d: %w", pid, err)
			case errors.Is(err, unix.EAGAIN), errors.Is(err, unix.ENOMEM):
				if pass == 0 {
					again = append(again, r)
				} else {
					st.Refused++
				}
			default:
				st.Refused++
			}
		}
	}
	return st, done, nil
}

// goCollapse collapses, in the background, the memory of the processes
// tmpls were just forked from and then of tmpls themselves, for each whose
// dense anonymous memory in small pages is worth it (collapseWorth). The
// original goes first: its pages are then its own, and the template's
// collapse that follows copies pages no other process maps (no second
// copy of the memory is made for it). Pids are taken by pidfd now, while
// the processes are known to be the sandbox's. Each 2 MiB is collapsed
// under the sandbox's lock: a collapse holds the process's mmap lock, which
// a template fork needs, so a checkpoint or restore waits for at most one
// range (about 0.5 ms) instead of contending with the whole collapse.
func (e *Engine) goCollapse(sb string, tmpls []*template) {
	// A job is an original and then its template; the template is
	// collapsed only after its original was (otherwise its pages are
	// still shared with the original and collapsing would copy them).
	type job struct {
		pids [2]int
		cs   [2]*collapser
	}
	var jobs []job
	now := time.Now()
	e.mu.Lock()
	if e.closing {
		e.mu.Unlock()
		return
	}
	for pid, t := range e.lastCollapse {
		if now.Sub(t) > recollapseAfter {
			delete(e.lastCollapse, pid)
		}
	}
	for _, tm := range tmpls {
		pids := [2]int{tm.orig.PID, tm.proc.Pid()}
		if _, busy := e.collapsing[pids[0]]; busy {
			continue
		}
		if _, recent := e.lastCollapse[pids[0]]; recent {
			continue
		}
		var j job
		for i, pid := range pids {
			c, err := openCollapser(pid)
			if err != nil {
				break
			}
			j.pids[i], j.cs[i] = pid, c
		}
		if j.cs[1] == nil {
			if j.cs[0] != nil {
				j.cs[0].close()
			}
			continue
		}
		e.collapsing[pids[0]], e.collapsing[pids[1]] = sb, sb
		jobs = append(jobs, j)
	}
	if len(jobs) == 0 {
		e.mu.Unlock()
		return
	}
	e.bg.Add(1)
	e.mu.Unlock()
	go func() {
		defer e.bg.Done()
		l := e.sandboxLock(sb)
		keepOn := func() bool { return e.life.Err() == nil }
		for _, j := range jobs {
			for i, pid := range j.pids {
				if keepOn() && smallAnon(pid) >= collapseWorth {
					st, _, err := j.cs[i].run(pid, keepOn, l, false)
					e.log.Debug("collapse", "pid", pid, "template", i == 1, "ranges", st.Ranges, "collapsed", st.Collapsed, "refused", st.Refused, "err", err)
					if i == 0 {
						e.mu.Lock()
						e.lastCollapse[pid] = time.Now()
						e.mu.Unlock()
					}
				} else if i == 0 && smallAnon(j.pids[1]) >= collapseWorth {
					// The original was not collapsed: leave the
					// template sharing its pages.
					j.cs[1].close()
					j.cs[1] = nil
					break
				}
			}
			e.mu.Lock()
			for i, pid := range j.pids {
				if j.cs[i] != nil {
					j.cs[i].close()
				}
				delete(e.collapsing, pid)
			}
			e.mu.Unlock()
		}
	}()
}

// warmSpare breaks a spare's copy-on-write sharing with its template before
// it is needed: dense ranges by collapsing them into huge pages of its own
// (unless NoCollapse; a range the template maps with a huge page is split
// in the spare first, see collapser.run), the rest by Prefault.
func (e *Engine) warmSpare(pid int) {
	var done map[uint64]bool
	if !e.cfg.NoCollapse {
		c, err := openCollapser(pid)
		if err == nil {
			var st CollapseStats
			st, done, err = c.run(pid, func() bool { return e.life.Err() == nil }, nil, true)
			c.close()
			e.log.Debug("collapse spare", "pid", pid, "ranges", st.Ranges, "collapsed", st.Collapsed, "refused", st.Refused, "err", err)
		}
	}
	if err := prefault(pid, done); err != nil {
		e.log.Debug("prefault spare", "pid", pid, "err", err)
	}
}

// Collapsing reports whether a background collapse of the memory of
// sandbox sb's processes or templates is running (see Config.NoCollapse).
func (e *Engine) Collapsing(sb string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, s := range e.collapsing {
		if s == sb {
			return true
		}
	}
	return false
}
