package probe

import (
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
)

// userspaceProbe is the backend that needs no eBPF: /proc snapshots of the
// sandbox's cgroup at Begin and End, and the fs layer's own counters.
type userspaceProbe struct {
	log    *slog.Logger
	turns  *turns
	mu     sync.Mutex
	closed bool
	conn   *procConn // fork/exec events; nil until the first Begin or if unavailable
	connOK bool      // conn was tried
}

// NewUserspace returns the userspace backend. It never fails on Linux.
func NewUserspace(opts Options) (Probe, error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	return &userspaceProbe{log: log, turns: newTurns()}, nil
}

func (p *userspaceProbe) Backend() string { return effect.BackendUserspace }

func (p *userspaceProbe) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	if p.conn != nil {
		p.conn.close()
		p.conn = nil
	}
	return nil
}

// procConn opens the proc connector once; nil if it is unavailable (then
// only the snapshots count processes).
func (p *userspaceProbe) procConn() *procConn {
	p.mu.Lock()
	defer p.mu.Unlock()
	if !p.connOK && !p.closed {
		p.connOK = true
		c, err := openProcConn()
		if err != nil {
			p.log.Info("probe: proc connector unavailable; short-lived processes are not counted", "err", err)
		}
		p.conn = c
	}
	return p.conn
}

func (p *userspaceProbe) Begin(t Target) (Window, error) {
	p.mu.Lock()
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return nil, ErrClosed
	}
	if t.CgroupV2Dir == "" {
		return nil, fmt.Errorf("begin %s: no cgroup v2 dir in target", t.Sandbox)
	}
	turn, err := p.turns.acquire(t.Sandbox)
	if err != nil {
		return nil, err
	}
	w := &userWindow{p: p, t: t, turn: turn, began: time.Now()}
	if t.FS != nil {
		t.FS.TakeFSEffects() // effects before the turn belong to no turn
	}
	if c := p.procConn(); c != nil {
		if w.sub, err = c.subscribe(t.CgroupV2Dir, t.excludePID()); err != nil {
			p.turns.release(t.Sandbox)
			return nil, fmt.Errorf("begin %s: %w", t.Sandbox, err)
		}
		w.conn = c
	}
	if w.begin, err = takeSnapshot(t.Files, t.CgroupV2Dir, true, t.excluder(), nil); err != nil {
		w.unsubscribe()
		p.turns.release(t.Sandbox)
		return nil, fmt.Errorf("begin %s: %w", t.Sandbox, err)
	}
	if w.sub != nil {
		w.conn.addMembers(w.sub, w.begin)
	}
	return w, nil
}

// userWindow is one turn observed by the userspace backend.
type userWindow struct {
	p     *userspaceProbe
	t     Target
	turn  uint64
	began time.Time
	begin *snapshot
	conn  *procConn
	sub   *connSub
	mu    sync.Mutex
	done  bool
}

func (w *userWindow) unsubscribe() {
	if w.sub != nil {
		w.conn.unsubscribe(w.sub)
	}
}

func (w *userWindow) Abort() {
	w.mu.Lock()
	defer w.mu.Unlock()
	if !w.done {
		w.done = true
		w.unsubscribe()
		w.p.turns.release(w.t.Sandbox)
		w.p.turns.giveBack(w.t.Sandbox, w.turn)
	}
}

func (w *userWindow) End() (*effect.Report, error) {
	r, _, err := w.finish(false)
	return r, err
}

func (w *userWindow) Next() (*effect.Report, Window, error) {
	r, nw, err := w.finish(true)
	if err != nil {
		return nil, nil, err
	}
	return r, nw, nil
}

func (w *userWindow) finish(next bool) (*effect.Report, *userWindow, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	if w.done {
		return nil, nil, fmt.Errorf("end %s turn %d: %w", w.t.Sandbox, w.turn, ErrClosed)
	}
	w.done = true
	ended := time.Now()
	r := newReport(effect.BackendUserspace, w.t.Sandbox, w.turn, w.began, ended)
	if w.t.FS != nil {
		r.FS = boundFS(w.t.FS.TakeFSEffects())
	} else {
		r.LostEvents = 1 // file-system effects are invisible to this backend
	}
	var forked, execs, lost uint64
	var samples []effect.Exec
	if w.sub != nil {
		forked, execs, lost, samples = w.conn.take(w.sub, next)
	}
	end, err := takeSnapshot(w.t.Files, w.t.CgroupV2Dir, true, w.t.excluder(), w.begin)
	if err != nil {
		w.unsubscribe()
		w.p.turns.release(w.t.Sandbox)
		return nil, nil, fmt.Errorf("end %s turn %d: %w", w.t.Sandbox, w.turn, err)
	}
	d := applySnapshots(r, w.begin, end, w.t.InitPID)
	applySockets(r, w.begin, end)
	if w.sub != nil {
		// Every fork and exec of the sandbox's processes, from the proc
		// connector; the snapshots see at least the survivors.
		r.Proc.Forked = max(forked, d.New)
		r.Proc.Execs = max(execs, d.New+d.Reexec)
		r.Proc.ExecSamples = samples
		if len(samples) == 0 {
			r.Proc.ExecSamples = d.NewExecs
		}
		r.LostEvents += lost
	} else {
		// Only processes alive at End are visible: lower bounds.
		r.Proc.Forked = d.New
		r.Proc.Execs = d.New + d.Reexec
		r.Proc.ExecSamples = d.NewExecs
	}
	if !next {
		w.p.turns.release(w.t.Sandbox)
		return r, nil, nil
	}
	nw := &userWindow{p: w.p, t: w.t, turn: w.p.turns.advance(w.t.Sandbox), began: ended, begin: end, conn: w.conn, sub: w.sub}
	if w.sub != nil {
		w.conn.addMembers(w.sub, end)
	}
	return r, nw, nil
}

// boundFS caps the samples of an FSSource's report.
func boundFS(f effect.FS) effect.FS {
	if len(f.Samples) > effect.MaxSamples {
		f.Samples = f.Samples[:effect.MaxSamples]
	}
	return f
}
