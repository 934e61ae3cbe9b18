package cr

import (
	"bytes"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// PoolStats describes the template pool.
type PoolStats struct {
	// Checkpoints is the number of checkpoints the engine holds.
	Checkpoints int
	// WithTemplates is how many of them hold templates.
	WithTemplates int
	// Templates is the number of template processes (spares excluded).
	Templates int
	// PrivateDirty is the private dirty memory of templates and spares,
	// in bytes, as last measured.
	PrivateDirty int64
}

// Stats measures the pool.
func (e *Engine) Stats() PoolStats {
	e.mu.Lock()
	var st PoolStats
	var tms []*template
	st.Checkpoints = len(e.ckpts)
	for _, c := range e.ckpts {
		if len(c.templates) > 0 {
			st.WithTemplates++
		}
		st.Templates += len(c.templates)
		tms = append(tms, c.templates...)
	}
	e.mu.Unlock()
	for _, tm := range tms {
		st.PrivateDirty += e.measure(tm)
	}
	return st
}

// TemplateUsage measures the templates of checkpoints ids (unknown ids
// count nothing): how many template processes they keep and the private
// dirty memory of those and their warm spares, in bytes.
func (e *Engine) TemplateUsage(ids []string) (templates int, bytes int64) {
	var tms []*template
	e.mu.Lock()
	for _, id := range ids {
		if c := e.ckpts[id]; c != nil {
			tms = append(tms, c.templates...)
		}
	}
	e.mu.Unlock()
	for _, tm := range tms {
		bytes += e.measure(tm)
	}
	return len(tms), bytes
}

func (e *Engine) measure(tm *template) int64 {
	d := privateDirty(tm.proc.Pid())
	e.mu.Lock()
	if tm.spare != nil {
		d += privateDirty(tm.spare.Pid())
	}
	tm.dirty, tm.measured = d, true
	e.mu.Unlock()
	return d
}

// estimate returns tm's private dirty memory as last measured, measuring
// it only if it never was since its spare changed. A template never runs,
// so the value moves only as copies sharing its pages come and go.
func (e *Engine) estimate(tm *template) int64 {
	e.mu.Lock()
	d, ok := tm.dirty, tm.measured
	e.mu.Unlock()
	if ok {
		return d
	}
	return e.measure(tm)
}

// privateDirty returns Private_Dirty of pid in bytes (0 if unreadable).
func privateDirty(pid int) int64 {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "smaps_rollup"))
	if err != nil {
		return 0
	}
	for _, l := range bytes.Split(b, []byte("\n")) {
		if v, ok := bytes.CutPrefix(l, []byte("Private_Dirty:")); ok {
			f := strings.Fields(string(v))
			if len(f) > 0 {
				kb, _ := strconv.ParseInt(f[0], 10, 64)
				return kb << 10
			}
		}
	}
	return 0
}

// procState returns the state letter of pid from /proc/pid/stat.
func procState(pid int) (byte, error) {
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "stat"))
	if err != nil {
		return 0, err
	}
	i := bytes.LastIndexByte(b, ')')
	if i < 0 || i+2 >= len(b) {
		return 0, os.ErrInvalid
	}
	return b[i+2], nil
}

// enforceBounds evicts templates while the pool exceeds its bounds. A
// checkpoint's templates are evicted only when its image exists or it was
// hinted unreachable, so eviction never loses a checkpoint; unreachable
// checkpoints go first, then the least recently used.
func (e *Engine) enforceBounds() {
	type cand struct {
		c     *ckpt
		tms   []*template
		bytes int64
	}
	e.mu.Lock()
	var cs []cand
	var newest *ckpt
	for _, c := range e.ckpts {
		if len(c.templates) == 0 {
			continue
		}
		cs = append(cs, cand{c: c, tms: append([]*template(nil), c.templates...)})
		if newest == nil || c.lastUse > newest.lastUse {
			newest = c
		}
	}
	maxB := e.cfg.MaxTemplateBytes
	e.mu.Unlock()
	// Each measurement reads a process's smaps_rollup (some 25 us for a
	// shell here), twice per checkpoint with its spare, after every
	// checkpoint: from the values measured before, unless the pool may
	// be near its byte bound, where every template is measured again.
	sum := func(m func(*template) int64) (total int64) {
		for i := range cs {
			cs[i].bytes = 0
			for _, tm := range cs[i].tms {
				cs[i].bytes += m(tm)
			}
			total += cs[i].bytes
		}
		return total
	}
	total := sum(e.estimate)
	if total > maxB/2 {
		total = sum(e.measure)
	}
	count := len(cs)
	e.mu.Lock()
	maxN, maxB := e.cfg.MaxTemplates, e.cfg.MaxTemplateBytes
	if count <= maxN && total <= maxB {
		e.mu.Unlock()
		return
	}
	sort.Slice(cs, func(i, j int) bool {
		a, b := cs[i].c, cs[j].c
		if a.reachable != b.reachable {
			return !a.reachable
		}
		return a.lastUse < b.lastUse
	})
	var victims []cand
	for _, x := range cs {
		if count <= maxN && total <= maxB {
			break
		}
		c := x.c
		// Evictable: the image exists, or the checkpoint is unreachable
		// and no image is being written from its templates.
		imaging := c.imageDone != nil && !c.image.Image && c.image.ImageErr == nil
		if c == newest || c.busy > 0 || !(c.image.Image || (!c.reachable && !imaging)) {
			continue
		}
		victims = append(victims, x)
		count--
		total -= x.bytes
	}
	e.mu.Unlock()
	for _, v := range victims {
		e.log.Info("evict templates", "checkpoint", v.c.rec.ID, "bytes", v.bytes, "image", v.c.image.Image)
		e.dropTemplates(v.c)
	}
	if count > maxN || total > maxB {
		e.log.Warn("template pool over its bounds: nothing evictable yet (no image)", "count", count, "bytes", total)
	}
}

// SetLimits changes the pool bounds (values <= 0 keep the current one) and
// evicts what no longer fits.
func (e *Engine) SetLimits(maxTemplates int, maxBytes int64) {
	e.mu.Lock()
	if maxTemplates > 0 {
		e.cfg.MaxTemplates = maxTemplates
	}
	if maxBytes > 0 {
		e.cfg.MaxTemplateBytes = maxBytes
	}
	e.mu.Unlock()
	e.enforceBounds()
}

// Evict drops the templates of checkpoint id (keeping its record and
// image); a later restore takes the image path.
func (e *Engine) Evict(id string) error {
	e.mu.Lock()
	c, ok := e.ckpts[id]
	e.mu.Unlock()
	if !ok {
		return ErrUnknown
	}
	e.dropTemplates(c)
	return nil
}
