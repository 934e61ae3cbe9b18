package state

import (
	"context"
	"sort"
	"strconv"
	"time"
)

// Pin marks checkpoints as roots for GC: a pinned checkpoint and all its
// ancestors are kept.
func (m *Manager) Pin(ids []string) error {
	m.mu.Lock()
	for _, id := range ids {
		if c := m.ckpts[id]; c == nil || c.rec.Status == CkptFailed {
			m.mu.Unlock()
			return errf(CodeNotFound, "no checkpoint "+strconv.Quote(id), nil)
		}
	}
	m.mu.Unlock()
	if err := m.persist(func(b *batch) { b.pin = append(b.pin, ids...) }); err != nil {
		return err
	}
	m.mu.Lock()
	for _, id := range ids {
		m.pins[id] = true
	}
	m.mu.Unlock()
	return nil
}

// Unpin removes pins (unknown ids are ignored).
func (m *Manager) Unpin(ids []string) error {
	if err := m.persist(func(b *batch) { b.unpin = append(b.unpin, ids...) }); err != nil {
		return err
	}
	m.mu.Lock()
	for _, id := range ids {
		delete(m.pins, id)
	}
	m.mu.Unlock()
	return nil
}

// Pins lists the pinned checkpoint ids.
func (m *Manager) Pins() []string {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]string, 0, len(m.pins))
	for id := range m.pins {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// GCResult reports what a collection freed (or would free).
type GCResult struct {
	Freed  []string `json:"freed"`
	Kept   int      `json:"kept"`
	Bytes  int64    `json:"bytes"`
	Errors []string `json:"errors,omitempty"`
	DryRun bool     `json:"dry_run"`
}

// reachable returns the checkpoints reachable from pins, sandbox heads,
// pending checkpoints and checkpoints still being made durable, following
// parent and process-part links. Call with m.mu held.
func (m *Manager) reachable() map[string]bool {
	seen := map[string]bool{}
	var stack []string
	push := func(id string) {
		if id != "" && !seen[id] && m.ckpts[id] != nil {
			seen[id] = true
			stack = append(stack, id)
		}
	}
	for id := range m.pins {
		push(id)
	}
	for _, s := range m.byID {
		push(s.rec.Head)
		push(s.rec.Origin)
	}
	for id, c := range m.ckpts {
		busy := false
		select {
		case <-c.durable:
		default:
			busy = true
		}
		if busy || c.rec.Status == CkptPending {
			push(id)
		}
	}
	for len(stack) > 0 {
		id := stack[len(stack)-1]
		stack = stack[:len(stack)-1]
		c := m.ckpts[id]
		push(c.rec.Parent)
		push(c.rec.ProcFrom)
	}
	return seen
}

// GC frees every checkpoint unreachable from pins and live sandboxes:
// their fs checkpoints and process parts go back to the back ends, which
// free layers and templates no longer referenced. Nothing reachable is
// ever freed.
func (m *Manager) GC(ctx context.Context, dryRun bool) (*GCResult, error) {
	m.gcMu.Lock()
	defer m.gcMu.Unlock()
	start := time.Now()
	m.mu.Lock()
	keep := m.reachable()
	depth := map[string]int{}
	var depthOf func(id string) int
	depthOf = func(id string) int {
		if d, ok := depth[id]; ok {
			return d
		}
		depth[id] = 0 // cycle guard
		d := 0
		if c := m.ckpts[id]; c != nil && c.rec.Parent != "" && m.ckpts[c.rec.Parent] != nil {
			d = depthOf(c.rec.Parent) + 1
		}
		depth[id] = d
		return d
	}
	var dead []*Checkpoint
	for id, c := range m.ckpts {
		if !keep[id] {
			depthOf(id)
			dead = append(dead, cloneCkpt(&c.rec))
		}
	}
	res := &GCResult{Freed: []string{}, Kept: len(keep), DryRun: dryRun}
	m.mu.Unlock()
	// Deepest first: a child goes before its parent.
	sort.Slice(dead, func(i, j int) bool {
		if depth[dead[i].ID] != depth[dead[j].ID] {
			return depth[dead[i].ID] > depth[dead[j].ID]
		}
		return dead[i].ID < dead[j].ID
	})
	if dryRun {
		for _, c := range dead {
			res.Freed = append(res.Freed, c.ID)
			res.Bytes += c.FSBytes
			if c.Proc != nil && c.ProcFrom == c.ID {
				res.Bytes += c.Proc.Bytes
			}
		}
		return res, nil
	}
	deadIDs := make([]string, len(dead))
	for i, c := range dead {
		deadIDs[i] = c.ID
	}
	// Prepared fork children are made from these checkpoints.
	m.dropWarmFor(deadIDs)
	failed := map[string]bool{} // ids whose parent must then stay
	freed := []string{}
	for _, c := range dead {
		if failed[c.ID] {
			failed[c.Parent] = true
			res.Kept++
			continue
		}
		var err error
		if c.FS != "" {
			err = m.cfg.FS.Delete(ctx, c.FS)
		}
		if err == nil && c.Proc != nil && c.ProcFrom == c.ID {
			err = m.cfg.Proc.Release(ctx, c.Proc)
		}
		if err != nil {
			res.Errors = append(res.Errors, c.ID+": "+err.Error())
			failed[c.Parent] = true
			res.Kept++
			continue
		}
		freed = append(freed, c.ID)
		res.Bytes += c.FSBytes
		if c.Proc != nil && c.ProcFrom == c.ID {
			res.Bytes += c.Proc.Bytes
		}
	}
	perr := m.persist(func(b *batch) {
		b.delCheckpoints = freed
		for _, id := range freed {
			delete(m.ckpts, id)
		}
	})
	res.Freed = freed
	if perr == nil {
		m.sweepImages(ctx, false)
	}
	m.obs.Collected(len(freed), time.Since(start))
	if len(freed) > 0 {
		m.log.Info("gc", "freed", len(freed), "kept", res.Kept, "bytes", res.Bytes, "took", time.Since(start))
	}
	return res, perr
}

// sweepImages has the process back end remove the images no checkpoint
// uses (ImageSweeper): at start, once the store is loaded, and after a
// collection.
func (m *Manager) sweepImages(ctx context.Context, start bool) {
	sw, ok := m.cfg.Proc.(ImageSweeper)
	if !ok {
		return
	}
	m.mu.Lock()
	keep := make([]*ProcPart, 0, len(m.ckpts))
	for _, c := range m.ckpts {
		if p := c.rec.Proc; p != nil {
			cp := *p
			cp.Data = make(map[string]string, len(p.Data))
			for k, v := range p.Data {
				cp.Data[k] = v
			}
			keep = append(keep, &cp)
		}
	}
	m.mu.Unlock()
	n, bytes, err := sw.SweepImages(ctx, keep, start)
	if err != nil {
		m.log.Warn("remove process images no checkpoint uses", "err", err)
	}
	if n > 0 {
		m.log.Info("removed process images no checkpoint uses", "dirs", n, "bytes", bytes, "start", start)
	}
}

func (m *Manager) overBudget() bool {
	b := m.cfg.Budget
	if b.MaxCheckpoints == 0 && b.MaxBytes == 0 {
		return false
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	if b.MaxCheckpoints > 0 && len(m.ckpts) > b.MaxCheckpoints {
		return true
	}
	if b.MaxBytes > 0 {
		var total int64
		for _, c := range m.ckpts {
			total += c.rec.FSBytes
			if c.rec.Proc != nil && c.rec.ProcFrom == c.rec.ID {
				total += c.rec.Proc.Bytes
			}
		}
		return total > b.MaxBytes
	}
	return false
}

// maybeAutoGC starts one background collection when the budget is
// exceeded (at most one runs at a time).
func (m *Manager) maybeAutoGC() {
	if !m.overBudget() {
		return
	}
	m.mu.Lock()
	if m.gcRunning || m.closed {
		m.mu.Unlock()
		return
	}
	m.gcRunning = true
	m.mu.Unlock()
	m.wg.Add(1)
	go func() {
		defer m.wg.Done()
		if _, err := m.GC(context.Background(), false); err != nil {
			m.log.Warn("automatic gc", "err", err)
		}
		m.mu.Lock()
		m.gcRunning = false
		m.mu.Unlock()
	}()
}

// Stats summarizes the tree.
type Stats struct {
	Sandboxes   int   `json:"sandboxes"`
	Checkpoints int   `json:"checkpoints"`
	Pins        int   `json:"pins"`
	Bytes       int64 `json:"bytes"`
}

// Stats returns counts and the bytes held by checkpoints.
func (m *Manager) Stats() Stats {
	m.mu.Lock()
	defer m.mu.Unlock()
	st := Stats{Sandboxes: len(m.byID), Checkpoints: len(m.ckpts), Pins: len(m.pins)}
	for _, c := range m.ckpts {
		st.Bytes += c.rec.FSBytes
		if c.rec.Proc != nil && c.rec.ProcFrom == c.rec.ID {
			st.Bytes += c.rec.Proc.Bytes
		}
	}
	return st
}

// Usage is what one sandbox's own checkpoints hold (fork children's
// checkpoints of their origin are the origin's).
type Usage struct {
	// Checkpoints is the number of the sandbox's checkpoints.
	Checkpoints int `json:"checkpoints"`
	// FSBytes is the bytes of their frozen fs layers.
	FSBytes int64 `json:"fs_bytes"`
	// ProcBytes is the bytes of their durable process parts (CRIU images)
	// written so far.
	ProcBytes int64 `json:"proc_bytes"`
	// Templates is the number of template processes kept for fast
	// restores, and TemplateBytes their private dirty memory (0 when the
	// process back end cannot measure it).
	Templates     int   `json:"templates"`
	TemplateBytes int64 `json:"template_bytes"`
}

// Usage measures what sandbox name's checkpoints hold on disk and in
// memory.
func (m *Manager) Usage(name string) (Usage, error) {
	var u Usage
	var parts []*ProcPart
	m.mu.Lock()
	s, err := m.lookup(name, 0)
	if err != nil {
		m.mu.Unlock()
		return u, err
	}
	for _, c := range m.ckpts {
		if c.rec.Sandbox != s.rec.ID || c.rec.Status == CkptFailed {
			continue
		}
		u.Checkpoints++
		u.FSBytes += c.rec.FSBytes
		if p := c.rec.Proc; p != nil && c.rec.ProcFrom == c.rec.ID {
			if p.ImageReady {
				u.ProcBytes += p.Bytes
			}
			cp := *p
			parts = append(parts, &cp)
		}
	}
	m.mu.Unlock()
	if pm, ok := m.cfg.Proc.(ProcMeter); ok && len(parts) > 0 {
		u.Templates, u.TemplateBytes = pm.TemplateUsage(parts)
	}
	return u, nil
}
