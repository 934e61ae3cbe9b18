package probe

import (
	"sort"

	"github.com/rewind-sandbox/rewind/effect"
)

// snapDiff is what comparing two snapshots yields beyond the report fields
// it fills.
type snapDiff struct {
	// New counts processes alive at End that did not exist at Begin.
	New uint64
	// Reexec counts processes alive at both ends whose comm changed (they
	// exec'd during the turn).
	Reexec uint64
	// NewExecs describes up to MaxSamples new or re-exec'd processes.
	NewExecs []effect.Exec
}

// applySnapshots fills the snapshot-derived fields of r (Proc.Alive,
// NewLongLived, LongLived, Exited, CwdChanges; Mem.PagesWritten, PerProc;
// Net from sockets when both snapshots have socket tables) by comparing the
// sandbox's processes at Begin and at End. Both backends use it, so they
// agree on these fields.
func applySnapshots(r *effect.Report, begin, end *snapshot, initPID int) snapDiff {
	var d snapDiff
	r.Proc.Alive = uint64(len(end.Procs))
	for pid, b := range begin.Procs {
		if e, ok := end.Procs[pid]; !ok || e.StartTime != b.StartTime {
			r.Proc.Exited++
		}
	}
	pids := make([]int, 0, len(end.Procs))
	for pid := range end.Procs {
		pids = append(pids, pid)
	}
	sort.Ints(pids)
	var per []effect.ProcPages
	for _, pid := range pids {
		e := end.Procs[pid]
		b, ok := begin.Procs[pid]
		survivor := ok && b.StartTime == e.StartTime
		var pages uint64
		if survivor {
			if e.Cwd != b.Cwd {
				r.Proc.CwdChanges++
			}
			if e.Comm != b.Comm {
				d.Reexec++
				d.NewExecs = appendExec(d.NewExecs, e)
			}
			if e.MinFlt > b.MinFlt {
				pages = e.MinFlt - b.MinFlt
			}
			if pages == 0 && (e.RunNS != b.RunNS || e.Slices != b.Slices) {
				// It ran: it may have rewritten pages it had already
				// dirtied, which costs no fault. Count at least one.
				pages = 1
			}
		} else {
			d.New++
			r.Proc.NewLongLived++
			ex := effect.Exec{PID: pid, Comm: e.Comm, Argv0: e.Argv0}
			if len(r.Proc.LongLived) < effect.MaxSamples {
				r.Proc.LongLived = append(r.Proc.LongLived, ex)
			}
			d.NewExecs = appendExec(d.NewExecs, e)
			pages = e.MinFlt
			if pages == 0 {
				pages = 1
			}
		}
		if pid == initPID || pages == 0 {
			continue
		}
		r.Mem.PagesWritten += pages
		per = append(per, effect.ProcPages{PID: pid, Comm: e.Comm, Pages: pages})
	}
	sort.SliceStable(per, func(i, j int) bool { return per[i].Pages > per[j].Pages })
	if len(per) > effect.MaxSamples {
		per = per[:effect.MaxSamples]
	}
	r.Mem.PerProc = per
	return d
}

// applySockets fills Net.Listens, RemoteConnects and Remotes from the
// sockets held at End that were not held at Begin.
func applySockets(r *effect.Report, begin, end *snapshot) {
	inos := make([]uint64, 0, len(end.Socks))
	for ino := range end.Socks {
		if _, old := begin.Socks[ino]; !old {
			inos = append(inos, ino)
		}
	}
	sort.Slice(inos, func(i, j int) bool { return inos[i] < inos[j] })
	for _, ino := range inos {
		s := end.Socks[ino]
		switch {
		case s.Listen:
			r.Net.Listens++
		case s.Remote != "":
			r.Net.RemoteConnects++
			r.Net.Remotes = appendRemote(r.Net.Remotes, s.Remote)
		}
	}
}

func appendExec(l []effect.Exec, p *procInfo) []effect.Exec {
	if len(l) >= effect.MaxSamples {
		return l
	}
	return append(l, effect.Exec{PID: p.PID, Comm: p.Comm, Argv0: p.Argv0})
}

func appendRemote(l []string, s string) []string {
	if len(l) >= effect.MaxSamples {
		return l
	}
	for _, x := range l {
		if x == s {
			return l
		}
	}
	return append(l, s)
}
