package state

import (
	"context"
	"slices"

	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"github.com/rewind-sandbox/rewind/effect"
	"log/slog"
	"os"
	"path/filepath"
	"regexp"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"
)

// Budget makes GC run automatically when exceeded. Zero fields are
// unlimited.
type Budget struct {
	// MaxCheckpoints bounds the number of checkpoints kept.
	MaxCheckpoints int
	// MaxBytes bounds the bytes held by checkpoints (fs layers plus
	// process parts, as the back ends report them).
	MaxBytes int64
}

// Config configures a Manager.
type Config struct {
	// Dir is the state directory; the metadata store is Dir/state.db.
	Dir  string
	FS   FSBackend
	Proc ProcBackend
	// Probe and Policies may be nil: auto turns then take full
	// checkpoints and say so in the reason.
	Probe    Probe
	Policies PolicyLoader
	// DefaultPolicy is used by sandboxes created without --policy.
	DefaultPolicy string
	// Hide lists host paths never visible inside a sandbox.
	Hide []string
	// BootID identifies the current host boot ("" if unknown); a change
	// since the last run means the host rebooted.
	BootID   string
	Budget   Budget
	Observer Observer
	Logger   *slog.Logger
	// WarmForks bounds the fork children prepared ahead of time: after a
	// fork of N copies of a checkpoint, up to N children of it are made in
	// the background so the next fork of it at that width only names them.
	// 0 prepares none.
	WarmForks int
	// NoSync skips fsync on metadata writes (tests only: a crash may then
	// lose recent records).
	NoSync bool
	// ReportRing is the number of recent turn reports kept per sandbox
	// for Reports (0: DefaultReportRing; negative: none).
	ReportRing int
}

// Manager owns sandboxes and the checkpoint tree. It is safe for
// concurrent use.
type Manager struct {
	cfg Config
	log *slog.Logger
	obs Observer
	st  *store

	// gcMu: checkpoint, restore and fork work holds it shared; GC holds
	// it exclusively while it decides and frees.
	gcMu sync.RWMutex
	// pmu serializes store writes, so later states are written later.
	pmu sync.Mutex

	// holdMax bounds TurnRequest.Hold (the holdMax constant; tests raise it).
	holdMax time.Duration

	mu        sync.Mutex // guards everything below and the records inside
	byName    map[string]*sbox
	byID      map[string]*sbox
	reserved  map[string]bool
	ckpts     map[string]*ckpt
	pins      map[string]bool
	closed    bool
	gcRunning bool
	warm      *warmPool // nil without Config.WarmForks

	wg sync.WaitGroup // asynchronous work
}

type sbox struct {
	rec     Sandbox
	seq     uint64
	q       *queue
	mount   FSMount
	proc    ProcSandbox
	win     ProbeWindow
	winOpen bool // a probe window is open (guarded by m.mu)
	dirty   bool // an operation ran since the head was taken or restored (m.mu)
	// procsDiverged: the live processes may differ from the head's process
	// part, because a skip or fs-only turn kept an earlier part despite
	// lasting process effects (a policy that does not track processes, or
	// a requested mode). Cleared by a checkpoint with its own or a proven
	// process part and by a restore of the processes (m.mu).
	procsDiverged bool
	// fsAccepted: a skip turn kept the head although its window reported
	// file changes (a policy that ignores some paths), so the live upper
	// may hold data the head lacks by the policy's choice. Cleared by any
	// checkpoint or restore (m.mu).
	fsAccepted bool
	// lastFailed says why the sandbox's latest checkpoint failed: the
	// effects its turn consumed are in no checkpoint, so the next auto
	// turn takes a full one whatever its own window shows. Cleared by a
	// full checkpoint and by a restore (m.mu).
	lastFailed string
	turnMu     sync.Mutex // serializes the synchronous part of turns
	// policy decides auto turns (m.mu). A sandbox recovered from the
	// store has only its record's name for it until a restore brings the
	// sandbox back and loads it (loadPolicy).
	policy Policy
	// policyErr says why the policy the record names could not be loaded
	// when the sandbox was brought back; auto turns then take full
	// checkpoints and say why (m.mu).
	policyErr error
	removed   bool
	reports   reportRing // recent turn reports (m.mu)
	// undoReleased is closed when the last restore's undo point has been
	// released (that runs after the restore returned); nil before the
	// first (m.mu).
	undoReleased chan struct{}
}

type ckpt struct {
	rec     Checkpoint
	ready   chan struct{} // closed when Status leaves pending
	durable chan struct{} // closed when the durable phase ended
	// recheck, for a full checkpoint a policy decided, is what it decided
	// on: the checkpoint asks the policy again, with the processes' memory
	// and cwd effects discounted, when the process back end proves the
	// processes unchanged since the parent's process part.
	recheck *recheck
}

type recheck struct {
	rep *effect.Report
	pol Policy
}

func newCkpt(rec Checkpoint) *ckpt {
	c := &ckpt{rec: rec, ready: make(chan struct{}), durable: make(chan struct{})}
	return c
}

func closedCkpt(rec Checkpoint) *ckpt {
	c := newCkpt(rec)
	close(c.ready)
	close(c.durable)
	return c
}

// Open opens (or creates) the state in cfg.Dir and recovers it: sandboxes
// that were running when the previous daemon ended are marked stopped
// (a restore brings them back), and process parts that did not survive
// (templates) are marked so; what is still restorable is kept.
func Open(ctx context.Context, cfg Config) (*Manager, error) {
	if cfg.FS == nil || cfg.Proc == nil {
		return nil, errors.New("state: FS and Proc back ends are required")
	}
	if cfg.Observer == nil {
		cfg.Observer = nopObserver{}
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.New(slog.DiscardHandler)
	}
	if err := os.MkdirAll(cfg.Dir, 0o700); err != nil {
		return nil, fmt.Errorf("state dir %s: %w", cfg.Dir, err)
	}
	st, err := openStore(filepath.Join(cfg.Dir, "state.db"), cfg.NoSync)
	if err != nil {
		return nil, err
	}
	m := &Manager{
		cfg: cfg, log: cfg.Logger, obs: cfg.Observer, st: st,
		byName: map[string]*sbox{}, byID: map[string]*sbox{}, reserved: map[string]bool{},
		ckpts: map[string]*ckpt{}, pins: map[string]bool{}, holdMax: holdMax,
	}
	if err := m.recover(ctx); err != nil {
		st.close()
		return nil, err
	}
	if cfg.WarmForks > 0 {
		m.startWarm()
	}
	return m, nil
}

func (m *Manager) recover(ctx context.Context) error {
	l, err := m.st.load()
	if err != nil {
		return err
	}
	rebooted := m.cfg.BootID != "" && l.bootID != "" && l.bootID != m.cfg.BootID
	b := &batch{bootID: m.cfg.BootID}
	checker, _ := m.cfg.FS.(FSChecker)
	for _, c := range l.checkpoints {
		if c.Status != CkptReady {
			b.delCheckpoints = append(b.delCheckpoints, c.ID)
			continue
		}
		if checker != nil && c.FS != "" && checker.Lost(ctx, c.FS) {
			m.log.Warn("checkpoint dropped: its fs part was lost with the previous daemon (its layer was still being written)", "checkpoint", c.ID, "fs", c.FS)
			b.delCheckpoints = append(b.delCheckpoints, c.ID)
			continue
		}
		if c.Proc != nil && c.ProcFrom == c.ID {
			before := *c.Proc
			c.Proc = m.cfg.Proc.Recover(ctx, c.Proc)
			if c.Proc.TemplateReady != before.TemplateReady || c.Proc.ImageReady != before.ImageReady {
				b.putCheckpoints = append(b.putCheckpoints, c)
			}
		}
		m.ckpts[c.ID] = closedCkpt(*c)
	}
	// Restorable follows the process part each checkpoint uses.
	for _, c := range m.ckpts {
		r := false
		if pf := m.ckpts[c.rec.ProcFrom]; pf != nil {
			r = pf.rec.Proc.Restorable()
		}
		if r != c.rec.Restorable {
			c.rec.Restorable = r
			cp := c.rec
			b.putCheckpoints = append(b.putCheckpoints, &cp)
		}
	}
	for _, id := range l.pins {
		if m.ckpts[id] != nil {
			m.pins[id] = true
		} else {
			b.unpin = append(b.unpin, id)
		}
	}
	m.cleanLeftovers(ctx, l.sandboxes)
	for _, sb := range l.sandboxes {
		if sb.Warm {
			// A fork child prepared by the previous daemon: never handed
			// out, so nothing of it is kept.
			if err := m.cfg.FS.Cleanup(ctx, sb.ID); err != nil {
				m.log.Warn("fs cleanup of a prepared fork child", "sandbox", sb.ID, "err", err)
			}
			if err := m.cfg.Proc.Cleanup(ctx, sb.ID); err != nil {
				m.log.Warn("process cleanup of a prepared fork child", "sandbox", sb.ID, "err", err)
			}
			b.delSandboxes = append(b.delSandboxes, sb.ID)
			continue
		}
		if sb.Head != "" && m.ckpts[sb.Head] == nil {
			sb.Head = ""
		}
		if sb.Status == StatusRunning {
			if err := m.cfg.FS.Cleanup(ctx, sb.ID); err != nil {
				m.log.Warn("fs cleanup after restart", "sandbox", sb.Name, "err", err)
			}
			if err := m.cfg.Proc.Cleanup(ctx, sb.ID); err != nil {
				m.log.Warn("process cleanup after restart", "sandbox", sb.Name, "err", err)
			}
			sb.Status = StatusStopped
			sb.Epoch = max(sb.Epoch, sb.EpochLimit) + 1
			why := "daemon restarted"
			if rebooted {
				why = "host rebooted"
			}
			own := false
			for _, c := range m.ckpts {
				own = own || c.rec.Sandbox == sb.ID
			}
			if own {
				sb.Note = why + "; restore a checkpoint to bring it back"
			} else {
				// Nothing to come back from: a sandbox made and never
				// checkpointed, a fork child that took no turn.
				sb.Note = why + "; it has no checkpoint of its own to come back from: remove it (rewind rm) and create or fork it again"
			}
			b.putSandboxes = append(b.putSandboxes, sb)
		}
		// No policy yet: the store keeps only its name, and the sandbox is
		// stopped; the restore that brings it back loads it (loadPolicy),
		// so a daemon start does not wait for policies nothing runs yet.
		s := &sbox{rec: *sb, q: newQueue()}
		for _, c := range m.ckpts {
			if c.rec.Sandbox == sb.ID && c.rec.Seq > s.seq {
				s.seq = c.rec.Seq
			}
		}
		m.byName[sb.Name] = s
		m.byID[sb.ID] = s
	}
	if err := m.st.apply(b); err != nil {
		return err
	}
	m.sweepImages(ctx, true)
	m.log.Info("state recovered", "sandboxes", len(m.byName), "checkpoints", len(m.ckpts),
		"pins", len(m.pins), "rebooted", rebooted)
	return nil
}

// Close waits for asynchronous work, stops every sandbox's processes and
// mounts, and closes the store. Sandboxes stay in the store (stopped) and
// their checkpoints stay restorable as far as the back ends allow.
func (m *Manager) Close(ctx context.Context) error {
	m.mu.Lock()
	if m.closed {
		m.mu.Unlock()
		return nil
	}
	m.closed = true
	sbs := make([]*sbox, 0, len(m.byID))
	for _, s := range m.byID {
		sbs = append(sbs, s)
	}
	m.mu.Unlock()
	m.stopWarm()
	for _, s := range sbs {
		select {
		case <-s.q.idle():
		case <-ctx.Done():
		}
	}
	// Asynchronous work (durable phases, releases) gets until ctx ends; a
	// back end stuck in it must not keep the daemon from stopping (the
	// store is crash-safe either way).
	waited := make(chan struct{})
	go func() { m.wg.Wait(); close(waited) }()
	select {
	case <-waited:
	case <-ctx.Done():
		m.log.Warn("shutdown: asynchronous checkpoint work did not finish in time; leaving it")
	}
	m.stopSandboxes(sbs)
	m.pmu.Lock() // no store write in flight
	defer m.pmu.Unlock()
	return m.st.close()
}

// cleanLeftovers cleans up what the back ends hold for sandboxes the store
// does not know (see LeftoverLister): a daemon that died while creating
// them. Nothing of them runs in this daemon yet.
func (m *Manager) cleanLeftovers(ctx context.Context, known []*Sandbox) {
	ll, ok := m.cfg.FS.(LeftoverLister)
	if !ok {
		return
	}
	ids, err := ll.Leftovers(ctx)
	if err != nil {
		m.log.Warn("list what a previous daemon left", "err", err)
		return
	}
	isKnown := make(map[string]bool, len(known))
	for _, sb := range known {
		isKnown[sb.ID] = true
	}
	for _, id := range ids {
		if isKnown[id] {
			continue
		}
		// Processes first: they may hold the mount.
		if err := m.cfg.Proc.Cleanup(ctx, id); err != nil {
			m.log.Warn("process cleanup of a sandbox without a record", "sandbox", id, "err", err)
		}
		if err := m.cfg.FS.Cleanup(ctx, id); err != nil {
			m.log.Warn("fs cleanup of a sandbox without a record", "sandbox", id, "err", err)
			continue
		}
		m.log.Info("cleaned up a sandbox a previous daemon left without a record", "sandbox", id)
	}
}

// stopParallel bounds the sandboxes that stopSandboxes tears down at once.
const stopParallel = 8

// stopSandboxes tears down the live side of sbs, several at a time: one
// sandbox whose teardown waits (processes that take long to die, a mount
// whose FUSE connection has to be aborted) holds up no other.
func (m *Manager) stopSandboxes(sbs []*sbox) {
	sem := make(chan struct{}, stopParallel)
	var wg sync.WaitGroup
	for _, s := range sbs {
		wg.Add(1)
		sem <- struct{}{}
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			m.stopSandbox(s)
		}()
	}
	wg.Wait()
}

// stopSandbox tears down the live side; the record is left as is in the
// store (running), so the next Open treats it like a crash and cleans up.
func (m *Manager) stopSandbox(s *sbox) {
	m.mu.Lock()
	win, proc, mount := s.win, s.proc, s.mount
	s.win, s.proc, s.mount, s.winOpen = nil, nil, nil, false
	m.mu.Unlock()
	if win != nil {
		win.Close()
	}
	if proc != nil {
		if err := proc.Close(); err != nil {
			m.log.Warn("close sandbox processes", "sandbox", s.rec.Name, "err", err)
		}
	}
	if mount != nil {
		if err := mount.Unmount(); err != nil {
			m.log.Warn("unmount sandbox", "sandbox", s.rec.Name, "err", err)
		}
	}
}

var nameRE = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$`) })

func newID(prefix string) string {
	var b [6]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return prefix + hex.EncodeToString(b[:])
}

// persist writes what build puts in a batch; build runs under m.mu and must
// copy the records it stores.
func (m *Manager) persist(build func(b *batch)) error {
	m.pmu.Lock()
	defer m.pmu.Unlock()
	b := &batch{}
	m.mu.Lock()
	build(b)
	m.mu.Unlock()
	return m.st.apply(b)
}

func cloneSandbox(s *Sandbox) *Sandbox {
	c := *s
	c.Bases = append([]string(nil), s.Bases...)
	return &c
}

func cloneCkpt(c *Checkpoint) *Checkpoint {
	cp := *c
	if c.Proc != nil {
		p := *c.Proc
		cp.Proc = &p
	}
	return &cp
}

// lookup finds a sandbox by name (or id) and checks the epoch if nonzero.
// Call with m.mu held.
func (m *Manager) lookup(name string, epoch uint64) (*sbox, error) {
	if m.closed {
		return nil, errf(CodeConflict, "daemon is shutting down", nil)
	}
	s := m.byName[name]
	if s == nil {
		s = m.byID[name]
	}
	if s == nil || s.removed {
		return nil, errf(CodeNotFound, "no sandbox "+strconv.Quote(name), nil)
	}
	if epoch != 0 && epoch > s.rec.Epoch {
		// Not stale: no answer of this sandbox ever carried it (another
		// sandbox's, or made up).
		return nil, errf(CodeStaleEpoch, fmt.Sprintf("sandbox %s: epoch %d is ahead of its current epoch %d: not one it handed out", s.rec.Name, epoch, s.rec.Epoch), nil)
	}
	if epoch != 0 && epoch != s.rec.Epoch {
		return nil, errf(CodeStaleEpoch, fmt.Sprintf("sandbox %s: stale epoch %d (current %d): it was restored since", s.rec.Name, epoch, s.rec.Epoch), nil)
	}
	return s, nil
}

// endWindow closes s's probe window if one is open and returns its report
// (nil when there was none or the probe failed).
func (m *Manager) endWindow(ctx context.Context, s *sbox) *effect.Report {
	m.mu.Lock()
	win, open := s.win, s.winOpen
	s.winOpen = false
	m.mu.Unlock()
	if win == nil || !open {
		return nil
	}
	r, err := win.End(ctx)
	if err != nil {
		m.log.Warn("probe", "sandbox", s.rec.Name, "err", err)
		return nil
	}
	return r
}

// beginWindow opens s's next probe window (if it has a probe).
func (m *Manager) beginWindow(ctx context.Context, s *sbox) {
	m.mu.Lock()
	win, open := s.win, s.winOpen
	m.mu.Unlock()
	if win == nil || open {
		return
	}
	if err := win.Begin(ctx); err != nil {
		m.log.Warn("probe", "sandbox", s.rec.Name, "err", err)
		return
	}
	m.mu.Lock()
	if s.win == win {
		s.winOpen = true
	}
	m.mu.Unlock()
}

// resumeWindow opens s's next probe window from the moment the last one
// ended, when its probe can (ProbeResumer): the caller's work since then
// left the processes alone. Otherwise beginWindow opens it later.
func (m *Manager) resumeWindow(ctx context.Context, s *sbox) {
	m.mu.Lock()
	win, open := s.win, s.winOpen
	m.mu.Unlock()
	r, ok := win.(ProbeResumer)
	if !ok || open || r.Resume(ctx) != nil {
		return
	}
	m.mu.Lock()
	if s.win == win {
		s.winOpen = true
	}
	m.mu.Unlock()
}

// touch marks s as changed since its head (an agent operation runs).
func (m *Manager) touch(s *sbox) {
	m.mu.Lock()
	s.dirty = true
	m.mu.Unlock()
}

func (m *Manager) running(s *sbox) error {
	if s.rec.Status != StatusRunning || s.proc == nil {
		msg := "sandbox " + s.rec.Name + " is " + s.rec.Status
		if s.rec.Note != "" {
			msg += " (" + s.rec.Note + ")"
		}
		return errf(CodeConflict, msg, nil)
	}
	return nil
}

// CreateRequest describes a new sandbox.
type CreateRequest struct {
	Name   string
	Bases  []string
	FS     string
	Policy string
}

// Create creates and starts a sandbox.
func (m *Manager) Create(ctx context.Context, req CreateRequest) (*Sandbox, error) {
	if !nameRE().MatchString(req.Name) {
		return nil, errf(CodeBadRequest, "invalid sandbox name "+strconv.Quote(req.Name)+" (letters, digits, _ . -; at most 63)", nil)
	}
	switch req.FS {
	case "":
		req.FS = "auto"
	case "auto", "fuse", "kernel":
	default:
		return nil, errf(CodeBadRequest, "unknown fs "+strconv.Quote(req.FS)+" (want auto, fuse or kernel)", nil)
	}
	for i, b := range req.Bases {
		if !filepath.IsAbs(b) {
			return nil, errf(CodeBadRequest, "base "+strconv.Quote(b)+" is not an absolute path", nil)
		}
		req.Bases[i] = filepath.Clean(b)
		if st, err := os.Stat(req.Bases[i]); err != nil {
			return nil, errf(CodeBadRequest, "base "+strconv.Quote(b), err)
		} else if !st.IsDir() {
			return nil, errf(CodeBadRequest, "base "+strconv.Quote(b)+" is not a directory", nil)
		}
		if err := m.checkBase(req.Bases[i]); err != nil {
			return nil, err
		}
	}
	if req.Policy == "" {
		req.Policy = m.cfg.DefaultPolicy
	} else if (strings.Contains(req.Policy, "/") || strings.HasSuffix(req.Policy, ".wasm")) && !filepath.IsAbs(req.Policy) {
		// The daemon would read it relative to its own working
		// directory, not the caller's.
		return nil, errf(CodeBadRequest, "policy module path "+strconv.Quote(req.Policy)+" is not absolute (the daemon reads it, from its own working directory)", nil)
	}
	if err := m.reserve(req.Name); err != nil {
		return nil, err
	}
	defer m.unreserve(req.Name)
	var pol Policy
	if m.cfg.Policies != nil && req.Policy != "" {
		p, err := m.cfg.Policies.Load(ctx, req.Policy)
		if err != nil {
			return nil, errf(CodeBadRequest, "policy "+req.Policy, err)
		}
		pol = p
	}
	if r, ok := m.cfg.FS.(FSKindResolver); ok {
		req.FS = r.ResolveKind(req.FS)
	}
	rec := Sandbox{
		ID: newID("sb-"), Name: req.Name, Bases: req.Bases, FSKind: req.FS, Policy: req.Policy,
		Status: StatusRunning, Epoch: 1, Created: time.Now().UTC(),
	}
	s := &sbox{rec: rec, q: newQueue(), policy: pol}
	mount, err := m.cfg.FS.Mount(ctx, rec.ID, m.spec(&rec))
	if err != nil {
		return nil, fmt.Errorf("create %s: mount: %w", req.Name, err)
	}
	if err := m.startLive(ctx, s, mount, nil, runFiles(&s.rec)); err != nil {
		return nil, fmt.Errorf("create %s: %w", req.Name, err)
	}
	if err := m.register(s); err != nil {
		m.stopSandbox(s)
		return nil, err
	}
	m.log.Info("sandbox created", "sandbox", rec.Name, "id", rec.ID, "bases", rec.Bases, "fs", rec.FSKind)
	out := cloneSandbox(&s.rec)
	return out, nil
}

// loadPolicy loads the policy s's record names, with the loader Create
// uses, when s has none loaded: a sandbox recovered from the store, which
// keeps the policy's name only. A policy that cannot be loaded any more
// (its .wasm file gone, say) does not keep the sandbox from coming back:
// full checkpoints lose nothing. It is logged, and kept in s.policyErr,
// which the sandbox's note and every auto turn's reason report. Only an
// ended ctx fails the call (nothing was started then).
func (m *Manager) loadPolicy(ctx context.Context, s *sbox) error {
	m.mu.Lock()
	name, loaded := s.rec.Policy, s.policy != nil
	m.mu.Unlock()
	if m.cfg.Policies == nil || name == "" || loaded {
		return nil
	}
	p, err := m.cfg.Policies.Load(ctx, name)
	if err != nil && ctx.Err() != nil {
		return fmt.Errorf("load policy %s: %w", name, err)
	}
	m.mu.Lock()
	if err != nil {
		s.policy, s.policyErr = nil, fmt.Errorf("policy %s could not be loaded: %w", name, err)
	} else {
		s.policy, s.policyErr = p, nil
	}
	m.mu.Unlock()
	if err != nil {
		m.log.Error("policy could not be loaded; auto turns take full checkpoints", "sandbox", s.rec.Name, "policy", name, "err", err)
	}
	return nil
}

// policyNote is the sandbox note that reports s.policyErr ("" without
// one). Call with m.mu held.
func policyNote(s *sbox) string {
	if s.policyErr == nil {
		return ""
	}
	return s.policyErr.Error() + "; auto turns take full checkpoints"
}

// checkBase refuses a base directory that would show a sandbox what
// Config.Hide keeps from it (the daemon's state: other sandboxes' files,
// process images, the database): a hidden path, one inside it, or one
// holding it elsewhere than at its own path (the host's root, where it
// is, hides it there). Symbolic links are resolved first.
func (m *Manager) checkBase(base string) error {
	real := func(p string) string {
		if r, err := filepath.EvalSymlinks(p); err == nil {
			return r
		}
		return p
	}
	b := real(base)
	for _, h := range m.cfg.Hide {
		h = real(filepath.Clean(h))
		if b == "/" {
			continue // the hidden path stays at its own path, hidden there
		}
		if rel, err := filepath.Rel(h, b); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return errf(CodeBadRequest, "base "+strconv.Quote(base)+" is inside "+h+", which the daemon keeps from sandboxes (its state)", nil)
		}
		if rel, err := filepath.Rel(b, h); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
			return errf(CodeBadRequest, "base "+strconv.Quote(base)+" holds "+h+", which the daemon keeps from sandboxes (its state): use a directory beside it", nil)
		}
	}
	return nil
}

func (m *Manager) spec(rec *Sandbox) FSSpec {
	return FSSpec{Bases: rec.Bases, Kind: rec.FSKind, Hide: m.cfg.Hide}
}

// startLive starts the processes on mount (restoring part if non-nil) and
// the probe; on error everything started is torn down, mount included.
func (m *Manager) startLive(ctx context.Context, s *sbox, mount FSMount, part *ProcPart, runFiles map[string]string) (err error) {
	t0 := time.Now()
	var proc ProcSandbox
	if sf, ok := m.cfg.Proc.(ProcStarterFor); ok && part != nil {
		proc, err = sf.StartFor(ctx, s.rec.ID, mount.Root(), part)
	} else {
		proc, err = m.cfg.Proc.Start(ctx, s.rec.ID, mount.Root())
	}
	if err != nil {
		mount.Unmount()
		return fmt.Errorf("start processes: %w", err)
	}
	t1 := time.Now()
	for name, data := range runFiles {
		if err := proc.WriteRunFile(name, []byte(data)); err != nil {
			proc.Close()
			mount.Unmount()
			return fmt.Errorf("write /run/rewind/%s: %w", name, err)
		}
	}
	path := ""
	if part != nil {
		path, err = proc.Restore(ctx, part, func() error { return nil })
		if err != nil {
			proc.Close()
			mount.Unmount()
			return fmt.Errorf("restore processes: %w", err)
		}
	}
	_ = path
	t2 := time.Now()
	var win ProbeWindow
	if m.cfg.Probe != nil {
		w, err := m.cfg.Probe.Watch(ctx, s.rec.Name, mount, proc)
		if err != nil {
			m.log.Warn("probe unavailable; auto turns take full checkpoints", "sandbox", s.rec.Name, "err", err)
		} else {
			win = w
		}
	}
	m.mu.Lock()
	s.mount, s.proc, s.win, s.winOpen = mount, proc, win, win != nil
	m.mu.Unlock()
	m.log.Debug("sandbox processes started", "sandbox", s.rec.ID, "init", t1.Sub(t0), "restore", t2.Sub(t1), "probe", time.Since(t2))
	return nil
}

func (m *Manager) reserve(name string) error {
	m.mu.Lock()
	defer m.mu.Unlock()
	if m.closed {
		return errf(CodeConflict, "daemon is shutting down", nil)
	}
	if m.byName[name] != nil || m.reserved[name] {
		return errf(CodeExists, "sandbox "+strconv.Quote(name)+" already exists", nil)
	}
	if isSandboxID(name) {
		// Calls take a sandbox's id where they take its name: such a
		// name would shadow the sandbox with that id.
		return errf(CodeBadRequest, "invalid sandbox name "+strconv.Quote(name)+": it has the form of a sandbox id (sb- and 12 hex digits)", nil)
	}
	m.reserved[name] = true
	return nil
}

// nextNumber is one more than the highest N of the sandboxes (and the
// names reserved for ones being made) named prefix+N, or 1.
func (m *Manager) nextNumber(prefix string) int {
	m.mu.Lock()
	defer m.mu.Unlock()
	top := 0
	see := func(name string) {
		if rest, ok := strings.CutPrefix(name, prefix); ok {
			if n, err := strconv.Atoi(rest); err == nil && n > top && strconv.Itoa(n) == rest {
				top = n
			}
		}
	}
	for name := range m.byName {
		see(name)
	}
	for name := range m.reserved {
		see(name)
	}
	return top + 1
}

// isSandboxID reports whether name has the form of a sandbox id (newID).
func isSandboxID(name string) bool {
	rest, ok := strings.CutPrefix(name, "sb-")
	return ok && len(rest) == 12 && strings.Trim(rest, "0123456789abcdef") == ""
}

func (m *Manager) unreserve(name string) {
	m.mu.Lock()
	delete(m.reserved, name)
	m.mu.Unlock()
}

func (m *Manager) register(s *sbox) error {
	if err := m.persist(func(b *batch) { b.putSandboxes = append(b.putSandboxes, cloneSandbox(&s.rec)) }); err != nil {
		return err
	}
	m.mu.Lock()
	m.byName[s.rec.Name] = s
	m.byID[s.rec.ID] = s
	m.mu.Unlock()
	return nil
}

// Get returns one sandbox.
func (m *Manager) Get(name string) (*Sandbox, error) {
	m.mu.Lock()
	defer m.mu.Unlock()
	s, err := m.lookup(name, 0)
	if err != nil {
		return nil, err
	}
	return cloneSandbox(&s.rec), nil
}

// List returns every sandbox, by name.
func (m *Manager) List() []*Sandbox {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]*Sandbox, 0, len(m.byName))
	for _, s := range m.byName {
		out = append(out, cloneSandbox(&s.rec))
	}
	sort.Slice(out, func(i, j int) bool { return out[i].Name < out[j].Name })
	return out
}

// op runs fn in the sandbox's order after checking the epoch (again when
// its turn comes: a restore ahead in line makes the call stale).
func (m *Manager) op(ctx context.Context, name string, epoch uint64, fn func(s *sbox) error) error {
	m.mu.Lock()
	s, err := m.lookup(name, epoch)
	m.mu.Unlock()
	if err != nil {
		return err
	}
	defer m.servedWarm(s)
	return s.q.run(ctx, func() error {
		m.mu.Lock()
		_, err := m.lookup(s.rec.ID, epoch)
		m.mu.Unlock()
		if err != nil {
			return err
		}
		return fn(s)
	})
}

// Exec runs a one-shot command in the sandbox and returns its exit code.
func (m *Manager) Exec(ctx context.Context, name string, epoch uint64, req ExecRequest) (int, error) {
	if len(req.Argv) == 0 {
		return 0, errf(CodeBadRequest, "exec: empty command", nil)
	}
	if err := checkCommand("exec", req.Argv, req.Env, req.Dir); err != nil {
		return 0, err
	}
	code := 0
	err := m.op(ctx, name, epoch, func(s *sbox) error {
		if err := m.running(s); err != nil {
			return err
		}
		m.touch(s)
		c, err := s.proc.Exec(ctx, req)
		code = c
		return err
	})
	return code, err
}

// checkCommand refuses what no process can be started with (a bad
// request, not a failure of the sandbox): a NUL in an argument or an
// environment entry, an entry without "=", a relative working directory.
func checkCommand(what string, argv, env []string, dir string) error {
	for _, a := range argv {
		if strings.ContainsRune(a, 0) {
			return errf(CodeBadRequest, what+": argument "+strconv.Quote(a)+" holds a NUL byte", nil)
		}
	}
	for _, e := range env {
		if k, _, ok := strings.Cut(e, "="); !ok || k == "" || strings.ContainsRune(e, 0) {
			return errf(CodeBadRequest, what+": environment entry "+strconv.Quote(e)+" is not NAME=VALUE", nil)
		}
	}
	if dir != "" && (!filepath.IsAbs(dir) || strings.ContainsRune(dir, 0)) {
		return errf(CodeBadRequest, what+": working directory "+strconv.Quote(dir)+" is not an absolute path", nil)
	}
	return nil
}

// StartSession starts a long-lived process driven through Send.
func (m *Manager) StartSession(ctx context.Context, name string, epoch uint64, session string, argv, env []string) (string, error) {
	if len(argv) == 0 {
		return "", errf(CodeBadRequest, "session: empty command", nil)
	}
	if err := checkCommand("session", argv, env, ""); err != nil {
		return "", err
	}
	if session == "" {
		session = newID("s")[:7]
	}
	if !nameRE().MatchString(session) {
		return "", errf(CodeBadRequest, "invalid session id "+strconv.Quote(session), nil)
	}
	err := m.op(ctx, name, epoch, func(s *sbox) error {
		if err := m.running(s); err != nil {
			return err
		}
		for _, id := range s.proc.Sessions() {
			if id == session {
				return errf(CodeExists, "session "+session+" already exists", nil)
			}
		}
		m.touch(s)
		return s.proc.StartSession(ctx, session, argv, env)
	})
	return session, err
}

// Send writes text and a newline to a session and returns its answer.
func (m *Manager) Send(ctx context.Context, name string, epoch uint64, req SendRequest) (SendAnswer, error) {
	if req.Until != "" {
		if _, err := regexp.Compile(req.Until); err != nil {
			return SendAnswer{}, errf(CodeBadRequest, "--until", err)
		}
	}
	var out SendAnswer
	err := m.op(ctx, name, epoch, func(s *sbox) error {
		if err := m.running(s); err != nil {
			return err
		}
		found := false
		for _, id := range s.proc.Sessions() {
			found = found || id == req.Session
		}
		if !found {
			return errf(CodeNotFound, "no session "+strconv.Quote(req.Session)+" in sandbox "+s.rec.Name, nil)
		}
		m.touch(s)
		o, err := s.proc.Send(ctx, req)
		out = o
		return err
	})
	return out, err
}

// Sessions lists the ids of the sandbox's sessions whose process runs, in
// no particular order (never nil).
func (m *Manager) Sessions(ctx context.Context, name string) ([]string, error) {
	ids := []string{}
	err := m.op(ctx, name, 0, func(s *sbox) error {
		if err := m.running(s); err != nil {
			return err
		}
		ids = append(ids, s.proc.Sessions()...)
		return nil
	})
	return ids, err
}

// StopSession kills a session's process (and its process group) and
// forgets the session. The processes it leaves behind are the sandbox's
// like any others: the next turn sees that they changed.
func (m *Manager) StopSession(ctx context.Context, name string, epoch uint64, session string) error {
	return m.op(ctx, name, epoch, func(s *sbox) error {
		if err := m.running(s); err != nil {
			return err
		}
		if !slices.Contains(s.proc.Sessions(), session) {
			return errf(CodeNotFound, "no session "+strconv.Quote(session)+" in sandbox "+s.rec.Name, nil)
		}
		ss, ok := s.proc.(SessionStopper)
		if !ok {
			return errf(CodeBadRequest, "this daemon's process back end cannot stop a session", nil)
		}
		m.touch(s)
		if err := ss.StopSession(ctx, session); err != nil {
			return fmt.Errorf("stop session %s: %w", session, err)
		}
		return nil
	})
}

// Remove stops a sandbox and forgets it. Its checkpoints stay until GC
// finds them unreachable (pinned ones stay, usable by fork).
func (m *Manager) Remove(ctx context.Context, name string) error {
	return m.op(ctx, name, 0, func(s *sbox) error {
		m.mu.Lock()
		var durables []chan struct{}
		for _, c := range m.ckpts {
			if c.rec.Sandbox == s.rec.ID {
				durables = append(durables, c.durable)
			}
		}
		m.mu.Unlock()
		for _, d := range durables {
			<-d
		}
		m.stopSandbox(s)
		if err := m.persist(func(b *batch) { b.delSandboxes = append(b.delSandboxes, s.rec.ID) }); err != nil {
			return err
		}
		m.mu.Lock()
		s.removed = true
		delete(m.byName, s.rec.Name)
		delete(m.byID, s.rec.ID)
		m.mu.Unlock()
		m.log.Info("sandbox removed", "sandbox", s.rec.Name)
		return nil
	})
}
