package state

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
)

// TurnRequest is the harness's call after a tool call.
type TurnRequest struct {
	Mode Mode
	// Wait blocks until the checkpoint is durable.
	Wait  bool
	Epoch uint64
	// Defer, in auto mode, answers at once with a new checkpoint id and
	// leaves closing the probe window and the policy's decision to the
	// checkpoint itself (ordered before any later operation on the
	// sandbox, like the checkpoint's own work): the turn call costs no
	// probe read and no policy run. The result's Decision is then auto;
	// the checkpoint's Decision (Wait) says what the turn took. A decision
	// to skip becomes an fs checkpoint, which freezes nothing new when
	// nothing changed: the id is handed out already.
	Defer bool
	// Hold, for a deferred turn, delays the start of the checkpoint's
	// work until it is closed (or holdMax has passed): the daemon closes
	// it once the turn's answer is written, so that answer does not share
	// the CPU with the checkpoint it announces. Later operations on the
	// sandbox still wait for the checkpoint. A turn with Wait ignores it.
	Hold <-chan struct{}
}

// holdMax bounds how long TurnRequest.Hold can delay a checkpoint.
const holdMax = 100 * time.Millisecond

// TurnResult answers a turn at once; the checkpoint work runs on.
type TurnResult struct {
	ID       string `json:"id"`
	Decision Mode   `json:"decision"`
	Reason   string `json:"reason"`
	Epoch    uint64 `json:"epoch"`
	// Status is the checkpoint's status when the call returned.
	Status  string `json:"status"`
	Durable bool   `json:"durable"`
	// Report is the effect report auto mode decided on (nil otherwise).
	Report *effect.Report `json:"report,omitempty"`
	// Phases says where the call's own time went.
	Phases TurnPhases `json:"phases"`
}

// TurnPhases is the daemon-side time of one turn call by phase, in
// microseconds (the checkpoint it starts runs on: see Checkpoint.TookUS).
type TurnPhases struct {
	// WaitUS waits for the previous turn's checkpoint to end (its probe
	// window opens then).
	WaitUS int64 `json:"wait_us"`
	// WindowUS closes the probe window and reads its report.
	WindowUS int64 `json:"window_us"`
	// DecideUS runs the policy.
	DecideUS int64 `json:"decide_us"`
	// TotalUS is the whole call (without Wait).
	TotalUS int64 `json:"total_us"`
}

// Turn closes the probe window, decides (or takes req.Mode), and starts
// the checkpoint asynchronously, ordered before any later operation on the
// sandbox. A skip returns the previous checkpoint's id; an fs-only
// checkpoint shares its parent's process part.
func (m *Manager) Turn(ctx context.Context, name string, req TurnRequest) (*TurnResult, error) {
	m.mu.Lock()
	s, err := m.lookup(name, req.Epoch)
	if err == nil {
		err = m.running(s)
	}
	if err != nil {
		m.mu.Unlock()
		return nil, err
	}
	win, pol, polName, polErr := s.win, s.policy, s.rec.Policy, s.policyErr
	s.rec.Turns++
	open := s.winOpen
	m.mu.Unlock()
	s.turnMu.Lock()
	defer s.turnMu.Unlock()
	if req.Defer && (req.Mode == ModeAuto || req.Mode == "") && win != nil && pol != nil {
		if res, ok, err := m.deferTurn(ctx, s, req, win, pol, polName); ok || err != nil {
			return res, err
		}
	}
	start := time.Now()
	var ph TurnPhases

	mode, reason := req.Mode, "requested"
	var rep *effect.Report
	tr := TurnReport{Requested: req.Mode}
	if win != nil {
		if !open {
			// The previous turn's checkpoint is still running; its
			// window opens when it ends.
			select {
			case <-s.q.idle():
			case <-ctx.Done():
				return nil, ctx.Err()
			}
		}
		ph.WaitUS = time.Since(start).Microseconds()
		t := time.Now()
		rep = m.endWindow(ctx, s)
		ph.WindowUS = time.Since(t).Microseconds()
		tr.Report = rep
	}
	tDecide := time.Now()
	if mode == ModeAuto || mode == "" {
		mode, reason = m.decide(ctx, win, rep, pol, polErr, &tr)
		m.obs.Decided(polName, mode)
		mode, reason = m.afterFailure(s, mode, reason)
		ph.DecideUS = time.Since(tDecide).Microseconds()
	} else {
		rep = nil
	}

	m.mu.Lock()
	if _, err := m.lookup(s.rec.ID, req.Epoch); err != nil {
		m.mu.Unlock()
		return nil, err
	}
	head := m.ckpts[s.rec.Head]
	if head == nil && mode != ModeFull {
		mode, reason = ModeFull, reason+"; no earlier checkpoint, so full"
	}
	if mode == ModeSkip && rep != nil {
		if rep.FSChanged() {
			s.fsAccepted = true
		} else if rep.FS.UpperNonEmpty && !s.fsAccepted {
			// The writable layer holds data no window reported: a write
			// the probe did not see (one made between windows, by a
			// process a restore or checkpoint had just resumed). The
			// head lacks it, so the turn cannot hand out the head's id.
			mode, reason = ModeFS, reason+"; but the writable layer changed unseen, so fs"
		}
	}
	if mode == ModeFS && head != nil && head.rec.Status == CkptReady && !head.rec.Restorable {
		mode, reason = ModeFull, reason+"; the parent's processes are not restorable, so full"
	}
	if (mode == ModeSkip || mode == ModeFS) && procsLasting(tr.Report) {
		s.procsDiverged = true
	}
	if mode == ModeSkip {
		s.dirty = false // the state is the head's
		tr.Applied, tr.Checkpoint = mode, head.rec.ID
		m.recordTurn(s, tr)
		defer m.beginWindow(ctx, s)
		res := &TurnResult{ID: head.rec.ID, Decision: ModeSkip, Reason: reason, Epoch: s.rec.Epoch, Status: head.rec.Status, Durable: head.rec.Durable, Report: rep}
		m.mu.Unlock()
		ph.TotalUS = time.Since(start).Microseconds()
		res.Phases = ph
		if req.Wait {
			return m.waitResult(ctx, res)
		}
		return res, nil
	}
	s.seq++
	c := newCkpt(Checkpoint{
		ID: newID("ck-"), Parent: s.rec.Head, Sandbox: s.rec.ID, Seq: s.seq, Decision: mode, Reason: reason,
		Status: CkptPending, Created: time.Now().UTC(), Epoch: s.rec.Epoch,
	})
	if mode == ModeFull && tr.Decision == ModeFull && !tr.Fallback && rep != nil && pol != nil {
		c.recheck = &recheck{rep: rep, pol: pol}
	}
	m.ckpts[c.rec.ID] = c
	s.rec.Head = c.rec.ID
	tr.Applied, tr.Checkpoint = mode, c.rec.ID
	m.recordTurn(s, tr)
	res := &TurnResult{ID: c.rec.ID, Decision: mode, Reason: reason, Epoch: s.rec.Epoch, Status: CkptPending, Report: rep}
	m.mu.Unlock()
	s.q.async(&m.wg, func() { m.doCheckpoint(s, c) })
	ph.TotalUS = time.Since(start).Microseconds()
	res.Phases = ph
	if req.Wait {
		return m.waitResult(ctx, res)
	}
	return res, nil
}

// decide is auto mode's decision on a window's report (tr gets the
// policy's verdict). polErr, when pol is nil, says why the sandbox's
// policy could not be loaded.
func (m *Manager) decide(ctx context.Context, win ProbeWindow, rep *effect.Report, pol Policy, polErr error, tr *TurnReport) (Mode, string) {
	var mode Mode
	var reason string
	switch {
	case win == nil:
		mode, reason = ModeFull, "auto: no effect probe for this sandbox, so full"
	case rep == nil:
		mode, reason = ModeFull, "auto: the probe failed, so full"
	case pol == nil && polErr != nil:
		mode, reason = ModeFull, "auto: "+polErr.Error()+", so full"
	case pol == nil:
		mode, reason = ModeFull, "auto: no policy loaded, so full"
	default:
		d, err := pol.Decide(ctx, rep)
		if err != nil {
			mode, reason = ModeFull, "auto: policy error ("+err.Error()+"), so full"
		} else {
			mode, reason = d.Mode, d.Reason
			tr.Decision, tr.Reason, tr.Fallback = d.Mode, d.Reason, d.Fallback
			if rep.LostEvents > 0 && mode == ModeSkip {
				mode, reason = ModeFull, "probe lost events, so full"
			}
		}
	}
	if tr.Decision == "" {
		tr.Reason = reason // why no policy decided
	}
	return mode, reason
}

// deferTurn is Turn with TurnRequest.Defer: a new checkpoint at once,
// whose own work, in the sandbox's order, closes the window and decides.
// It declines (false) when there is no earlier checkpoint (the first one
// is full whatever the report says).
func (m *Manager) deferTurn(ctx context.Context, s *sbox, req TurnRequest, win ProbeWindow, pol Policy, polName string) (*TurnResult, bool, error) {
	start := time.Now()
	m.mu.Lock()
	if _, err := m.lookup(s.rec.ID, req.Epoch); err != nil {
		m.mu.Unlock()
		return nil, true, err
	}
	if m.ckpts[s.rec.Head] == nil {
		m.mu.Unlock()
		return nil, false, nil
	}
	s.seq++
	c := newCkpt(Checkpoint{
		ID: newID("ck-"), Parent: s.rec.Head, Sandbox: s.rec.ID, Seq: s.seq, Decision: ModeAuto, Reason: "deferred: decided by the checkpoint",
		Status: CkptPending, Created: time.Now().UTC(), Epoch: s.rec.Epoch,
	})
	m.ckpts[c.rec.ID] = c
	s.rec.Head = c.rec.ID
	res := &TurnResult{ID: c.rec.ID, Decision: ModeAuto, Reason: c.rec.Reason, Epoch: s.rec.Epoch, Status: CkptPending}
	m.mu.Unlock()
	hold := req.Hold
	if req.Wait {
		hold = nil // the answer waits for the checkpoint: nothing to hold it for
	}
	s.q.async(&m.wg, func() {
		if hold != nil {
			t := time.NewTimer(m.holdMax)
			select {
			case <-hold:
			case <-t.C:
			}
			t.Stop()
		}
		m.decideDeferred(s, c, win, pol, polName)
		m.doCheckpoint(s, c)
	})
	res.Phases.TotalUS = time.Since(start).Microseconds()
	if req.Wait {
		ck, err := m.Wait(ctx, res.ID)
		if err != nil {
			return nil, true, err
		}
		res.Decision, res.Reason, res.Status, res.Durable = ck.Decision, ck.Reason, ck.Status, ck.Durable
	}
	return res, true, nil
}

// firstLine is s up to its first newline.
func firstLine(s string) string {
	line, _, _ := strings.Cut(s, "\n")
	return line
}

// afterFailure turns an auto turn's decision into full while the
// sandbox's latest checkpoint failed (sbox.lastFailed): that turn's window
// was consumed, so this one's may show nothing of what no checkpoint holds.
func (m *Manager) afterFailure(s *sbox, mode Mode, reason string) (Mode, string) {
	m.mu.Lock()
	defer m.mu.Unlock()
	if s.lastFailed == "" || mode == ModeFull {
		return mode, reason
	}
	return ModeFull, reason + "; but the last checkpoint failed (" + s.lastFailed + "), and what its turn did is in no checkpoint, so full"
}

// decideDeferred closes the window of deferred checkpoint c's turn and
// decides what c takes, in the sandbox's order.
func (m *Manager) decideDeferred(s *sbox, c *ckpt, win ProbeWindow, pol Policy, polName string) {
	ctx := context.Background()
	tr := TurnReport{Requested: ModeAuto}
	rep := m.endWindow(ctx, s)
	tr.Report = rep
	m.mu.Lock()
	polErr := s.policyErr
	m.mu.Unlock()
	mode, reason := m.decide(ctx, win, rep, pol, polErr, &tr)
	m.obs.Decided(polName, mode)
	mode, reason = m.afterFailure(s, mode, reason)
	var decided Mode
	if mode == ModeSkip {
		decided = ModeSkip
		mode, reason = ModeFS, reason+"; the deferred turn has handed out a new checkpoint id, so fs (nothing new to freeze if nothing changed)"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if mode == ModeFS && procsLasting(rep) {
		s.procsDiverged = true
	}
	c.rec.Decision, c.rec.Decided, c.rec.Reason = mode, decided, reason
	if mode == ModeFull && tr.Decision == ModeFull && !tr.Fallback && rep != nil && pol != nil {
		c.recheck = &recheck{rep: rep, pol: pol}
	}
	tr.Applied, tr.Checkpoint = mode, c.rec.ID
	m.recordTurn(s, tr)
}

func (m *Manager) waitResult(ctx context.Context, res *TurnResult) (*TurnResult, error) {
	c, err := m.Wait(ctx, res.ID)
	if err != nil {
		return nil, err
	}
	res.Status, res.Durable = c.Status, c.Durable
	return res, nil
}

// Checkpoint is Turn with mode full.
func (m *Manager) Checkpoint(ctx context.Context, name string, wait bool, epoch uint64) (*TurnResult, error) {
	return m.Turn(ctx, name, TurnRequest{Mode: ModeFull, Wait: wait, Epoch: epoch})
}

// doCheckpoint runs in the sandbox's order.
func (m *Manager) doCheckpoint(s *sbox, c *ckpt) {
	// The next turn's window opens once the checkpoint's own work is done.
	defer m.beginWindow(context.Background(), s)
	m.gcMu.RLock()
	defer m.gcMu.RUnlock()
	start := time.Now()

	m.mu.Lock()
	// A failed parent is not in the tree: attach to its nearest good ancestor.
	for p := m.ckpts[c.rec.Parent]; p != nil && p.rec.Status == CkptFailed; p = m.ckpts[c.rec.Parent] {
		c.rec.Parent = p.rec.Parent
	}
	mode := c.rec.Decision
	if mode == ModeFS {
		p := m.ckpts[c.rec.Parent]
		if p == nil || !p.rec.Restorable {
			mode = ModeFull
			c.rec.Decision = ModeFull
			c.rec.Reason += "; the parent's processes are not restorable, so full"
		} else {
			c.rec.ProcFrom = p.rec.ProcFrom
		}
	}
	mount, proc, removed := s.mount, s.proc, s.removed
	var parentPart *ProcPart
	if p := m.ckpts[c.rec.Parent]; mode == ModeFull && c.recheck != nil && p != nil && p.rec.Status == CkptReady && p.rec.Restorable {
		parentPart, _ = m.procPartFor(p)
	}
	m.mu.Unlock()
	converted := false
	if parentPart != nil && proc != nil && !removed {
		if d, again, ok := m.shareProcs(s, c, proc, parentPart); ok {
			converted = true
			m.mu.Lock()
			mode = ModeFS
			c.rec.Decision = ModeFS
			if again == ModeSkip {
				c.rec.Decided = ModeSkip
			}
			c.rec.Reason = d
			c.rec.ProcFrom = m.ckpts[c.rec.Parent].rec.ProcFrom
			s.reports.setApplied(c.rec.ID, ModeFS)
			m.mu.Unlock()
		}
	}
	c.recheck = nil

	var (
		fsID   string
		fsB    int64
		part   *ProcPart
		frozen time.Duration
		err    error
	)
	switch {
	case removed || mount == nil || proc == nil:
		err = fmt.Errorf("sandbox %s is not running", s.rec.Name)
	case mode == ModeFull:
		var ferr error
		part, fsID, fsB, ferr, err = m.fullCheckpoint(context.Background(), mount, proc, nil)
		switch {
		case ferr != nil:
			err = fmt.Errorf("fs checkpoint: %w", ferr)
		case err != nil:
			err = fmt.Errorf("process checkpoint: %w", err)
		default:
			frozen = time.Duration(part.FrozenUS) * time.Microsecond
		}
	default:
		fsID, fsB, err = mount.Checkpoint(context.Background())
		if err != nil {
			err = fmt.Errorf("fs checkpoint: %w", err)
		}
	}
	took := time.Since(start)
	m.obs.Checkpointed(mode, took, frozen, err)

	m.mu.Lock()
	c.rec.FrozenUS, c.rec.TookUS = frozen.Microseconds(), took.Microseconds()
	if err != nil {
		c.rec.Status, c.rec.Error = CkptFailed, err.Error()
		if s.rec.Head == c.rec.ID {
			s.rec.Head = c.rec.Parent
			// What the turn did is in no checkpoint now: neither a skip
			// nor the head as a restore's undo point may stand for it.
			s.lastFailed, s.dirty, s.procsDiverged = firstLine(err.Error()), true, true
		}
		close(c.ready)
		close(c.durable)
		m.mu.Unlock()
		if fsID != "" {
			// The layer is now under the live mount; only the record goes.
			m.cfg.FS.Delete(context.Background(), fsID)
		}
		m.log.Error("checkpoint failed", "sandbox", s.rec.Name, "id", c.rec.ID, "err", err)
		return
	}
	c.rec.FS, c.rec.FSBytes = fsID, fsB
	if mode == ModeFull {
		c.rec.ProcFrom, c.rec.Proc = c.rec.ID, part
	}
	c.rec.Status, c.rec.Restorable = CkptReady, true
	if s.rec.Head == c.rec.ID {
		s.dirty = false // later operations are ordered after this point
		s.fsAccepted = false
		if mode == ModeFull || converted {
			s.procsDiverged = false
		}
		if mode == ModeFull || converted {
			s.lastFailed = "" // the processes are captured (or proven the parent's) again
		}
	}
	m.mu.Unlock()

	perr := m.persist(func(b *batch) {
		b.putCheckpoints = append(b.putCheckpoints, cloneCkpt(&c.rec))
		sb := cloneSandbox(&s.rec)
		sb.Head = c.rec.ID // the newest checkpoint that is in the store
		if !s.removed {
			b.putSandboxes = append(b.putSandboxes, sb)
		}
	})
	if perr != nil {
		m.log.Error("checkpoint metadata not written; it will not survive a restart", "id", c.rec.ID, "err", perr)
	}
	close(c.ready)
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.makeDurable(s, c, proc, perr == nil)
	}()
	m.maybeAutoGC()
}

// unchangedTimeout bounds UnchangedChecker.Unchanged: past it, the
// checkpoint takes its own process part.
const unchangedTimeout = time.Second

// shareProcs decides whether full checkpoint c, which its policy decided
// on report c.recheck.rep, can share its parent's process part: the
// process back end proves every live process unchanged since that part
// (UnchangedChecker), and the policy, asked again on the report with the
// processes' memory writes and cwd changes discounted (they provably left
// no trace), no longer wants a full checkpoint. It returns the reason to
// record and what the policy said the second time. The checkpoint then
// becomes fs-only, whatever the policy said (it may say skip: the turn has
// answered with a new id already).
func (m *Manager) shareProcs(s *sbox, c *ckpt, proc ProcSandbox, part *ProcPart) (string, Mode, bool) {
	uc, ok := proc.(UnchangedChecker)
	if !ok {
		return "", "", false
	}
	rep := c.recheck.rep
	if rep.LostEvents > 0 || rep.Proc.NewLongLived > 0 || rep.Proc.Exited > 0 {
		m.log.Debug("full checkpoint keeps its own process part", "sandbox", s.rec.Name, "id", c.rec.ID, "why", "processes born or gone", "proc", rep.Proc)
		return "", "", false
	}
	// A digest takes milliseconds; one that does not (agent code in the
	// shell's copy that never ends) must not hold the sandbox's queue.
	ctx, cancel := context.WithTimeout(context.Background(), unchangedTimeout)
	defer cancel()
	same, why := uc.Unchanged(ctx, part)
	if !same {
		m.log.Debug("full checkpoint keeps its own process part", "sandbox", s.rec.Name, "id", c.rec.ID, "why", why)
		return "", "", false
	}
	adj := *rep
	adj.Mem.PagesWritten, adj.Mem.PerProc = 0, nil
	adj.Proc.CwdChanges = 0
	d, err := c.recheck.pol.Decide(ctx, &adj)
	if err != nil || d.Mode == ModeFull || d.Fallback {
		return "", "", false
	}
	return c.rec.Reason + "; the processes are provably unchanged since the parent's process part (" + why + "), and on the report without their memory and cwd effects the policy says " + string(d.Mode) + " (" + d.Reason + "), so fs", d.Mode, true
}

// fullCheckpoint takes the process part with the fs checkpoint in its
// freeze barrier; undoFor, when set, makes it the undo point of a restore
// to that process part (see UndoCheckpointer). A process that exits while
// the processes are being stopped fails an attempt; one retry follows (the
// fs checkpoint of the failed attempt is dropped: its layer stays under
// the mount).
func (m *Manager) fullCheckpoint(ctx context.Context, mount FSMount, proc ProcSandbox, undoFor *ProcPart) (part *ProcPart, fsID string, fsB int64, ferr, err error) {
	take := proc.Checkpoint
	if u, ok := proc.(UndoCheckpointer); ok && undoFor != nil {
		take = func(ctx context.Context, barrier func() error) (*ProcPart, error) {
			return u.CheckpointUndo(ctx, undoFor, barrier)
		}
	}
	for attempt := 0; attempt < 2; attempt++ {
		fsID, fsB, ferr = "", 0, nil
		part, err = take(ctx, func() error {
			fsID, fsB, ferr = mount.Checkpoint(ctx)
			return ferr
		})
		if err == nil || ferr != nil {
			return part, fsID, fsB, ferr, err
		}
		if fsID != "" {
			m.cfg.FS.Delete(ctx, fsID)
		}
		m.log.Warn("process checkpoint failed; retrying once", "err", err)
	}
	return part, "", 0, ferr, err
}

// makeDurable runs outside the sandbox's order while the sandbox runs on.
func (m *Manager) makeDurable(s *sbox, c *ckpt, proc ProcSandbox, metaOK bool) {
	defer close(c.durable)
	m.mu.Lock()
	full := c.rec.ProcFrom == c.rec.ID
	var part *ProcPart
	if full && c.rec.Proc != nil {
		p := *c.rec.Proc
		part = &p
	}
	from := m.ckpts[c.rec.ProcFrom]
	m.mu.Unlock()
	durable := metaOK
	if full {
		np, err := proc.Persist(context.Background(), part)
		if err != nil {
			m.log.Warn("checkpoint not durable: its processes live in templates only", "id", c.rec.ID, "err", err)
			durable = false
		} else {
			part = np
			durable = durable && np.ImageReady
		}
	} else if from != nil {
		<-from.durable
		m.mu.Lock()
		durable = durable && from.rec.Durable
		m.mu.Unlock()
	}
	m.mu.Lock()
	fsID, fsB := c.rec.FS, c.rec.FSBytes
	m.mu.Unlock()
	if w, ok := m.cfg.FS.(FSWaiter); ok && fsID != "" {
		if err := w.AwaitCheckpoint(context.Background(), fsID); err != nil {
			m.log.Error("checkpoint not durable: its fs part could not be written", "id", c.rec.ID, "fs", fsID, "err", err)
			durable = false
		}
	}
	if sz, ok := m.cfg.FS.(FSSizer); ok && fsB == 0 && fsID != "" {
		if n, err := sz.Size(context.Background(), fsID); err != nil {
			m.log.Warn("fs checkpoint size unknown", "id", c.rec.ID, "err", err)
		} else {
			fsB = n
		}
	}
	m.mu.Lock()
	if full && part != nil {
		c.rec.Proc = part
	}
	c.rec.FSBytes = fsB
	c.rec.Durable = durable
	m.mu.Unlock()
	if metaOK {
		if err := m.persist(func(b *batch) { b.putCheckpoints = append(b.putCheckpoints, cloneCkpt(&c.rec)) }); err != nil {
			m.log.Error("checkpoint metadata not written", "id", c.rec.ID, "err", err)
		}
	}
	// The sizes are known only now: check the byte budget again.
	m.maybeAutoGC()
}

// Wait blocks until checkpoint id is ready and its durable phase ended,
// and returns it. It fails if the checkpoint failed.
func (m *Manager) Wait(ctx context.Context, id string) (*Checkpoint, error) {
	m.mu.Lock()
	c := m.ckpts[id]
	m.mu.Unlock()
	if c == nil {
		return nil, errf(CodeNotFound, "no checkpoint "+strconv.Quote(id), nil)
	}
	select {
	case <-c.durable:
	case <-ctx.Done():
		return nil, ctx.Err()
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if c.rec.Status == CkptFailed {
		return nil, errf(CodeInternal, "checkpoint "+id+" failed: "+c.rec.Error, nil)
	}
	return cloneCkpt(&c.rec), nil
}

// GetCheckpoint returns one checkpoint.
func (m *Manager) GetCheckpoint(id string) (*Checkpoint, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	c := m.ckpts[id]
	if c == nil {
		return nil, errf(CodeNotFound, "no checkpoint "+strconv.Quote(id), nil)
	}
	return cloneCkpt(&c.rec), nil
}

// Log returns a sandbox's checkpoints in order, and the origin checkpoint
// a fork came from (if it still exists) first.
func (m *Manager) Log(name string) ([]*Checkpoint, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, err := m.lookup(name, 0)
	if err != nil {
		return nil, err
	}
	var out []*Checkpoint
	if o := m.ckpts[s.rec.Origin]; o != nil {
		out = append(out, cloneCkpt(&o.rec))
	}
	var own []*Checkpoint
	for _, c := range m.ckpts {
		if c.rec.Sandbox == s.rec.ID && c.rec.Status != CkptFailed {
			own = append(own, cloneCkpt(&c.rec))
		}
	}
	sort.Slice(own, func(i, j int) bool { return own[i].Seq < own[j].Seq })
	return append(out, own...), nil
}

// RestoreResult is the outcome of a restore.
type RestoreResult struct {
	ID    string `json:"id"`
	Path  string `json:"path"`
	Epoch uint64 `json:"epoch"`
	// Phases says where the restore's time went.
	Phases RestorePhases `json:"phases"`
}

// RestorePhases is the daemon-side time of one restore by phase, in
// microseconds. The process back end's part is split at the fs switch:
// what ran before it (preparing the copies, killing the live processes)
// and after it (starting the copies, or a CRIU restore).
type RestorePhases struct {
	// QueueUS waits for the sandbox's earlier operations.
	QueueUS int64 `json:"queue_us"`
	// WindowUS closes the probe window before and reopens it after.
	WindowUS int64 `json:"window_us"`
	// UndoUS takes the undo point (0 when the head checkpoint is one).
	UndoUS int64 `json:"undo_us"`
	// Undo is "head" when the sandbox was exactly its head checkpoint and
	// that served as the undo point, "checkpoint" when one was taken,
	// "none" when the current state could not be saved and the restore
	// went on without one.
	Undo string `json:"undo,omitempty"`
	// KillUS is the process back end's work before the fs switch.
	KillUS int64 `json:"kill_us"`
	// SwitchUS is the fs switch.
	SwitchUS int64 `json:"fs_switch_us"`
	// ProcUS is the process back end's work after the fs switch.
	ProcUS int64 `json:"proc_us"`
	// PersistUS writes the sandbox's new head and epoch to the store (0
	// when that runs in the background: see Sandbox.EpochLimit).
	PersistUS int64 `json:"persist_us"`
	// TotalUS is the whole restore in the sandbox's order.
	TotalUS int64 `json:"total_us"`
}

// Restore brings sandbox name back to checkpoint id: fs first, then the
// processes. It is all-or-nothing: on any failure the sandbox is exactly
// as it was. On success the sandbox's epoch is bumped.
func (m *Manager) Restore(ctx context.Context, name, id string, epoch uint64) (*RestoreResult, error) {
	m.mu.Lock()
	s, err := m.lookup(name, epoch)
	if err != nil {
		m.mu.Unlock()
		return nil, err
	}
	c := m.ckpts[id]
	if c == nil || c.rec.Status == CkptFailed {
		m.mu.Unlock()
		return nil, errf(CodeNotFound, "no checkpoint "+strconv.Quote(id), nil)
	}
	if c.rec.Sandbox != s.rec.ID {
		owner := "sandbox " + c.rec.Sandbox + " (removed since)"
		if o := m.byID[c.rec.Sandbox]; o != nil && !o.removed {
			owner = "sandbox " + o.rec.Name
		}
		why := "use fork to start a new sandbox from it"
		if s.rec.Origin == id {
			// A fork child's origin is its first head, but its own
			// checkpoints start after it: its files are the child's
			// mount's, not the origin's.
			why = "it is this fork child's origin: take a checkpoint right after the fork to come back to, or fork the origin again"
		}
		m.mu.Unlock()
		return nil, errf(CodeBadRequest, fmt.Sprintf("checkpoint %s belongs to %s, not %s (%s)", id, owner, s.rec.Name, why), nil)
	}
	m.mu.Unlock()
	var res *RestoreResult
	queued := time.Now()
	err = m.op(ctx, name, epoch, func(s *sbox) error {
		q := time.Since(queued)
		r, err := m.doRestore(ctx, s, c)
		if r != nil {
			r.Phases.QueueUS = q.Microseconds()
		}
		res = r
		return err
	})
	return res, err
}

func (m *Manager) procPartFor(c *ckpt) (*ProcPart, error) {
	pf := m.ckpts[c.rec.ProcFrom]
	if pf == nil || pf.rec.Proc == nil {
		return nil, errf(CodeNotReady, "checkpoint "+c.rec.ID+" has no process part", nil)
	}
	if !pf.rec.Proc.Restorable() {
		return nil, errf(CodeNotReady, "checkpoint "+c.rec.ID+" is not restorable: its process templates are gone and no durable image exists", nil)
	}
	p := *pf.rec.Proc
	return &p, nil
}

// cleanHead returns the head checkpoint's parts when the sandbox is known
// to be exactly its head: no operation ran since the head was taken or
// restored, and the probe window that just ended saw no effect. Otherwise
// it says why not.
func (m *Manager) cleanHead(s *sbox, rep *effect.Report) (h cleanState, why string) {
	switch {
	case rep == nil:
		return h, "no probe report"
	case rep.LostEvents > 0:
		return h, "the probe lost events"
	case rep.FSChanged():
		return h, "the probe saw file changes"
	case procsLasting(rep):
		// Processes born and reaped in the window (rewind's own forks of
		// templates among them) leave no process state behind.
		return h, "the probe saw process changes"
	case rep.NetChanged():
		return h, "the probe saw network changes"
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	head := m.ckpts[s.rec.Head]
	switch {
	case rep.FS.UpperNonEmpty && !s.fsAccepted:
		// See Turn: a write no window reported.
		return h, "the writable layer changed unseen"
	case s.dirty:
		return h, "an operation ran since the head"
	case s.procsDiverged:
		return h, "the processes may differ from the head's process part"
	case head == nil || head.rec.Status != CkptReady || head.rec.FS == "":
		return h, "no ready head checkpoint"
	}
	part, err := m.procPartFor(head)
	if err != nil {
		return h, err.Error()
	}
	return cleanState{part: part, fs: head.rec.FS, procFrom: head.rec.ProcFrom}, ""
}

// procsLasting reports whether a window's report shows process effects
// that last (or may: no report), as opposed to processes born and reaped
// within it.
func procsLasting(rep *effect.Report) bool {
	return rep == nil || rep.LostEvents > 0 || rep.Proc.NewLongLived+rep.Proc.Exited+rep.Proc.CwdChanges > 0 || rep.Mem.PagesWritten > 0
}

// cleanState is the head checkpoint of a sandbox that is exactly its head.
type cleanState struct {
	part     *ProcPart
	fs       string
	procFrom string
}

func (m *Manager) doRestore(ctx context.Context, s *sbox, c *ckpt) (*RestoreResult, error) {
	m.gcMu.RLock()
	defer m.gcMu.RUnlock()
	start := time.Now()
	var ph RestorePhases
	m.mu.Lock()
	if m.ckpts[c.rec.ID] != c {
		m.mu.Unlock()
		return nil, errf(CodeNotFound, "no checkpoint "+strconv.Quote(c.rec.ID)+" (garbage collected meanwhile)", nil)
	}
	if c.rec.Status != CkptReady {
		m.mu.Unlock()
		return nil, errf(CodeNotReady, "checkpoint "+c.rec.ID+" is "+c.rec.Status, nil)
	}
	part, err := m.procPartFor(c)
	fsID := c.rec.FS
	mount, proc := s.mount, s.proc
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	bg := context.Background() // a restore, once started, is not abandoned half way
	// The restore's own process work is not an effect of any turn.
	t := time.Now()
	rep := m.endWindow(bg, s)
	ph.WindowUS = time.Since(t).Microseconds()
	defer m.beginWindow(bg, s)
	var path string
	if mount != nil && proc != nil {
		// The undo point. When the sandbox is exactly its head checkpoint
		// (no operation since it was taken or restored, and the probe saw
		// no effect), the head is the undo point; otherwise the current
		// state is saved like any checkpoint.
		t = time.Now()
		head, why := m.cleanHead(s, rep)
		undo, undoFS := head.part, head.fs
		var noUndo error // why the state left could not be saved
		ph.Undo = "head"
		m.mu.Lock()
		procFrom := c.rec.ProcFrom
		m.mu.Unlock()
		if vr, ok := mount.(ViewReplacer); ok && vr.ReplacesView() && why == "" && head.procFrom == procFrom {
			// The processes are in the target's state, but they must be
			// re-created to see the switched view: restore the head's
			// process part (theirs) with the switch.
			ph.Undo = "head"
		} else if why == "" && (head.procFrom == procFrom || m.adopts(bg, s, proc, head.part, part)) {
			// The processes are in the state of the target's process
			// part already (the head and the target share it, or the
			// back end proves the parts equal, and nothing ran since
			// the head): only the fs changes.
			ph.UndoUS = time.Since(t).Microseconds()
			t = time.Now()
			if err := mount.Switch(bg, fsID); err != nil {
				m.obs.Restored("", time.Since(start), err)
				return nil, fmt.Errorf("restore %s: switch fs: %w", c.rec.ID, err)
			}
			ph.SwitchUS = time.Since(t).Microseconds()
			// The processes did not change: the next window starts where
			// the last one ended.
			t = time.Now()
			m.resumeWindow(bg, s)
			ph.WindowUS += time.Since(t).Microseconds()
			return m.restored(s, c, "fs", start, ph)
		}
		// The processes change. Until the last restore's undo point is
		// released, its processes (templates) hold their pids: a
		// process part restored from an image needs its exact pids
		// (the undo point taken next is told to keep clear of them,
		// the last one was not), so that restore waits for it.
		m.mu.Lock()
		released := s.undoReleased
		m.mu.Unlock()
		if released != nil {
			if ep, ok := proc.(ExactPidsRestorer); !ok || ep.NeedsExactPids(part) {
				<-released
			}
		}
		if why != "" {
			ph.Undo = "checkpoint"
			if m.log.Enabled(bg, slog.LevelDebug) && rep != nil {
				m.log.Debug("restore takes an undo checkpoint", "sandbox", s.rec.Name, "why", why, "fs", rep.FS, "proc", rep.Proc, "pages", rep.Mem.PagesWritten, "per_proc", rep.Mem.PerProc)
			}
			var ferr error
			undo, undoFS, _, ferr, err = m.fullCheckpoint(bg, mount, proc, part)
			if err == nil {
				err = ferr
			}
			if err != nil {
				// The state being left cannot be saved (a process traced
				// by another one of the sandbox, which cannot be seized;
				// a full disk): the restore goes on without its undo
				// point, as the caller asked to leave that state. Only a
				// restore that then fails loses it (noUndo says why).
				if undoFS != "" {
					m.cfg.FS.Delete(bg, undoFS)
				}
				if undo != nil {
					// The processes were saved, the files not: released
					// off the restore's path, as an undo point is.
					part := undo
					m.wg.Add(1)
					go func() {
						defer m.wg.Done()
						m.cfg.Proc.Release(bg, part)
					}()
				}
				m.log.Warn("restore goes on without an undo point: the current state could not be saved", "sandbox", s.rec.Name, "checkpoint", c.rec.ID, "err", err)
				noUndo, undo, undoFS, err = err, nil, "", nil
				ph.Undo = "none"
			} else {
				defer m.releaseUndo(bg, s, undo, undoFS)
			}
		}
		ph.UndoUS = time.Since(t).Microseconds()
		t = time.Now()
		var switched, switchEnd time.Time
		path, err = proc.Restore(bg, part, func() error {
			// The flush ends the kill (KillUS): see FSFlusher.
			if err := flush(bg, mount); err != nil {
				return err
			}
			switched = time.Now()
			defer func() { switchEnd = time.Now() }()
			return mount.Switch(bg, fsID)
		})
		if !switched.IsZero() {
			ph.KillUS = switched.Sub(t).Microseconds()
			ph.SwitchUS = switchEnd.Sub(switched).Microseconds()
			ph.ProcUS = time.Since(switchEnd).Microseconds()
		} else {
			ph.KillUS = time.Since(t).Microseconds()
		}
		if err != nil && noUndo != nil {
			m.log.Error("restore failed, and the state before it could not be saved", "sandbox", s.rec.Name, "err", err, "save_err", noUndo)
			m.mu.Lock()
			s.rec.Note = "a failed restore could not be undone (the state before it could not be saved: " + noUndo.Error() + "); restore a checkpoint"
			m.mu.Unlock()
			err = fmt.Errorf("%w (and the state before it could not be saved to go back to: %v)", err, noUndo)
			m.obs.Restored("", time.Since(start), err)
			return nil, fmt.Errorf("restore %s: %w", c.rec.ID, err)
		}
		if err != nil {
			if _, uerr := proc.Restore(bg, undo, func() error {
				if err := flush(bg, mount); err != nil {
					return err
				}
				return mount.Switch(bg, undoFS)
			}); uerr != nil {
				m.log.Error("restore failed and so did going back", "sandbox", s.rec.Name, "err", uerr)
				m.mu.Lock()
				s.rec.Note = "a failed restore could not be undone: " + uerr.Error()
				m.mu.Unlock()
				err = fmt.Errorf("%w (and undoing it failed: %v)", err, uerr)
			}
			m.obs.Restored("", time.Since(start), err)
			return nil, fmt.Errorf("restore %s: %w", c.rec.ID, err)
		}
	} else {
		// The sandbox comes back (after a daemon restart): with its
		// policy, which recovery could not keep (see loadPolicy).
		if err := m.loadPolicy(ctx, s); err != nil {
			return nil, fmt.Errorf("restore %s: %w", c.rec.ID, err)
		}
		mnt, err := m.cfg.FS.MountFrom(bg, s.rec.ID, m.spec(&s.rec), fsID)
		if err != nil {
			m.obs.Restored("", time.Since(start), err)
			return nil, fmt.Errorf("restore %s: mount: %w", c.rec.ID, err)
		}
		p, err := m.cfg.Proc.Start(bg, s.rec.ID, mnt.Root())
		if err != nil {
			mnt.Unmount()
			m.obs.Restored("", time.Since(start), err)
			return nil, fmt.Errorf("restore %s: start: %w", c.rec.ID, err)
		}
		for name, data := range runFiles(&s.rec) {
			if err = p.WriteRunFile(name, []byte(data)); err != nil {
				break
			}
		}
		if err == nil {
			t = time.Now()
			path, err = p.Restore(bg, part, func() error { return nil })
			ph.ProcUS = time.Since(t).Microseconds()
		}
		if err != nil {
			p.Close()
			mnt.Unmount()
			m.obs.Restored("", time.Since(start), err)
			return nil, fmt.Errorf("restore %s: processes: %w", c.rec.ID, err)
		}
		var w ProbeWindow
		if m.cfg.Probe != nil {
			if w, err = m.cfg.Probe.Watch(bg, s.rec.Name, mnt, p); err != nil {
				m.log.Warn("probe unavailable", "sandbox", s.rec.Name, "err", err)
				w = nil
			}
		}
		m.mu.Lock()
		s.mount, s.proc, s.win, s.winOpen = mnt, p, w, w != nil
		m.mu.Unlock()
	}
	return m.restored(s, c, path, start, ph)
}

// releaseUndo releases the undo point a restore of s took, off the
// caller's path: releasing may wait for the back end's asynchronous work on
// it (an image dump). The sandbox's next restore through an image waits
// for the processes' release (see Restore), not for the fs checkpoint's
// deletion, which comes after it.
func (m *Manager) releaseUndo(ctx context.Context, s *sbox, undo *ProcPart, undoFS string) {
	done := make(chan struct{})
	m.mu.Lock()
	s.undoReleased = done
	m.mu.Unlock()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		m.cfg.Proc.Release(ctx, undo)
		close(done)
		m.cfg.FS.Delete(ctx, undoFS)
	}()
}

// adopts asks proc (a PartAdopter) whether the live processes, in the
// state of part from, are also in the state of part to, and logs why not.
func (m *Manager) adopts(ctx context.Context, s *sbox, proc ProcSandbox, from, to *ProcPart) bool {
	pa, ok := proc.(PartAdopter)
	if !ok || from == nil || to == nil {
		return false
	}
	same, why := pa.AdoptPart(ctx, from, to)
	if !same && m.log.Enabled(ctx, slog.LevelDebug) {
		m.log.Debug("restore recreates the processes", "sandbox", s.rec.Name, "why", why)
	}
	return same
}

// flush flushes mount if it is an FSFlusher.
func flush(ctx context.Context, mount FSMount) error {
	if f, ok := mount.(FSFlusher); ok {
		if err := f.Flush(ctx); err != nil {
			return fmt.Errorf("flush the killed processes' writes: %w", err)
		}
	}
	return nil
}

// epochReserve is how many epochs past the current one a sandbox's stored
// record vouches for (Sandbox.EpochLimit): restores within the reserve
// write their new head and epoch to the store in the background.
const epochReserve = 1024

// restored ends a successful restore of s to c: the new head and epoch,
// in memory and in the store. A running sandbox's record is written in
// the background unless the new epoch passes the stored EpochLimit (then
// a new limit is written first, synchronously): a crash may lose the
// record, and recovery starts the sandbox's epochs above the limit, so no
// epoch handed out before the crash is ever accepted after it.
func (m *Manager) restored(s *sbox, c *ckpt, path string, start time.Time, ph RestorePhases) (*RestoreResult, error) {
	bg := context.Background()
	m.mu.Lock()
	wasRunning := s.rec.Status == StatusRunning
	s.rec.Epoch++
	sync := !wasRunning || s.rec.Epoch > s.rec.EpochLimit
	if s.rec.Epoch > s.rec.EpochLimit {
		s.rec.EpochLimit = s.rec.Epoch + epochReserve
	}
	s.rec.Head = c.rec.ID
	s.dirty, s.fsAccepted, s.lastFailed = false, false, ""
	if path != "fs" {
		s.procsDiverged = false // the processes are the target's
	}
	s.rec.Status, s.rec.Note = StatusRunning, policyNote(s)
	res := &RestoreResult{ID: c.rec.ID, Path: path, Epoch: s.rec.Epoch}
	m.mu.Unlock()
	t := time.Now()
	write := func() {
		err := m.persist(func(b *batch) {
			if !s.removed {
				b.putSandboxes = append(b.putSandboxes, cloneSandbox(&s.rec))
			}
		})
		if err != nil {
			m.log.Error("restore metadata not written", "sandbox", s.rec.Name, "err", err)
		}
	}
	if sync {
		write()
	} else {
		m.wg.Add(1)
		go func() {
			defer m.wg.Done()
			write()
		}()
	}
	ph.PersistUS = time.Since(t).Microseconds()
	t = time.Now()
	m.beginWindow(bg, s) // the deferred call then finds it open
	ph.WindowUS += time.Since(t).Microseconds()
	ph.TotalUS = time.Since(start).Microseconds()
	res.Phases = ph
	m.obs.Restored(path, time.Since(start), nil)
	// Per restore, so at Debug: a tree search restores every other turn,
	// and writing the line cost the caller some 25 us (a loaded machine).
	if m.log.Enabled(bg, slog.LevelDebug) {
		m.log.Debug("restored", "sandbox", s.rec.Name, "checkpoint", c.rec.ID, "path", path, "epoch", res.Epoch, "took", time.Since(start),
			"window_us", ph.WindowUS, "undo", ph.Undo, "undo_us", ph.UndoUS, "kill_us", ph.KillUS, "fs_switch_us", ph.SwitchUS, "proc_us", ph.ProcUS, "persist_us", ph.PersistUS)
	}
	return res, nil
}

// ForkRequest asks for Count new sandboxes from a checkpoint.
type ForkRequest struct {
	Checkpoint string
	Count      int
	// Prefix names the children Prefix1..PrefixN (default: the source
	// sandbox's name and "-").
	Prefix string
	// NoWait fails at once if the checkpoint is not ready yet.
	NoWait bool
}

// Fork creates Count sandboxes from a checkpoint: shared frozen layers,
// own uppers, own processes. Each child finds its copy number in
// /run/rewind/copy. All or nothing: on any failure no child remains.
func (m *Manager) Fork(ctx context.Context, req ForkRequest) ([]*Sandbox, error) {
	if req.Count < 1 || req.Count > 1024 {
		return nil, errf(CodeBadRequest, "fork: --count must be 1..1024", nil)
	}
	if p := req.Prefix; p != "" && p[len(p)-1] >= '0' && p[len(p)-1] <= '9' {
		// p-1 would name its children p-11, p-12, ..., which read as
		// other numbers of p-.
		return nil, errf(CodeBadRequest, "fork: prefix "+strconv.Quote(p)+" ends with a digit, so its children's numbers would run into it ("+p+"1, "+p+"2...): end it with a separator, e.g. "+strconv.Quote(p+"-"), nil)
	}
	m.mu.Lock()
	c := m.ckpts[req.Checkpoint]
	if c == nil || c.rec.Status == CkptFailed {
		m.mu.Unlock()
		return nil, errf(CodeNotFound, "no checkpoint "+strconv.Quote(req.Checkpoint), nil)
	}
	src := m.byID[c.rec.Sandbox]
	m.mu.Unlock()
	select {
	case <-c.ready:
	default:
		if req.NoWait {
			return nil, errf(CodeNotReady, "checkpoint "+c.rec.ID+" is not ready yet (retry, or drop --no-wait)", nil)
		}
		select {
		case <-c.ready:
		case <-ctx.Done():
			return nil, ctx.Err()
		}
	}
	m.mu.Lock()
	if c.rec.Status != CkptReady {
		m.mu.Unlock()
		return nil, errf(CodeNotReady, "checkpoint "+c.rec.ID+" failed", nil)
	}
	m.mu.Unlock()
	if err := m.awaitImage(ctx, c, req.NoWait); err != nil {
		return nil, err
	}
	m.mu.Lock()
	var base Sandbox
	if src != nil {
		base = *cloneSandbox(&src.rec)
	} else {
		base = Sandbox{Name: c.rec.ID, FSKind: "auto"}
	}
	m.mu.Unlock()
	// With the default prefix, a fork names its children after those of
	// the forks before it (a trainer forks the same checkpoint at every
	// step); an explicit prefix names them from 1, and must be free.
	first := 1
	if req.Prefix == "" {
		req.Prefix = base.Name + "-"
		first = m.nextNumber(req.Prefix)
	}
	names := make([]string, req.Count)
	for i := range names {
		names[i] = req.Prefix + strconv.Itoa(first+i)
		if !nameRE().MatchString(names[i]) {
			return nil, errf(CodeBadRequest, "invalid sandbox name "+strconv.Quote(names[i]), nil)
		}
	}
	for i, n := range names {
		if err := m.reserve(n); err != nil {
			for _, r := range names[:i] {
				m.unreserve(r)
			}
			return nil, err
		}
	}
	defer func() {
		for _, n := range names {
			m.unreserve(n)
		}
	}()

	m.gcMu.RLock()
	defer m.gcMu.RUnlock()
	start := time.Now()
	m.mu.Lock()
	if m.ckpts[c.rec.ID] != c {
		m.mu.Unlock()
		return nil, errf(CodeNotFound, "no checkpoint "+strconv.Quote(c.rec.ID)+" (garbage collected meanwhile)", nil)
	}
	part, err := m.procPartFor(c)
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	var pol Policy
	if m.cfg.Policies != nil && base.Policy != "" {
		if pol, err = m.cfg.Policies.Load(ctx, base.Policy); err != nil {
			return nil, errf(CodeBadRequest, "policy "+base.Policy, err)
		}
	}
	children := make([]*sbox, req.Count)
	errs := make([]error, req.Count)
	// Children prepared ahead of time (Config.WarmForks) take the first
	// copy numbers; the rest are made now.
	warm := m.beginForkWarm(c.rec.ID, &base, req.Count)
	forked := false
	defer func() {
		var kids []*sbox
		if forked {
			kids = children
		}
		m.endForkWarm(c.rec.ID, req.Count, forked, kids)
	}()
	wasWarm := map[string]bool{}
	for i, s := range warm {
		wasWarm[s.rec.ID] = true
		if err := m.handOut(s, names[i], i+1, pol); err != nil {
			m.log.Warn("prepared fork child unusable; forking anew", "child", names[i], "err", err)
			m.discardWarm([]*sbox{s})
			continue
		}
		children[i] = s
	}
	// The first child that fails for good fails the fork: the children
	// not started yet are not, and those under way are cancelled.
	fctx, cancel := context.WithCancel(ctx)
	defer cancel()
	var (
		wg       sync.WaitGroup
		failOnce sync.Once
		ferr     error
	)
	sem := make(chan struct{}, 4)
	for i := range children {
		if children[i] != nil {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			sem <- struct{}{}
			defer func() { <-sem }()
			if fctx.Err() != nil {
				return
			}
			children[i], errs[i] = m.forkOne(fctx, &base, c, part, names[i], i+1, pol)
			if errs[i] != nil && !permanent(errs[i]) && fctx.Err() == nil { // a transient back-end failure gets one more try
				m.log.Warn("fork child failed; retrying once", "child", names[i], "err", errs[i])
				children[i], errs[i] = m.forkOne(fctx, &base, c, part, names[i], i+1, pol)
			}
			if errs[i] != nil {
				failOnce.Do(func() {
					ferr = fmt.Errorf("fork %s: child %s: %w", c.rec.ID, names[i], errs[i])
					cancel()
				})
			}
		}()
	}
	wg.Wait()
	if ferr == nil && ctx.Err() != nil {
		ferr = fmt.Errorf("fork %s: %w", c.rec.ID, ctx.Err())
	}
	if ferr == nil {
		ferr = m.persist(func(b *batch) {
			for _, ch := range children {
				b.putSandboxes = append(b.putSandboxes, cloneSandbox(&ch.rec))
			}
		})
	}
	if ferr != nil {
		var drop []string
		for _, ch := range children {
			if ch != nil {
				m.stopSandbox(ch)
				if wasWarm[ch.rec.ID] {
					drop = append(drop, ch.rec.ID)
				}
			}
		}
		if len(drop) > 0 {
			if err := m.persist(func(b *batch) { b.delSandboxes = append(b.delSandboxes, drop...) }); err != nil {
				m.log.Warn("delete prepared fork children", "err", err)
			}
		}
		return nil, ferr
	}
	forked = true
	out := make([]*Sandbox, len(children))
	m.mu.Lock()
	for i, ch := range children {
		m.byName[ch.rec.Name] = ch
		m.byID[ch.rec.ID] = ch
		out[i] = cloneSandbox(&ch.rec)
	}
	m.mu.Unlock()
	m.obs.Forked(req.Count, time.Since(start))
	m.log.Info("forked", "checkpoint", c.rec.ID, "count", req.Count, "prepared", len(wasWarm), "took", time.Since(start))
	return out, nil
}

// awaitImage waits until the process image of ready checkpoint c is
// written: fork children are restored from it, and it is written after
// the checkpoint is ready, in its durable phase. With noWait it fails
// (not ready) instead of waiting; it fails for good when the image could
// not be written.
func (m *Manager) awaitImage(ctx context.Context, c *ckpt, noWait bool) error {
	m.mu.Lock()
	part, err := m.procPartFor(c)
	m.mu.Unlock()
	if err != nil || part.ImageReady {
		return nil // the caller's own lookup reports a missing part
	}
	if noWait {
		select {
		case <-c.durable:
			// Its durable phase is over and the image is not ready: it
			// never will be (below).
		default:
			return errf(CodeNotReady, "checkpoint "+c.rec.ID+"'s process image is not written yet (retry, or drop --no-wait)", nil)
		}
	}
	select {
	case <-c.durable:
	case <-ctx.Done():
		return ctx.Err()
	}
	m.mu.Lock()
	part, err = m.procPartFor(c)
	m.mu.Unlock()
	if err == nil && !part.ImageReady && part.Processes > 0 {
		return errf(CodeInternal, "checkpoint "+c.rec.ID+" cannot be forked: its process image could not be written (the daemon's log says why); it restores only in its own sandbox", nil)
	}
	return nil
}

// permanent reports whether err says that trying the same again cannot
// help (a back end's error with a Permanent method that says so, such as
// a process image that names a file the new sandbox lacks).
func permanent(err error) bool {
	var p interface{ Permanent() bool }
	return errors.As(err, &p) && p.Permanent()
}

func (m *Manager) forkOne(ctx context.Context, base *Sandbox, c *ckpt, part *ProcPart, name string, copyN int, pol Policy) (*sbox, error) {
	rec := Sandbox{
		ID: newID("sb-"), Name: name, Bases: base.Bases, FSKind: base.FSKind, Policy: base.Policy,
		Status: StatusRunning, Epoch: 1, Head: c.rec.ID, Created: time.Now().UTC(), Origin: c.rec.ID, Copy: copyN,
	}
	s := &sbox{rec: rec, q: newQueue(), policy: pol}
	start := time.Now()
	mount, err := m.cfg.FS.MountFrom(ctx, rec.ID, m.spec(&rec), c.rec.FS)
	if err != nil {
		return nil, fmt.Errorf("mount: %w", err)
	}
	mounted := time.Since(start)
	p := *part
	if err := m.startLive(ctx, s, mount, &p, runFiles(&s.rec)); err != nil {
		return nil, err
	}
	m.log.Debug("fork child started", "child", name, "mount", mounted, "took", time.Since(start))
	return s, nil
}

// runFiles are the files a sandbox finds under /run/rewind.
func runFiles(rec *Sandbox) map[string]string {
	f := map[string]string{"sandbox": rec.Name + "\n"}
	if rec.Copy > 0 {
		f["copy"] = strconv.Itoa(rec.Copy) + "\n"
	}
	return f
}
