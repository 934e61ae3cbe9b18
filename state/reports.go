package state

import (
	"context"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
)

// DefaultReportRing is the number of recent turn reports kept per sandbox
// when Config.ReportRing is zero.
const DefaultReportRing = 256

// TurnReport is one turn as the daemon saw it: the effect report its probe
// window produced, what the policy decided on it, and what the turn did.
// A sandbox keeps its recent ones in memory (a bounded ring; lost when the
// daemon stops) so that a policy author can replay them (`rewind policy
// record`, then `rewind policy test`).
type TurnReport struct {
	// Seq numbers the sandbox's turn reports from 1, in order; it is the
	// cursor of Manager.Reports.
	Seq  uint64    `json:"seq"`
	Time time.Time `json:"time"`
	// Epoch is the sandbox's epoch when the turn ran.
	Epoch uint64 `json:"epoch"`
	// Requested is the mode the turn asked for (auto, skip, fs, full).
	Requested Mode `json:"requested"`
	// Policy is the sandbox's policy; Decision and Reason are its verdict
	// on Report. Decision is empty when the policy was not asked (a turn
	// with an explicit mode) or could not answer (no policy loaded, a
	// policy error: Reason says which). Fallback is set when the policy
	// failed and the host decided full in its place.
	Policy   string `json:"policy,omitempty"`
	Decision Mode   `json:"decision,omitempty"`
	Reason   string `json:"reason,omitempty"`
	Fallback bool   `json:"fallback,omitempty"`
	// Applied is the mode the turn took: the decision, or a stronger one
	// when the daemon overrode it (say, no earlier checkpoint to share),
	// or fs for a full decision whose checkpoint shares its parent's
	// process part because the processes provably did not change (the
	// checkpoint's Reason says so).
	Applied Mode `json:"applied"`
	// Checkpoint is the id the turn answered (the head's on a skip).
	Checkpoint string         `json:"checkpoint"`
	Report     *effect.Report `json:"report"`
}

// ReportPage answers Manager.Reports.
type ReportPage struct {
	// Reports are the kept reports after the cursor, oldest first.
	Reports []TurnReport `json:"reports"`
	// Last is the Seq of the newest report the sandbox has (0 if none):
	// pass it as the next call's cursor.
	Last uint64 `json:"last"`
	// Dropped counts reports after the cursor that the ring no longer
	// holds (they were overwritten before anyone read them).
	Dropped uint64 `json:"dropped"`
}

// reportRing is a sandbox's bounded ring of turn reports, guarded by
// Manager.mu.
type reportRing struct {
	buf  []TurnReport // len <= cap; buf[(last-i) % cap] is seq last-i
	last uint64
	// added is closed (and replaced) whenever a report is added, to wake
	// waiting readers.
	added chan struct{}
}

// setApplied updates the Applied mode of the report that answered
// checkpoint id, if the ring still holds it.
func (r *reportRing) setApplied(id string, mode Mode) {
	for i := range r.buf {
		if r.buf[i].Checkpoint == id {
			r.buf[i].Applied = mode
		}
	}
}

func (r *reportRing) add(size int, tr TurnReport) {
	r.last++
	tr.Seq = r.last
	if len(r.buf) < size {
		r.buf = append(r.buf, tr)
	} else {
		r.buf[(r.last-1)%uint64(size)] = tr
	}
	if r.added != nil {
		close(r.added)
		r.added = nil
	}
}

// since returns the reports with Seq > after.
func (r *reportRing) since(after uint64) ReportPage {
	page := ReportPage{Last: r.last, Reports: []TurnReport{}}
	if after >= r.last {
		return page
	}
	first := r.last - uint64(len(r.buf)) + 1 // oldest seq held
	if after+1 < first {
		page.Dropped = first - after - 1
		after = first - 1
	}
	size := uint64(cap(r.buf))
	for seq := after + 1; seq <= r.last; seq++ {
		page.Reports = append(page.Reports, r.buf[(seq-1)%size])
	}
	return page
}

func (r *reportRing) wait() <-chan struct{} {
	if r.added == nil {
		r.added = make(chan struct{})
	}
	return r.added
}

// ringSize is the configured ring size (0 when the ring is disabled).
func (m *Manager) ringSize() int {
	switch n := m.cfg.ReportRing; {
	case n < 0:
		return 0
	case n == 0:
		return DefaultReportRing
	default:
		return n
	}
}

// recordTurn adds a turn's report to s's ring. m.mu must be held.
func (m *Manager) recordTurn(s *sbox, tr TurnReport) {
	size := m.ringSize()
	if size == 0 || tr.Report == nil {
		return
	}
	if s.reports.buf == nil {
		s.reports.buf = make([]TurnReport, 0, size)
	}
	if tr.Requested == "" {
		tr.Requested = ModeAuto
	}
	tr.Time = time.Now().UTC()
	tr.Epoch = s.rec.Epoch
	tr.Policy = s.rec.Policy
	s.reports.add(size, tr)
}

// Reports returns the sandbox's recent turn reports with Seq > after. With
// wait > 0 and nothing newer yet, it waits up to wait for one (or until ctx
// ends, then it answers what it has).
func (m *Manager) Reports(ctx context.Context, name string, after uint64, wait time.Duration) (*ReportPage, error) {
	var timeout <-chan time.Time
	for {
		m.mu.Lock()
		s, err := m.lookup(name, 0)
		if err != nil {
			m.mu.Unlock()
			return nil, err
		}
		page := s.reports.since(after)
		if len(page.Reports) > 0 || page.Dropped > 0 || wait <= 0 {
			m.mu.Unlock()
			return &page, nil
		}
		added := s.reports.wait()
		m.mu.Unlock()
		if timeout == nil {
			t := time.NewTimer(wait)
			defer t.Stop()
			timeout = t.C
		}
		select {
		case <-added:
		case <-timeout:
			wait = 0
		case <-ctx.Done():
			wait = 0
		}
	}
}
