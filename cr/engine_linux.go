package cr

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/cr/inject"
	"github.com/rewind-sandbox/rewind/internal/pause"
	"golang.org/x/sys/unix"
)

// Target is the sandbox as the engine sees it. *sandbox.Sandbox provides
// both methods.
type Target interface {
	// ID is the sandbox id.
	ID() string
	// InitPID is the host pid of the sandbox's PID 1 (never traced or dumped).
	InitPID() int
}

// Freezer is implemented by targets that can freeze all their processes at
// once (cgroup freezer). The engine uses it, when present, to stop every
// process atomically for the consistency barrier.
type Freezer interface {
	Freeze(ctx context.Context) error
	Thaw(ctx context.Context) error
}

// Members is implemented by targets that list their processes in one
// cheap read (a cgroup's member list; init, helpers and exiting processes
// may be among them). A restore uses it, when present, to find the live
// processes to signal, and to confirm that none is left before the copies
// run unless a process of the sandbox may be outside the cgroup (see
// Engine.strays): then a walk of init's descendants confirms.
type Members interface {
	MemberPIDs() ([]int, error)
}

// Config configures an Engine. Zero values select defaults.
type Config struct {
	// CRIUPath is the criu binary; "" searches $REWIND_CRIU,
	// /opt/rewind/criu/sbin/criu, then PATH.
	CRIUPath string
	// CRIURunDir holds criu's per-run private directories. It is emptied
	// when the engine first runs criu, so what a killed process left
	// there goes with its next start; "" uses a temp dir of the engine's
	// own, removed by Close.
	CRIURunDir string
	// ImagesDir holds CRIU images (preferably tmpfs); "" disables images.
	ImagesDir string
	// MaxTemplates bounds the number of checkpoints holding templates
	// (default DefaultMaxTemplates).
	MaxTemplates int
	// MaxTemplateBytes bounds the private dirty memory of all templates
	// (default 4 GiB).
	MaxTemplateBytes int64
	// Warm keeps one pre-forked, pre-faulted copy of each template ready,
	// so a restore only rewires stdio and the restored process meets no
	// copy-on-write faults (async-warm).
	Warm bool
	// LazyPages restores images with CRIU lazy pages (userfaultfd): the
	// restore returns before the memory is copied in.
	LazyPages bool
	// NoCollapse turns off huge pages for checkpointed memory: by default,
	// after a checkpoint the engine asks the kernel, in the background, to
	// map the dense anonymous memory of the sandbox's processes and of
	// their templates with transparent huge pages (MADV_COLLAPSE), and a
	// warm spare is warmed that way, so later forks, restores and kills
	// no longer copy or free a page table entry per 4 KiB (see Collapse).
	NoCollapse bool
	// Logger receives engine logs (default slog.Default()).
	Logger *slog.Logger
}

// Engine creates and restores process checkpoints. It is safe for concurrent
// use.
type Engine struct {
	cfg    Config
	log    *slog.Logger
	tracer *inject.Tracer

	mu    sync.Mutex
	ckpts map[string]*ckpt
	clock uint64
	// sbMu serialises process-creating operations per sandbox, so a
	// process being forked is never mistaken for a live one.
	sbMu map[string]*sync.Mutex
	// nsMu keeps a sandbox's mount namespace still while criu dumps a
	// copy in it without the sandbox's lock (read) against a restore that
	// replaces the namespace's root (write, RestoreOptions.Reroot): criu
	// reads the namespace's mounts and /proc throughout a dump, and a
	// pivot_root in the middle failed 6 background dumps in 40 of
	// checkpoints restored away from at once ("Can't read link of fd",
	// "Can't lookup mount").
	nsMu map[string]*sync.RWMutex
	// runner is the CRIU runner, made on first use.
	runner *criu.Runner
	// bg tracks background spare creation; closing stops new ones.
	bg      sync.WaitGroup
	closing bool
	// aux are copies being dumped (pid -> sandbox id); they outlive a
	// dropped checkpoint until criu is done with them.
	aux map[int]string
	// strays are the sandboxes (ids) where a process may live outside
	// the sandbox's cgroup, so that its member list (Members) may miss
	// one: set when a CRIU restore into the sandbox left a descendant of
	// its init outside the list (CRIU restores join the sandbox's cgroups,
	// so that is not expected), cleared by DropSandbox. The sandbox's
	// processes cannot leave their cgroup on their own (no cgroup file
	// system, no CAP_SYS_ADMIN).
	strays map[string]bool
	// lastPIDMu serialises the dumps' raises of PID counters (dumpCopy).
	lastPIDMu sync.Mutex
	// dumps tracks background image dumps; life ends when Close starts,
	// which cancels them (criu is killed) and waits for them, so no dump
	// outlives the runner whose wrapper scripts it runs.
	dumps   sync.WaitGroup
	life    context.Context
	endLife context.CancelFunc
	// collapsing are the pids (and their sandboxes) whose memory a
	// background collapse is working on (goCollapse), so checkpoints in a
	// row start one each.
	collapsing map[int]string
	// lastCollapse is when each live process's memory was last collapsed
	// (goCollapse, recollapseAfter).
	lastCollapse map[int]time.Time
	// beforeDump, if set (tests), runs before a checkpoint's image dump
	// starts.
	beforeDump func()
	// writing are the checkpoints whose image directories are being
	// written or removed now (a CRIU-path checkpoint, a background dump,
	// a Drop's removal): SweepImages leaves them and their sandboxes'
	// directories alone.
	writing map[string]*imageWork
}

// imageWork counts the works on one checkpoint's image directory
// (Engine.writing).
type imageWork struct {
	sandbox string
	n       int
}

// goSpare starts makeSpare in the background unless the engine is closing.
func (e *Engine) goSpare(tm *template) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closing {
		return
	}
	e.bg.Add(1)
	go func() {
		defer e.bg.Done()
		e.makeSpare(tm)
	}()
}

// goDump starts dumpTemplates in the background; once the engine is
// closing, the checkpoint gets no image instead.
func (e *Engine) goDump(c *ckpt, t Target) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closing {
		c.image.ImageErr = errClosing
		close(c.imageDone)
		return
	}
	e.dumps.Add(1)
	e.writingLocked(c.rec.ID, c.rec.Sandbox)
	go func() {
		defer e.dumps.Done()
		defer e.written(c.rec.ID)
		e.dumpTemplates(c, t)
	}()
}

// writingImage marks checkpoint id of sandbox sb as having its image
// directory written or removed (Engine.writing) until written(id).
func (e *Engine) writingImage(id, sb string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.writingLocked(id, sb)
}

func (e *Engine) writingLocked(id, sb string) {
	w := e.writing[id]
	if w == nil {
		w = &imageWork{sandbox: sb}
		e.writing[id] = w
	}
	w.n++
}

func (e *Engine) written(id string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if w := e.writing[id]; w != nil {
		if w.n--; w.n <= 0 {
			delete(e.writing, id)
		}
	}
}

// errClosing is the image error of a checkpoint taken while the engine
// closes.
var errClosing = errors.New("engine closing: no image written")

func (e *Engine) sandboxLock(id string) *sync.Mutex { return lockOf(e, e.sbMu, id) }

// nsLock is sandbox id's nsMu.
func (e *Engine) nsLock(id string) *sync.RWMutex { return lockOf(e, e.nsMu, id) }

// lockOf returns sandbox id's lock in m, made on first use (under e.mu).
func lockOf[L any](e *Engine, m map[string]*L, id string) *L {
	e.mu.Lock()
	defer e.mu.Unlock()
	l, ok := m[id]
	if !ok {
		l = new(L)
		m[id] = l
	}
	return l
}

// Mode says how a checkpoint's processes are kept.
type Mode string

// Checkpoint modes.
const (
	ModeTemplate Mode = "template"
	ModeCRIU     Mode = "criu"
	ModeEmpty    Mode = "empty"
	// ModeParked keeps the live processes themselves, stopped (see
	// CheckpointOptions.Park).
	ModeParked Mode = "parked"
)

// Checkpoint is the record of one process checkpoint.
type Checkpoint struct {
	// ID is the caller's checkpoint id.
	ID string
	// Sandbox is the sandbox id.
	Sandbox string
	// Mode is how the processes are kept.
	Mode Mode
	// Reason explains why Mode is not ModeTemplate (empty otherwise).
	Reason string
	// Procs are the processes as they were.
	Procs []Proc
	// Frozen is how long the sandbox's processes were stopped.
	Frozen time.Duration
	// Taken is when the checkpoint was taken.
	Taken time.Time
}

// Parts says which parts of a checkpoint are ready.
type Parts struct {
	// Template is true while templates for every process exist.
	Template bool
	// Image is true once a CRIU image of every process exists.
	Image bool
	// ImageDir is the image directory (when Image).
	ImageDir string
	// ImageErr is why the image failed, if it did.
	ImageErr error
}

// Stdio names the files a restored copy gets as stdin, stdout and stderr:
// paths opened inside the copy (in its mount namespace), e.g.
// "/proc/1/fd/7" for a pipe end held by the sandbox init. Empty keeps
// what the template had (/dev/null).
type Stdio struct {
	Stdin, Stdout, Stderr string
	// Files are the same three files open in the caller (the daemon's
	// child ends); a CRIU restore hands them over directly. When nil, the
	// paths are opened through /proc/<init>/root.
	Files [3]*os.File
	// Started, if set, is called with the host pid of the copy once it runs.
	Started func(pid int) error
}

// RestoreOptions tune Restore and Fork.
type RestoreOptions struct {
	// SwitchFS runs after the live processes are gone and before the
	// copies run (Restore only). "Gone" means that every thread of them
	// has begun to exit: none is in a system call any more, but their
	// address spaces may still be torn down, and the teardown writes back
	// the dirty pages of shared file mappings (a FUSE file's, through its
	// server). So SwitchFS must flush those first (syncfs: the killed
	// processes dirty nothing more) if what they write must not reach
	// the switched view.
	SwitchFS func() error
	// Reroot says that SwitchFS replaces the root mount of the sandbox's
	// mount namespace (a stock-kernel native overlay) instead of changing
	// the content under it. pivot_root moves every process's root, but a
	// template-forked copy keeps its working directory, open files,
	// executable and file mappings on the old, detached view: each copy
	// re-enters its working directory and reopens its files of the old
	// root mount by path before it runs. Its executable and mappings stay
	// on the old view (the same files, read-only), which criu could not
	// dump (it looks each file's mount up in the namespace): every dump
	// declares the files on mounts outside the namespace external and a
	// restore gives criu the files at the same paths in the current root
	// (criu.Externals). Copies restored by CRIU open everything by path.
	Reroot bool
	// Stdio returns fresh stdio for the copy of p; nil or a nil result
	// keeps /dev/null.
	Stdio func(p Proc) (*Stdio, error)
	// Pipes, if set, is asked first for every copy a template restore or
	// fork makes of p. When it returns a function, the copy gets fresh
	// pipes made inside it as stdio (stdin, and one pipe for stdout and
	// stderr; see inject.Proc.NewStdio), without a hand-over through the
	// sandbox's init, and the function is called once the copy runs with
	// its host pid and the caller's ends: stdin writes the copy's stdin,
	// output reads what it prints. The function owns both files from then
	// on. When it returns nil, Stdio is asked. CRIU restores use Stdio.
	Pipes func(p Proc) func(pid int, stdin, output *os.File) error
}

// Restored pairs a checkpointed process with its new copy.
type Restored struct {
	Orig Proc
	// PID is the host pid of the copy.
	PID int
}

// RestoreResult is what Restore did.
type RestoreResult struct {
	// Path is "template", "criu" or "criu-lazy".
	Path string
	// Procs are the recreated processes (of a CRIU restore, the roots of
	// its trees).
	Procs []Restored
	// Live are the host pids of every process the restore left in the
	// sandbox, its init and templates aside: Procs and, of a CRIU
	// restore, their descendants as restored (listed before they ran).
	// A process missing from Live was started after the restore.
	Live []int
	// Duration is the time from the kill to the last copy running.
	Duration time.Duration
	// Phases splits the restore by step, in order, starting with the wait
	// for the sandbox's lock (template path only; a step that ran once per
	// process is summed).
	Phases []Phase
}

// Phase is the time one step of a restore took.
type Phase struct {
	// Name names the step ("fork", "setsid", "stdio", "signal", ...).
	Name string
	// D is its duration.
	D time.Duration
}

// phases records consecutive steps; a nil *phases records nothing.
type phases struct {
	last time.Time
	out  []Phase
}

func newPhases() *phases { return &phases{last: time.Now()} }

// mark ends the step name.
func (p *phases) mark(name string) {
	if p == nil {
		return
	}
	now := time.Now()
	for i := range p.out {
		if p.out[i].Name == name {
			p.out[i].D += now.Sub(p.last)
			p.last = now
			return
		}
	}
	p.out = append(p.out, Phase{Name: name, D: now.Sub(p.last)})
	p.last = now
}

// CheckpointOptions tune Checkpoint.
type CheckpointOptions struct {
	// ID is the checkpoint id (unique per engine); typically the fs
	// checkpoint id.
	ID string
	// Barrier runs while every process of the sandbox is stopped; take the
	// file-system checkpoint here so both form one consistent pair.
	Barrier func() error
	// Ephemeral marks a short-lived checkpoint (a restore's undo point):
	// it gets no CRIU image and no warm spare, and restores from its
	// templates only. Drop it when done.
	Ephemeral bool
	// Park, with Ephemeral, makes the checkpoint of the live processes
	// themselves (ModeParked) when each is single-threaded, whatever the
	// process tree: they are held in a ptrace stop, no copy is made, and
	// until the checkpoint is restored (they run on as they were) or
	// dropped (they are killed) they are no longer t's live processes:
	// listings, kills and probes skip them. A restore of another
	// checkpoint meanwhile must not need their pids (a template or empty
	// checkpoint of t, not a CRIU one). Otherwise Park is ignored.
	Park bool
}

// ErrUnknown is returned for a checkpoint id the engine does not hold.
var ErrUnknown = errors.New("unknown process checkpoint")

type template struct {
	sandbox string
	dropped bool
	orig    Proc
	proc    *inject.Proc
	spare   *inject.Proc // pre-forked warmed copy (Config.Warm)
	warming *inject.Proc // spare being pre-faulted
	// spareIO are the caller's ends of the pipes the spare (or the spare
	// being warmed) has as stdio (see makeSpare); nil if it has none.
	spareIO *pipePair
	// dirty is the private dirty memory of the template and its spare
	// as last measured (measure); measured says whether it was since
	// the spare last changed.
	dirty    int64
	measured bool
	// undumpable: the original was not dumpable (copies stay so).
	undumpable bool
	// files are the template's descriptors of files (but on pseudo file
	// systems), with their offsets at the checkpoint (see ownFiles).
	files []viewFD
	// cwd is the template's working directory at the checkpoint, by path
	// in the sandbox ("" when unknown or already removed then): a copy
	// whose directory was renamed or removed in the live view after the
	// checkpoint goes back there by path after the switch (recwd).
	cwd string
}

// fileSet selects a template's files for ownFiles.
type fileSet int

const (
	// filesOffRoot are the files on other mounts than the process's
	// root (binds, tmpfs): a restore does not switch them.
	filesOffRoot fileSet = iota
	// filesOnRoot are the files of the sandbox's view (its root mount).
	filesOnRoot
	// filesAll are both.
	filesAll
)

// ownFiles gives copy cp of tm open file descriptions of its own for the
// template's files in set, at their offsets at the checkpoint. A copy made
// by fork shares them with the template, and the template shares them with
// the process it was made of, which ran on after the checkpoint and moved
// the offsets (a python that read on, a loader mapping its libraries);
// copies would also move each other's. A file that can no longer be opened
// by its path (deleted since) stays shared.
//
// A copy that a restore will run gets the files of the sandbox's view only
// once the view has been switched to the checkpoint's (startCopies):
// opened before, they would be the live view's files, which a switch
// leaves behind (an append lands in a file no view holds any more), and an
// open for writing would copy the file up into the live view for nothing.
func (e *Engine) ownFiles(tm *template, cp *inject.Proc, set fileSet) {
	for _, f := range tm.files {
		if set != filesAll && f.root != (set == filesOnRoot) {
			continue
		}
		if err := cp.Reopen(f.fd, f.path, f.flags, f.pos); err != nil {
			e.log.Debug("copy keeps a shared file", "pid", cp.Pid(), "fd", f.fd, "path", f.path, "err", err)
		}
	}
}

type ckpt struct {
	rec       Checkpoint
	templates []*template
	lastUse   uint64
	reachable bool
	image     Parts
	imageDone chan struct{}
	images    []image
	stoppedNS map[int]bool // ModeCRIU: ns pids stopped before the checkpoint
	// removeWhenDone: Drop came while the image was being written.
	removeWhenDone bool
	// busy counts restores/forks in progress using the templates.
	busy int
	// parked are the stopped live processes of a ModeParked checkpoint
	// (a template whose proc is the process itself), until it is
	// restored or dropped.
	parked []*template
}

// DefaultMaxTemplates is the default bound on the checkpoints that keep
// live templates. A tree search keeps every node it expanded reachable:
// with a full checkpoint at every turn, a search of 100 expansions outgrew
// the earlier 64 (restores of the oldest nodes went through their CRIU
// images, some 65 ms each against 2 ms from a template). A shell's template
// holds a few hundred KiB of private memory, which Config.MaxTemplateBytes
// bounds in all.
const DefaultMaxTemplates = 256

// New creates an engine.
func New(cfg Config) (*Engine, error) {
	if cfg.MaxTemplates <= 0 {
		cfg.MaxTemplates = DefaultMaxTemplates
	}
	if cfg.MaxTemplateBytes <= 0 {
		cfg.MaxTemplateBytes = 4 << 30
	}
	if cfg.Logger == nil {
		cfg.Logger = slog.Default()
	}
	life, endLife := context.WithCancel(context.Background())
	return &Engine{
		life: life, endLife: endLife,
		cfg:    cfg,
		log:    cfg.Logger.With("component", "cr"),
		tracer: inject.NewTracer(),
		ckpts:  map[string]*ckpt{},
		sbMu:   map[string]*sync.Mutex{},
		nsMu:   map[string]*sync.RWMutex{},
		aux:    map[int]string{},

		writing:      map[string]*imageWork{},
		collapsing:   map[int]string{},
		lastCollapse: map[int]time.Time{},
	}, nil
}

// Close kills every template and stops the tracer. Images stay on disk
// (Drop removes them); another engine can pick them up with LoadImages.
func (e *Engine) Close() error {
	e.mu.Lock()
	e.closing = true
	e.mu.Unlock()
	// Image dumps in flight are cancelled (an image of a sandbox going
	// away is of no use to this engine; a dump cut short leaves no image
	// that LoadImages would take) and waited for.
	e.endLife()
	e.dumps.Wait()
	// Spares being made finish first (their fork and pre-fault), so no
	// traced process is left behind when the tracer thread goes.
	e.bg.Wait()
	e.mu.Lock()
	cs := make([]*ckpt, 0, len(e.ckpts))
	for _, c := range e.ckpts {
		cs = append(cs, c)
	}
	e.mu.Unlock()
	for _, c := range cs {
		e.dropTemplates(c)
	}
	e.tracer.Close()
	if e.runner != nil {
		return e.runner.Close()
	}
	return nil
}

// templatePids returns the pids of every template (and spare) of sandbox sb.
func (e *Engine) templatePids(sb string) map[int]bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[int]bool{}
	for _, c := range e.ckpts {
		if c.rec.Sandbox != sb {
			continue
		}
		for _, t := range c.templates {
			m[t.proc.Pid()] = true
			if t.spare != nil {
				m[t.spare.Pid()] = true
			}
			if t.warming != nil {
				m[t.warming.Pid()] = true
			}
		}
	}
	for p, sbID := range e.aux {
		if sbID == sb {
			m[p] = true
		}
	}
	return m
}

// TemplatePIDs returns the host pids of every helper process the engine
// keeps in sandbox sb (templates, warmed spares, copies being dumped):
// stopped processes that are not the agent's (probes should ignore them).
func (e *Engine) TemplatePIDs(sb string) []int {
	m := e.templatePids(sb)
	out := make([]int, 0, len(m))
	for p := range m {
		out = append(out, p)
	}
	sort.Ints(out)
	return out
}

// IsTemplate reports whether pid is one of the engine's helper processes
// (see TemplatePIDs) in any sandbox.
func (e *Engine) IsTemplate(pid int) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.aux[pid]; ok {
		return true
	}
	for _, c := range e.ckpts {
		for _, t := range c.templates {
			if t.proc.Pid() == pid || (t.spare != nil && t.spare.Pid() == pid) || (t.warming != nil && t.warming.Pid() == pid) {
				return true
			}

		}
	}
	return false
}

// SparesReady reports whether every template of sandbox sb has its warmed
// spare (Config.Warm); a restore then needs no fork.
func (e *Engine) SparesReady(sb string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	for _, c := range e.ckpts {
		if c.rec.Sandbox != sb {
			continue
		}
		for _, t := range c.templates {
			if t.spare == nil {
				return false
			}
		}
	}
	return true
}

// Processes lists the live processes of t (templates and init excluded).
func (e *Engine) Processes(t Target) ([]Proc, error) {
	l := e.sandboxLock(t.ID())
	l.Lock()
	defer l.Unlock()
	return e.processes(t)
}

func (e *Engine) processes(t Target) ([]Proc, error) {
	return descendants(t.InitPID(), e.templatePids(t.ID()))
}

// templatable says why procs cannot be template-forked ("" if they can).
func templatable(init int, procs []Proc) string {
	for _, p := range procs {
		if p.Threads != 1 {
			return fmt.Sprintf("process %d (%s) has %d threads", p.PID, p.Comm, p.Threads)
		}
		if p.PPID != init {
			return fmt.Sprintf("process tree: %d (%s) is a child of %d, not of init", p.PID, p.Comm, p.PPID)
		}
	}
	return ""
}

// Checkpoint stops every process of t, runs opts.Barrier, makes a template
// of every process and lets the processes run on.
func (e *Engine) Checkpoint(ctx context.Context, t Target, opts CheckpointOptions) (*Checkpoint, error) {
	if opts.ID == "" {
		return nil, errors.New("checkpoint: empty id")
	}
	l := e.sandboxLock(t.ID())
	l.Lock()
	defer l.Unlock()
	e.mu.Lock()
	_, dup := e.ckpts[opts.ID]
	e.mu.Unlock()
	if dup {
		return nil, fmt.Errorf("checkpoint %s: id already used", opts.ID)
	}
	rec := Checkpoint{ID: opts.ID, Sandbox: t.ID(), Taken: time.Now()}
	procs, err := e.processes(t)
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", opts.ID, err)
	}
	rec.Procs = procs
	if len(procs) == 0 {
		rec.Mode = ModeEmpty
		start := time.Now()
		if opts.Barrier != nil {
			if err := opts.Barrier(); err != nil {
				return nil, fmt.Errorf("checkpoint %s: barrier: %w", opts.ID, err)
			}
		}
		rec.Frozen = time.Since(start)
		e.add(&ckpt{rec: rec})
		return &rec, nil
	}
	if opts.Park && opts.Ephemeral && parkable(procs) {
		return e.parkCheckpoint(ctx, t, rec, opts.Barrier)
	}
	viaCRIU := func(procs []Proc, why string) (*Checkpoint, error) {
		rec.Procs = procs
		rec.Mode = ModeCRIU
		rec.Reason = why
		c := &ckpt{rec: rec}
		e.writingImage(rec.ID, rec.Sandbox)
		defer e.written(rec.ID)
		if err := e.checkpointTrees(ctx, c, t, procs, opts.Barrier); err != nil {
			// The image dir stays, with criu's log, until a
			// SweepImages (no checkpoint holds it).
			return nil, fmt.Errorf("checkpoint %s: CRIU path (%s): %w", opts.ID, why, err)
		}
		e.add(c)
		return &c.rec, nil
	}
	if why := templatable(t.InitPID(), procs); why != "" {
		return viaCRIU(procs, why)
	}
	// A process that exits while being stopped fails the attempt; as long
	// as the barrier has not run, list again and retry.
	var tmpls []*template
	var frozen time.Duration
	for attempt := 0; ; attempt++ {
		ran := false
		barrier := func() error {
			ran = true
			if opts.Barrier != nil {
				return opts.Barrier()
			}
			return nil
		}
		tmpls, frozen, err = e.makeTemplates(ctx, t, procs, barrier)
		var sh *sharedStateError
		if errors.As(err, &sh) && !ran {
			// Found while the processes were stopped, before the
			// barrier: the CRIU path stops them again and dumps.
			return viaCRIU(procs, sh.why)
		}
		if err == nil || ran || attempt == 2 || ctx.Err() != nil {
			break
		}
		e.log.Debug("checkpoint retry", "checkpoint", opts.ID, "err", err)
		if procs, err = e.processes(t); err != nil {
			break
		}
		rec.Procs = procs
		if why := templatable(t.InitPID(), procs); why != "" || len(procs) == 0 {
			err = fmt.Errorf("processes changed during the checkpoint (%s)", why)
			break
		}
	}
	if err != nil {
		return nil, fmt.Errorf("checkpoint %s: %w", opts.ID, err)
	}
	rec.Mode = ModeTemplate
	rec.Frozen = frozen
	c := &ckpt{rec: rec, templates: tmpls}
	if e.cfg.ImagesDir != "" && !opts.Ephemeral {
		c.imageDone = make(chan struct{})
	}
	e.add(c)
	for _, tm := range tmpls {
		e.prepareTemplate(tm, !opts.Ephemeral)
	}
	if !opts.Ephemeral && !e.cfg.NoCollapse {
		e.goCollapse(t.ID(), tmpls)
	}
	if c.imageDone != nil {
		e.goDump(c, t)
	}
	go e.enforceBounds()
	return &rec, nil
}

// ErrNeedCRIU says a checkpoint needs the CRIU path (multi-threaded
// processes or a process tree).
var ErrNeedCRIU = errors.New("template fork impossible, CRIU needed")

// MissingFileError is a CRIU restore that failed because a file the
// image's process held is not at its path in the sandbox it was restored
// into: a file of the sandbox's view deleted since, or one on a tmpfs
// mount such as /dev/shm, which checkpoints do not hold. Trying again
// cannot help (Permanent).
type MissingFileError struct {
	// Path is the file, as inside the restored process's root.
	Path string
	// Err is CRIU's failure.
	Err error
}

func (e *MissingFileError) Error() string {
	return fmt.Sprintf("%v (the process held %s, which is not where it was: a file of the sandbox's view deleted since, "+
		"or one on a tmpfs mount such as /dev/shm, which checkpoints do not hold: a fork child, or a sandbox started "+
		"again after a daemon restart, has them empty)", e.Err, e.Path)
}

func (e *MissingFileError) Unwrap() error { return e.Err }

// Permanent reports that the same restore would fail again.
func (e *MissingFileError) Permanent() bool { return true }

func (e *Engine) add(c *ckpt) {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.clock++
	c.lastUse = e.clock
	c.reachable = true
	e.ckpts[c.rec.ID] = c
}

// sharedStateError is makeTemplates's answer for processes holding state a
// template would share with them (sharedState): nothing was checkpointed.
type sharedStateError struct{ why string }

func (e *sharedStateError) Error() string { return "template path impossible: " + e.why }

// makeTemplates is the stop-the-world part of Checkpoint.
func (e *Engine) makeTemplates(ctx context.Context, t Target, procs []Proc, barrier func() error) ([]*template, time.Duration, error) {
	start := time.Now()
	// While the processes are stopped and before the barrier (the fs
	// checkpoint): state a template would share with its original sends
	// the checkpoint to the CRIU path (see sharedState).
	checked := func() error {
		for _, p := range procs {
			if why := sharedState(p.PID); why != "" {
				return &sharedStateError{why: fmt.Sprintf("process %d (%s) holds %s, which a template would share with it", p.PID, p.Comm, why)}
			}
		}
		return barrier()
	}
	live, err := e.stopProcs(ctx, t, procs, checked)
	if err != nil {
		return nil, 0, err
	}
	release := func() {
		_ = e.tracer.Do(func() error {
			for _, p := range live {
				_ = p.Detach()
			}
			return nil
		})
	}
	var tmpls []*template
	// One hand-over to the tracer thread for every fork and guard.
	err = e.tracer.Do(func() error {
		for i, ip := range live {
			tp, err := ip.Fork(true)
			if err != nil {
				return fmt.Errorf("fork template of %d: %w", ip.Pid(), err)
			}
			tm := &template{sandbox: t.ID(), orig: procs[i], proc: tp}
			tmpls = append(tmpls, tm)
			// The offsets now, while the original is still stopped.
			tm.files = captureFiles(tp.Pid())
			tm.cwd = checkpointCwd(tp.Pid())
			// Before any process of the sandbox runs again.
			if err := guard(tm, true); err != nil {
				return fmt.Errorf("guard template of %d: %w", ip.Pid(), err)
			}
		}
		return nil
	})
	if err != nil {
		for _, tm := range tmpls {
			_ = tm.proc.Kill()
		}
		release()
		return nil, 0, err
	}
	release()
	return tmpls, time.Since(start), nil
}

// stopProcs brings every process of procs to a ptrace stop (seized by the
// engine's tracer) and runs barrier while they are stopped: with a freezer
// the processes are frozen first, seized, the barrier runs, and they reach
// their ptrace stops after the thaw. On error nothing stays stopped or
// seized; on success the caller detaches them (or keeps them: Park).
func (e *Engine) stopProcs(ctx context.Context, t Target, procs []Proc, barrier func() error) ([]*inject.Proc, error) {
	fr, canFreeze := t.(Freezer)
	if canFreeze {
		if err := fr.Freeze(ctx); err != nil {
			return nil, fmt.Errorf("freeze: %w", err)
		}
	}
	thawed := !canFreeze
	thaw := func() error {
		if thawed {
			return nil
		}
		thawed = true
		return fr.Thaw(context.WithoutCancel(ctx))
	}
	var live []*inject.Proc
	fail := func(err error) ([]*inject.Proc, error) {
		terr := thaw()
		_ = e.tracer.Do(func() error {
			for _, p := range live {
				_ = p.Detach()
			}
			return nil
		})
		return nil, errors.Join(err, terr)
	}
	if err := e.tracer.Do(func() error {
		for _, p := range procs {
			ip, err := e.tracer.Seize(p.PID)
			if err != nil {
				return err
			}
			if err := ip.Interrupt(); err != nil {
				_ = unix.PtraceDetach(p.PID)
				return err
			}
			live = append(live, ip)
		}
		return nil
	}); err != nil {
		return fail(err)
	}
	// With a freezer the processes are stopped already: the barrier runs
	// before they even reach their ptrace stops.
	if canFreeze && barrier != nil {
		if err := barrier(); err != nil {
			return fail(fmt.Errorf("barrier: %w", err))
		}
	}
	if err := thaw(); err != nil {
		return fail(fmt.Errorf("thaw: %w", err))
	}
	if err := e.tracer.Do(func() error {
		for _, ip := range live {
			if err := ip.Stopped(); err != nil {
				return err
			}
		}
		return nil
	}); err != nil {
		return fail(err)
	}
	if !canFreeze && barrier != nil {
		if err := barrier(); err != nil {
			return fail(fmt.Errorf("barrier: %w", err))
		}
	}
	return live, nil
}

// guard makes a template undumpable. A template lives in the sandbox's PID
// namespace, where the agent's processes run as root, but without
// CAP_SYS_PTRACE: an undumpable process's memory (/proc/PID/mem,
// process_vm_writev), descriptors, environment and maps are closed to them,
// so they cannot change what a restore brings back (ptrace itself is taken:
// the engine is attached). They can still kill it: a dead template is
// noticed when it is next forked, and the image is used (see Restore).
// With get, it first records whether the original was dumpable; the
// copies released from the template get that back (release).
func guard(tm *template, get bool) error {
	if get {
		d, err := tm.proc.Syscall(unix.SYS_PRCTL, unix.PR_GET_DUMPABLE)
		if err != nil {
			return err
		}
		tm.undumpable = d != 1
	}
	_, err := tm.proc.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 0)
	return err
}

// release makes a copy of tm dumpable again if the original was, just
// before it runs as the live process.
func release(tm *template, cp *inject.Proc) error {
	if tm.undumpable {
		return nil
	}
	_, err := cp.Syscall(unix.SYS_PRCTL, unix.PR_SET_DUMPABLE, 1)
	return err
}

// prepareTemplate gives the template /dev/null as stdio (so it holds no
// session pipe open) and, with Config.Warm, forks its warmed spare.
func (e *Engine) prepareTemplate(tm *template, spare bool) {
	// Its own session: the template must not keep the pid of the process
	// it copies allocated as a session and group id (see inject.Setsid).
	if err := tm.proc.Setsid(); err != nil {
		e.log.Debug("template session", "pid", tm.proc.Pid(), "err", err)
	}
	if err := tm.proc.SetStdio([3]string{"/dev/null", "/dev/null", "/dev/null"}, [3]int{unix.O_RDWR, unix.O_RDWR, unix.O_RDWR}); err != nil {
		e.log.Debug("template stdio", "pid", tm.proc.Pid(), "err", err)
	}
	if e.cfg.Warm && spare {
		e.goSpare(tm) // waits for the sandbox lock Checkpoint holds
	}
}

// pipePair are the caller's ends of a copy's stdio pipes (inject.NewStdio).
type pipePair struct{ in, out *os.File }

func (pp *pipePair) close() {
	if pp != nil {
		pp.in.Close()
		pp.out.Close()
	}
}

// makeSpare forks a copy of the template, gives it its own session and
// fresh pipes as stdio (so a restore that adopts pipes has nothing left to
// do but make it dumpable) and pre-faults its private writable memory
// while it is still stopped (no race with its own writes). The sandbox
// lock is held only for the fork and set-up; pre-faulting runs unlocked.
// The spare stays undumpable: nothing in the sandbox can reach its pipes.
func (e *Engine) makeSpare(tm *template) {
	sp := func() *inject.Proc {
		l := e.sandboxLock(tm.sandbox)
		l.Lock()
		defer l.Unlock()
		e.mu.Lock()
		busy := tm.spare != nil || tm.warming != nil || tm.dropped
		e.mu.Unlock()
		if busy {
			return nil
		}
		sp, err := tm.proc.Fork(true)
		if err != nil {
			e.log.Debug("spare fork", "pid", tm.proc.Pid(), "err", err)
			return nil
		}
		e.ownFiles(tm, sp, filesOffRoot)
		if err := sp.Setsid(); err != nil {
			e.log.Debug("spare session", "pid", sp.Pid(), "err", err)
			_ = sp.Kill()
			return nil
		}
		var io *pipePair
		if in, out, err := sp.NewStdio(); err == nil {
			io = &pipePair{in: in, out: out}
		} else {
			// Its stdio may be half replaced: make it again.
			e.log.Debug("spare stdio", "pid", sp.Pid(), "err", err)
			_ = sp.Kill()
			return nil
		}
		e.mu.Lock()
		if tm.dropped {
			// Dropped during the fork (Drop does not wait for the
			// sandbox lock), so retireLocked did not see this spare:
			// it is a helper until it is gone, never a live process of
			// the agent for the next checkpoint to seize.
			e.aux[sp.Pid()] = tm.sandbox
			e.mu.Unlock()
			_ = sp.Kill()
			io.close()
			e.forgetWhenGone(sp.Pid())
			return nil
		}
		tm.warming, tm.spareIO = sp, io
		e.mu.Unlock()
		return sp
	}()
	if sp == nil {
		return
	}
	e.warmSpare(sp.Pid())
	e.mu.Lock()
	tm.warming = nil
	dropped := tm.dropped
	var io *pipePair
	if !dropped {
		tm.spare = sp
		tm.measured = false // the spare's pre-faulted memory is new
	} else {
		io, tm.spareIO = tm.spareIO, nil
	}
	e.mu.Unlock()
	if dropped {
		_ = sp.Kill()
		io.close()
		e.forgetWhenGone(sp.Pid()) // dropTemplates made it a helper until now
	}
}

// Parts says which parts of checkpoint id are ready.
func (e *Engine) Parts(id string) (Parts, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.ckpts[id]
	if !ok {
		return Parts{}, fmt.Errorf("checkpoint %s: %w", id, ErrUnknown)
	}
	p := c.image
	p.Template = len(c.templates) > 0 || len(c.parked) > 0 || c.rec.Mode == ModeEmpty
	return p, nil
}

// Record returns the record of checkpoint id.
func (e *Engine) Record(id string) (Checkpoint, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.ckpts[id]
	if !ok {
		return Checkpoint{}, fmt.Errorf("checkpoint %s: %w", id, ErrUnknown)
	}
	return c.rec, nil
}

// killLive SIGKILLs every live process of t and waits until each one is
// exiting (PF_EXITING in every thread: none will run user code or start a
// system call again, and none is in one: a system call on the sandbox's
// file system, a write the FUSE server has read among them, has returned).
// It does not wait for the exit to finish: tearing down a large address
// space takes milliseconds and the copies need not wait for it. (What the
// teardown still writes, a shared file mapping's dirty pages, the caller
// flushes before it switches the file system: see
// RestoreOptions.SwitchFS.)
func (e *Engine) killLive(ctx context.Context, t Target, keep []int) ([]int, error) {
	return e.killLiveAfter(ctx, t, keep, killSet{}, nil)
}

// killLiveAfter is killLive when the processes were signalled already
// (signalLive: SIGKILL, or SIGSTOP for the quiet ones): it waits for them
// first, so that its first listing usually finds no process left; the
// quiet ones it need not wait for, and its listings leave them out. It
// marks "kill_wait" (the wait) and "kill_confirm" (the listings) in ph.
func (e *Engine) killLiveAfter(ctx context.Context, t Target, keep []int, signalled killSet, ph *phases) ([]int, error) {
	killed := append([]int(nil), signalled.wait...)
	for _, pid := range signalled.wait {
		waitUntil(ctx, 10*time.Second, func() bool { return groupExiting(pid) })
	}
	quiet := map[int]quietProbe{}
	for _, q := range signalled.quiet {
		killed = append(killed, q.pid)
		quiet[q.pid] = q
	}
	if len(quiet) > 0 {
		// Until a quiet process has begun to exit (when it next gets a
		// CPU, maybe after the restore returned) it looks alive: it is
		// a helper meanwhile, which no listing of the agent's processes
		// (a checkpoint's, a probe window's) takes for the agent's.
		defer func() {
			var pids []int
			e.mu.Lock()
			for pid, q := range quiet {
				if q.same(pid) {
					e.aux[pid] = t.ID()
					pids = append(pids, pid)
				}
			}
			e.mu.Unlock()
			e.forgetWhenGone(pids...)
		}()
	}
	ph.mark("kill_wait")
	defer ph.mark("kill_confirm")
	skip := e.templatePids(t.ID())
	for _, p := range keep {
		skip[p] = true
	}
	listAll := func() ([]Proc, error) { return walk(t.InitPID(), skip, false) }
	if _, ok := t.(Members); ok && !e.strayed(t.ID()) {
		// The cgroup's member list is complete: one read of it instead of
		// a walk of the init's threads' child lists (0.27 ms p50 on the
		// 2-core machine under load, against 0.07 for the wait before it).
		listAll = func() ([]Proc, error) { return liveOf(t, skip) }
	}
	list := func() ([]Proc, error) {
		procs, err := listAll()
		if len(quiet) == 0 || err != nil {
			return procs, err
		}
		out := procs[:0]
		for _, p := range procs {
			if q, ok := quiet[p.PID]; ok && q.same(p.PID) {
				continue
			}
			out = append(out, p)
		}
		return out, nil
	}
	for round := 0; round < 20; round++ {
		procs, err := list()
		if err != nil {
			return killed, err
		}
		if len(procs) == 0 {
			return killed, nil
		}
		var fds, pids []int
		for _, p := range procs {
			fd, err := unix.PidfdOpen(p.PID, 0)
			if err != nil {
				continue
			}
			_ = unix.PidfdSendSignal(fd, unix.SIGKILL, nil, 0)
			fds, pids = append(fds, fd), append(pids, p.PID)
			killed = append(killed, p.PID)
		}
		for i, fd := range fds {
			pid := pids[i]
			waitUntil(ctx, 10*time.Second, func() bool {
				pfd := []unix.PollFd{{Fd: int32(fd), Events: unix.POLLIN}}
				if n, _ := unix.Poll(pfd, 0); n > 0 {
					return true
				}
				return groupExiting(pid)
			})
			unix.Close(fd)
		}
	}
	procs, _ := list()
	if len(procs) > 0 {
		return killed, fmt.Errorf("kill processes of %s: %d survive", t.ID(), len(procs))
	}
	return killed, nil
}

// liveOf lists the live processes of t (pids only) but those in skip.
// With Members it takes one read of the cgroup's member list instead of a
// walk of init's descendants (the init has a score of threads, each with
// its own list of children). That list misses a process outside the
// cgroup (see Engine.strays): killLiveAfter then confirms with the walk.
func liveOf(t Target, skip map[int]bool) ([]Proc, error) {
	m, ok := t.(Members)
	if !ok {
		return walk(t.InitPID(), skip, false)
	}
	pids, err := m.MemberPIDs()
	if err != nil {
		return nil, err
	}
	var procs []Proc
	for _, p := range pids {
		if p != t.InitPID() && !skip[p] && !exiting(p) {
			procs = append(procs, Proc{PID: p})
		}
	}
	return procs, nil
}

// signalLive stops every live process of t but keep, without waiting, and
// returns what it signalled (killLiveAfter then waits for them).
//
// A process that may be quiet (see quietBefore) is sent SIGSTOP, after it
// is made SCHED_IDLE. It then takes no CPU from the restore: woken by a
// signal, a process of normal policy preempts the thread that sent it on
// that CPU, and a dying one (SIGKILL) unmaps its memory in the kernel,
// which on this kernel (preemption "none") ran 0.8-1 ms for a 15 MB python
// while the restore's threads waited on that CPU's run queue. It is quiet
// if it has not run since the probe (when it runs, it can only stop, in
// the call it sleeps in, before any code of its own runs) or has stopped
// (a stopped process runs nothing; what it ran before ran before the
// restore switches the file system). It gets its SIGKILL from the
// killSet's finish, which the caller runs once the restore is done, so
// that its exit does not compete with the restore either. Every other
// process, and one that turns out not quiet, is sent SIGKILL at once and
// waited for.
func (e *Engine) signalLive(t Target, keep []int) killSet {
	skip := e.templatePids(t.ID())
	for _, p := range keep {
		skip[p] = true
	}
	procs, err := liveOf(t, skip)
	if err != nil {
		return killSet{}
	}
	var ks killSet
	var probes []quietProbe
	var pfds []int // the probed processes' pidfds, open until quietAfter
	for _, p := range procs {
		q, maybe := quietBefore(p.PID)
		fd, err := unix.PidfdOpen(p.PID, 0)
		if err != nil {
			continue
		}
		sig := unix.SIGKILL
		if maybe {
			sig = unix.SIGSTOP
			schedIdle(p.PID)
		}
		if unix.PidfdSendSignal(fd, sig, nil, 0) != nil {
			unix.Close(fd)
			continue
		}
		if !maybe {
			ks.wait = append(ks.wait, p.PID)
			unix.Close(fd)
			continue
		}
		probes, pfds = append(probes, q), append(pfds, fd)
	}
	for i, q := range probes {
		if quietAfter(q, pfds[i]) || stoppedSince(q, pfds[i]) {
			ks.quiet = append(ks.quiet, q)
			ks.stopped = append(ks.stopped, stoppedProc{pid: q.pid, fd: pfds[i]})
			continue
		}
		// Running, on its way to the stop: killed now and waited for,
		// like any other (with its normal policy back: the wait must
		// not depend on an idle CPU).
		setPolicy(q.pid, unix.SCHED_NORMAL)
		_ = unix.PidfdSendSignal(pfds[i], unix.SIGKILL, nil, 0)
		ks.wait = append(ks.wait, q.pid)
		unix.Close(pfds[i])
	}
	return ks
}

// schedIdle gives thread tid the SCHED_IDLE policy: it runs only on a CPU
// that has nothing else to run, and never preempts a thread that has.
func schedIdle(tid int) { setPolicy(tid, unix.SCHED_IDLE) }

// setPolicy sets thread tid's scheduling policy (priority 0).
func setPolicy(tid int, policy uint32) {
	_ = unix.SchedSetAttr(tid, &unix.SchedAttr{Size: unix.SizeofSchedAttr, Policy: policy}, 0)
}

// killSet are the processes signalLive signalled: those sent SIGKILL, to
// wait for, and the quiet ones, sent SIGSTOP, whose SIGKILL finish sends.
type killSet struct {
	wait    []int
	quiet   []quietProbe
	stopped []stoppedProc
}

// stoppedProc is a quiet process signalLive stopped, with its pidfd.
type stoppedProc struct{ pid, fd int }

// adopt takes o's stopped processes, for ks's finish to kill.
func (ks *killSet) adopt(o killSet) {
	ks.stopped = append(ks.stopped, o.stopped...)
}

// finish sends SIGKILL to the quiet processes signalLive stopped. They are
// still SCHED_IDLE, so their exit (unmapping their memory) waits for a CPU
// with nothing else to do; after idleGrace they get the normal policy
// back, so that on a machine that stays busy their memory is not held for
// long (a SCHED_IDLE task gets a fraction of a percent of a busy CPU). It
// is safe to call more than once, and on a zero killSet.
func (ks *killSet) finish() {
	if ks == nil || len(ks.stopped) == 0 {
		return
	}
	stopped := ks.stopped
	ks.stopped = nil
	for _, p := range stopped {
		_ = unix.PidfdSendSignal(p.fd, unix.SIGKILL, nil, 0)
	}
	time.AfterFunc(idleGrace, func() {
		for _, p := range stopped {
			// Only while the pidfd says it has not exited: its pid is
			// not reused before it is reaped.
			pfd := []unix.PollFd{{Fd: int32(p.fd), Events: unix.POLLIN}}
			if n, err := unix.Poll(pfd, 0); err == nil && n == 0 {
				setPolicy(p.pid, unix.SCHED_NORMAL)
			}
			unix.Close(p.fd)
		}
	})
}

// idleGrace is how long a killed quiet process stays SCHED_IDLE (finish).
const idleGrace = 10 * time.Millisecond

// waitGone waits until the killed processes are reaped, so their pids are
// free again (CRIU restores exact pids).
func waitGone(ctx context.Context, pids []int) error {
	for _, pid := range pids {
		if !waitUntil(ctx, 10*time.Second, func() bool {
			_, err := os.Stat("/proc/" + strconv.Itoa(pid))
			return err != nil
		}) {
			return fmt.Errorf("process %d not reaped", pid)
		}
	}
	return nil
}

// waitUntil polls f until it holds, for at most d. For the first
// precisePolling it polls every few tens of microseconds (pause.For: a
// time.Sleep that short sleeps a millisecond), later every millisecond.
func waitUntil(ctx context.Context, d time.Duration, f func() bool) bool {
	start := time.Now()
	deadline := start.Add(d)
	for {
		if f() {
			return true
		}
		now := time.Now()
		if now.After(deadline) || ctx.Err() != nil {
			return false
		}
		if now.Sub(start) < precisePolling {
			pause.For(20 * time.Microsecond)
		} else {
			time.Sleep(time.Millisecond)
		}
	}
}

// precisePolling is how long waitUntil polls at a fine grain: the waits on
// a restore's path (a killed process reaching its exit) end well within it.
const precisePolling = 3 * time.Millisecond

// Restore kills t's live processes, runs opts.SwitchFS and recreates the
// processes of checkpoint id.
func (e *Engine) Restore(ctx context.Context, t Target, id string, opts RestoreOptions) (*RestoreResult, error) {
	ph := newPhases()
	l := e.sandboxLock(t.ID())
	l.Lock()
	defer l.Unlock()
	c, err := e.acquire(id, t)
	if err != nil {
		return nil, err
	}
	defer e.releaseCk(c)
	ph.mark("lock")
	if sw := opts.SwitchFS; opts.Reroot && sw != nil {
		// No background dump may run in the namespace while its root
		// is replaced (see nsMu).
		opts.SwitchFS = func() error {
			ns := e.nsLock(t.ID())
			ns.Lock()
			defer ns.Unlock()
			return sw()
		}
	}
	start := time.Now()
	// The quiet processes a template restore stops are killed once it
	// is done (see signalLive), whatever its outcome.
	var stopped killSet
	defer stopped.finish()
	res := &RestoreResult{Path: "template"}
	// switched: the warm template path switched the fs already (and then
	// failed to use a spare).
	switched := false
	if c.rec.Sandbox != t.ID() {
		killed, err := e.killLive(ctx, t, nil)
		if err != nil {
			return nil, fmt.Errorf("restore %s into %s: %w", id, t.ID(), err)
		}
		if opts.SwitchFS != nil {
			if err := opts.SwitchFS(); err != nil {
				return nil, fmt.Errorf("restore %s into %s: switch fs: %w", id, t.ID(), err)
			}
		}
		if c.rec.Mode != ModeEmpty {
			if err := waitGone(ctx, killed); err != nil {
				return nil, fmt.Errorf("restore %s into %s: %w", id, t.ID(), err)
			}
			ph.mark("kill")
			procs, live, err := e.restoreForeign(ctx, c, t, opts, ph)
			if err != nil {
				return nil, fmt.Errorf("restore %s into %s: %w", id, t.ID(), err)
			}
			res.Live = live
			res.Phases = ph.out
			res.Path = "criu"
			if c.rec.Mode == ModeTemplate {
				res.Path = e.imagePath()
			}
			res.Procs = procs
		} else {
			res.Live = []int{}
		}
		res.Duration = time.Since(start)
		return res, nil
	}
	if c.rec.Mode == ModeParked {
		procs, err := e.resumeParked(ctx, t, c, opts)
		if err != nil {
			return nil, fmt.Errorf("restore %s: %w", id, err)
		}
		res.Procs, res.Live = procs, pidsOf(procs)
		res.Duration = time.Since(start)
		return res, nil
	}
	if c.rec.Mode == ModeTemplate && len(e.tmpls(c)) > 0 {
		// Fast path: the copies are made (stopped) while the old
		// processes still run, so the fork does not compete with their
		// teardown; then the old ones are killed, the fs switched, and the
		// copies released.
		// The live processes are signalled once the copies exist
		// and are set up (a failed fork leaves them running; see
		// prepareCopiesOn for what waits for the kill), so their
		// teardown does not compete with the set-up.
		//
		// When every template has its warm spare, though, the set-up
		// needs no fork: see prepareWhileKilling, which kills first and
		// sets the spares up meanwhile. If it finds a spare gone, the
		// copies are made here (the live processes are dead by then).
		var ms []made
		var err error
		done := false
		if spares := e.sparesOf(c); e.cfg.Warm && spares != nil {
			var kerr error
			// Without Reroot the fs switch needs nothing of the copies:
			// it runs while the tracer sets them up.
			var during func() error
			if !opts.Reroot {
				during = opts.SwitchFS
			}
			ms, switched, err, kerr = e.prepareWhileKilling(ctx, t, c, opts, spares, during, &stopped, ph)
			if kerr != nil {
				return nil, fmt.Errorf("restore %s: %w", id, kerr)
			}
			done = err == nil
		}
		if !done {
			var signalled killSet
			ms, err = e.prepareCopies(c, opts, true, false, func(pids []int) {
				signalled = e.signalLive(t, pids)
				stopped.adopt(signalled)
			}, ph)
			if err == nil {
				if _, err := e.killLiveAfter(ctx, t, copyPids(ms), signalled, ph); err != nil {
					killCopies(ms)
					return nil, fmt.Errorf("restore %s: %w", id, err)
				}
			}
		}
		if err == nil {
			var cwds []string
			if opts.Reroot {
				for _, m := range ms {
					// The checkpoint's path: the copy's own names the
					// directory as the live view has it now (renamed).
					cwd := m.tm.cwd
					if cwd == "" {
						cwd = captureCwd(m.p.Pid())
					}
					cwds = append(cwds, cwd)
				}
			}
			if opts.SwitchFS != nil && !switched {
				if err := opts.SwitchFS(); err != nil {
					killCopies(ms)
					return nil, fmt.Errorf("restore %s: switch fs: %w", id, err)
				}
				ph.mark("switch_fs")
			}
			if opts.Reroot {
				if err := e.tracer.Do(func() error {
					for i, m := range ms {
						reenter(m.p, cwds[i])
					}
					return nil
				}); err != nil {
					killCopies(ms)
					return nil, fmt.Errorf("restore %s: move copies to the new root: %w", id, err)
				}
				ph.mark("reroot")
			} else if err := e.recwd(ms); err != nil {
				killCopies(ms)
				return nil, fmt.Errorf("restore %s: %w", id, err)
			}
			procs, err := e.startCopies(c, ms, true, ph)
			if err != nil {
				return nil, fmt.Errorf("restore %s: %w", id, err)
			}
			res.Procs, res.Live = procs, pidsOf(procs)
			res.Duration = time.Since(start)
			res.Phases = ph.out
			return res, nil
		}
		if !e.imageReady(c) {
			return nil, fmt.Errorf("restore %s: %w", id, err)
		}
		e.log.Warn("template restore failed, using the image", "checkpoint", id, "err", err)
		e.dropTemplates(c)
	}
	// A template miss without an image fails before anything is killed.
	if c.rec.Mode == ModeTemplate && !e.imageReady(c) {
		e.mu.Lock()
		why := c.image.ImageErr
		e.mu.Unlock()
		if why != nil {
			return nil, fmt.Errorf("restore %s: no templates, and no image (%v): %w", id, why, ErrUnknown)
		}
		return nil, fmt.Errorf("restore %s: no templates and no image: %w", id, ErrUnknown)
	}
	killed, err := e.killLive(ctx, t, nil)
	if err != nil {
		return nil, fmt.Errorf("restore %s: %w", id, err)
	}
	if opts.SwitchFS != nil && !switched {
		if err := opts.SwitchFS(); err != nil {
			return nil, fmt.Errorf("restore %s: switch fs: %w", id, err)
		}
	}
	if c.rec.Mode == ModeEmpty {
		res.Live = []int{}
		res.Duration = time.Since(start)
		return res, nil
	}
	if c.rec.Mode == ModeCRIU {
		if err := waitGone(ctx, killed); err != nil {
			return nil, fmt.Errorf("restore %s: %w", id, err)
		}
		procs, live, err := e.restoreTrees(ctx, c, t, opts)
		if err != nil {
			return nil, fmt.Errorf("restore %s: %w", id, err)
		}
		res.Path = "criu"
		res.Procs, res.Live = procs, live
		res.Duration = time.Since(start)
		return res, nil
	}
	// Template miss: recreate the templates from the image, then fork.
	if err := e.restoreTemplatesFromImage(ctx, c, t); err != nil {
		return nil, fmt.Errorf("restore %s from image: %w", id, err)
	}
	res.Path = e.imagePath()
	procs, err := e.spawn(c, opts, false)
	if err != nil {
		return nil, fmt.Errorf("restore %s: %w", id, err)
	}
	res.Procs, res.Live = procs, pidsOf(procs)
	res.Duration = time.Since(start)
	return res, nil
}

// pidsOf returns the host pids of procs (never nil).
func pidsOf(procs []Restored) []int {
	out := make([]int, 0, len(procs))
	for _, r := range procs {
		out = append(out, r.PID)
	}
	return out
}

// Fork creates n more live copies of checkpoint id's processes in t,
// leaving the live processes alone. Copies share no stdio.
func (e *Engine) Fork(ctx context.Context, t Target, id string, n int, opts RestoreOptions) ([][]Restored, error) {
	l := e.sandboxLock(t.ID())
	l.Lock()
	defer l.Unlock()
	c, err := e.acquire(id, t)
	if err != nil {
		return nil, err
	}
	defer e.releaseCk(c)
	if c.rec.Mode == ModeCRIU {
		return nil, fmt.Errorf("fork %s: a CRIU-mode checkpoint cannot be forked in place (pids are restored exactly)", id)
	}
	if c.rec.Sandbox != t.ID() {
		return nil, fmt.Errorf("fork %s: checkpoint of sandbox %s; use Restore to put it into sandbox %s", id, c.rec.Sandbox, t.ID())
	}
	if c.rec.Mode != ModeEmpty && len(e.tmpls(c)) == 0 {
		if !e.imageReady(c) {
			return nil, fmt.Errorf("fork %s: no templates and no image", id)
		}
		if err := e.restoreTemplatesFromImage(ctx, c, t); err != nil {
			return nil, fmt.Errorf("fork %s from image: %w", id, err)
		}
	}
	var out [][]Restored
	for i := 0; i < n; i++ {
		if err := ctx.Err(); err != nil {
			return out, err
		}
		procs, err := e.spawn(c, opts, false)
		if err != nil {
			return out, fmt.Errorf("fork %s copy %d: %w", id, i, err)
		}
		out = append(out, procs)
	}
	return out, nil
}

func (e *Engine) acquire(id string, t Target) (*ckpt, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.ckpts[id]
	if !ok {
		return nil, fmt.Errorf("checkpoint %s: %w", id, ErrUnknown)
	}
	if c.rec.Sandbox != t.ID() && !c.image.Image && c.rec.Mode != ModeEmpty {
		return nil, fmt.Errorf("checkpoint %s of sandbox %s has no image yet: it cannot be restored into %s", id, c.rec.Sandbox, t.ID())
	}
	e.clock++
	c.lastUse = e.clock
	c.busy++
	return c, nil
}

func (e *Engine) releaseCk(c *ckpt) {
	e.mu.Lock()
	c.busy--
	e.mu.Unlock()
}

// made is a copy of a template, stopped, with its stdio wired.
type made struct {
	tm *template
	p  *inject.Proc
	st *Stdio
	// in and out are the caller's ends of pipes made in the copy, for
	// adopt (RestoreOptions.Pipes).
	in, out *os.File
	adopt   func(pid int, stdin, output *os.File) error
}

// spawn forks every template of c (or takes its warmed spare), wires stdio
// and lets the copies run. On error every copy made so far is killed.
func (e *Engine) spawn(c *ckpt, opts RestoreOptions, useSpare bool) ([]Restored, error) {
	ms, err := e.prepareCopies(c, opts, useSpare, false, nil, nil)
	if err != nil {
		return nil, err
	}
	return e.startCopies(c, ms, useSpare, nil)
}

func killCopies(ms []made) {
	for _, m := range ms {
		_ = m.p.Kill()
		m.closePipes()
	}
}

// closePipes closes the caller's ends of pipes not handed to adopt.
func (m *made) closePipes() {
	if m.in != nil {
		m.in.Close()
	}
	if m.out != nil {
		m.out.Close()
	}
	m.in, m.out = nil, nil
}

func copyPids(ms []made) []int {
	var out []int
	for _, m := range ms {
		out = append(out, m.p.Pid())
	}
	return out
}

// prepareCopies makes the stopped copies, in one hand-over to the tracer
// thread (see inject.Tracer.Do). afterForks, if set, runs once every copy
// exists, before their sessions and stdio are set up, with their pids.
// With spareOnly it fails (errNoSpare) rather than fork a copy.
func (e *Engine) prepareCopies(c *ckpt, opts RestoreOptions, useSpare, spareOnly bool, afterForks func(pids []int), ph *phases) (ms []made, err error) {
	err = e.tracer.Do(func() error {
		ph.mark("handover")
		var err error
		ms, err = e.prepareCopiesOn(c, opts, useSpare, spareOnly, afterForks, ph)
		return err
	})
	return ms, err
}

// errNoSpare: a template's warm spare went away (prepareCopies).
var errNoSpare = errors.New("a warm spare is gone")

// prepareWhileKilling is the set-up of a restore whose templates all have
// their warm spares (pids: spares). The set-up (one injected system call
// per spare) is handed to the tracer thread first, and the tracer takes
// the spares while the live processes are signalled; it makes the
// copies dumpable (the step that exposes them) only once the signal is
// sent (gate). The caller meanwhile waits for the kill (killLiveAfter)
// and then runs during (the restore's fs switch, if any), so the hand-over
// to the tracer, the set-up, the kill's confirming listing and the switch
// overlap instead of following each other. The spares are kept (spares),
// so the signal and the kill leave them alone while the tracer takes them.
//
// kerr is the kill's or during's failure (the copies are killed then);
// ran reports whether during ran and succeeded. err is the set-up's (a
// spare gone: errNoSpare), after which the live processes are dead all
// the same: the caller makes the copies another way, or fails and its own
// undo restores the state it saved (state.Manager restores its undo
// point), as after any restore that fails past the kill.
func (e *Engine) prepareWhileKilling(ctx context.Context, t Target, c *ckpt, opts RestoreOptions, spares []int, during func() error, stopped *killSet, ph *phases) (ms []made, ran bool, err, kerr error) {
	g := newGate()
	pa := &phases{last: time.Now()}
	ready := make(chan struct{})
	go func() {
		defer close(ready)
		ms, err = e.prepareCopies(c, opts, true, true, func([]int) { g.wait() }, pa)
	}()
	signalled := e.signalLive(t, spares)
	stopped.adopt(signalled)
	g.open()
	ph.mark("signal")
	_, kerr = e.killLiveAfter(ctx, t, spares, signalled, ph)
	if kerr == nil && during != nil {
		if derr := during(); derr != nil {
			kerr = fmt.Errorf("switch fs: %w", derr)
		} else {
			ran = true
			ph.mark("switch_fs")
		}
	}
	<-ready
	ph.mark("copies_wait")
	// The tracer's steps ran during the kill: they are reported after
	// it, under their own names.
	for _, p := range pa.out {
		ph.out = append(ph.out, Phase{Name: "copies." + p.Name, D: p.D})
	}
	if kerr != nil {
		if err == nil {
			killCopies(ms)
		}
		return nil, false, nil, kerr
	}
	return ms, ran, err, nil
}

// gateSpin is how long a gate's waiter spins before it sleeps. The
// tracer thread waits at a gate for a signal the caller sends a few
// hundred microseconds later; asleep, it would be woken by the kernel,
// which on this kind of VM costs about 0.1 ms (an idle vCPU's wake-up).
const gateSpin = time.Millisecond

// schedYield gives the CPU to another runnable thread, if any.
func schedYield() { _, _, _ = unix.RawSyscall(unix.SYS_SCHED_YIELD, 0, 0, 0) }

// gate lets one goroutine wait until another opens it.
type gate struct {
	opened atomic.Bool
	ch     chan struct{}
}

func newGate() *gate { return &gate{ch: make(chan struct{})} }

func (g *gate) open() {
	g.opened.Store(true)
	close(g.ch)
}

// wait returns once the gate is open: it spins for up to gateSpin, then
// sleeps.
func (g *gate) wait() {
	deadline := time.Now().Add(gateSpin)
	for !g.opened.Load() {
		if time.Now().After(deadline) {
			<-g.ch
			return
		}
		// The waiter may be a locked thread (the tracer's) on the CPU
		// of the goroutine that opens the gate: without a yield it
		// would spin out its whole gateSpin while the opener waits on
		// that CPU's run queue (the kernel does not move it to the
		// idle CPU that soon). A yield with nothing else runnable
		// returns at once.
		schedYield()
	}
}

// prepareCopiesOn is prepareCopies on the tracer thread.
func (e *Engine) prepareCopiesOn(c *ckpt, opts RestoreOptions, useSpare, spareOnly bool, afterForks func(pids []int), ph *phases) ([]made, error) {
	var ms []made
	fail := func(err error) ([]made, error) {
		killCopies(ms)
		return nil, err
	}
	var fresh []bool
	var pins []*pin
	defer func() {
		for _, pn := range pins {
			pn.undo()
		}
	}()
	var armed []*pipePair // the spares' pipes (makeSpare)
	for _, tm := range e.tmpls(c) {
		var cp *inject.Proc
		var io *pipePair
		if useSpare && e.cfg.Warm {
			e.mu.Lock()
			cp, tm.spare = tm.spare, nil
			if cp != nil {
				io, tm.spareIO = tm.spareIO, nil
			}
			e.mu.Unlock()
			if cp != nil && exiting(cp.Pid()) {
				// Killed from inside the sandbox: reap it, fork anew.
				_ = cp.Kill()
				io.close()
				cp, io = nil, nil
			}
		}
		forked := cp == nil
		if forked && spareOnly {
			return fail(errNoSpare)
		}
		if forked {
			var err error
			cp, err = tm.proc.Fork(true)
			if err != nil {
				return fail(fmt.Errorf("fork template %d of %d: %w", tm.proc.Pid(), tm.orig.PID, err))
			}
			e.ownFiles(tm, cp, filesOffRoot)
		} else if pn := pinHere(cp.Pid()); pn != nil {
			// A spare meets only a call or two (dumpable): on the
			// tracer's CPU each is a few microseconds, against up to
			// hundreds across CPUs (paired bench cr, dumpable p50
			// 0.03 ms pinned, 0.07-0.26 ms not). A forked copy is not
			// pinned: pinning its template for the fork made a 200 MB
			// restore slower (6.0 -> 8.0 ms p50).
			pins = append(pins, pn)
		}
		ms = append(ms, made{tm: tm, p: cp})
		fresh = append(fresh, forked)
		armed = append(armed, io)
		ph.mark("fork")
	}
	defer func() {
		for _, io := range armed {
			io.close() // those not adopted
		}
	}()
	// The live processes are signalled once every copy is ready but for
	// the steps that would expose it to them: its stdio parked in the
	// sandbox's init (Stdio) or its being dumpable. So their teardown does
	// not compete with the copies' set-up, and they can never reach a
	// copy's pipes.
	signalled := false
	signal := func() {
		if afterForks != nil && !signalled {
			afterForks(copyPids(ms))
		}
		signalled = true
	}
	for i := range ms {
		tm, cp := ms[i].tm, ms[i].p
		// Every copy leads its own session, as the sandbox's sessions
		// do: nothing it holds refers to a pid a later CRIU restore may
		// need, and CRIU can dump it again. (A spare does already.)
		if fresh[i] {
			if err := cp.Setsid(); err != nil {
				return fail(err)
			}
			ph.mark("setsid")
		}
		if opts.Pipes == nil {
			continue
		}
		adopt := opts.Pipes(tm.orig)
		if adopt == nil {
			continue
		}
		if io := armed[i]; io != nil {
			ms[i].in, ms[i].out, ms[i].adopt = io.in, io.out, adopt
			armed[i] = nil
			ph.mark("stdio")
			continue
		}
		in, out, err := cp.NewStdio()
		if err != nil {
			return fail(fmt.Errorf("stdio for %d: %w", tm.orig.PID, err))
		}
		ms[i].in, ms[i].out, ms[i].adopt = in, out, adopt
		ph.mark("stdio")
	}
	signal()
	ph.mark("signal")
	for i := range ms {
		tm, cp := ms[i].tm, ms[i].p
		if err := release(tm, cp); err != nil {
			return fail(fmt.Errorf("copy of template %d: %w", tm.proc.Pid(), err))
		}
		ph.mark("dumpable")
		if ms[i].adopt != nil {
			continue
		}
		var st *Stdio
		if opts.Stdio != nil {
			var err error
			if st, err = opts.Stdio(tm.orig); err != nil {
				return fail(fmt.Errorf("stdio for %d: %w", tm.orig.PID, err))
			}
			ph.mark("stdio_make")
		}
		ms[i].st = st
		if st == nil {
			if armed[i] != nil {
				// A spare with pipes nobody adopts: /dev/null, as a
				// copy without stdio has.
				if err := cp.SetStdio([3]string{"/dev/null", "/dev/null", "/dev/null"}, [3]int{unix.O_RDWR, unix.O_RDWR, unix.O_RDWR}); err != nil {
					return fail(err)
				}
			}
			continue
		}
		if err := cp.SetStdio([3]string{st.Stdin, st.Stdout, st.Stderr}, [3]int{unix.O_RDONLY, unix.O_WRONLY, unix.O_WRONLY}); err != nil {
			return fail(err)
		}
		ph.mark("stdio_set")
	}
	return ms, nil
}

// startCopies lets prepared copies run and calls their Started hooks.
func (e *Engine) startCopies(c *ckpt, ms []made, useSpare bool, ph *phases) ([]Restored, error) {
	out := make([]Restored, 0, len(ms))
	err := e.tracer.Do(func() error {
		ph.mark("handover")
		// The files of the sandbox's view, now that it is the
		// checkpoint's (see ownFiles).
		for _, m := range ms {
			e.ownFiles(m.tm, m.p, filesOnRoot)
		}
		for i, m := range ms {
			if err := m.p.Detach(); err != nil {
				killCopies(ms[i:])
				for j := 0; j < i; j++ {
					ms[j].closePipes()
				}
				for _, r := range out {
					_ = unix.Kill(r.PID, unix.SIGKILL)
				}
				return err
			}
			out = append(out, Restored{Orig: m.tm.orig, PID: m.p.Pid()})
		}
		ph.mark("detach")
		return nil
	})
	if err != nil {
		return nil, err
	}
	for i := range ms {
		m := &ms[i]
		if m.adopt != nil {
			in, o := m.in, m.out
			m.in, m.out = nil, nil
			if err := m.adopt(m.p.Pid(), in, o); err != nil {
				for j := i + 1; j < len(ms); j++ {
					ms[j].closePipes()
				}
				return out, fmt.Errorf("pipes hook for %d%s: %w", m.p.Pid(), resentNote(m.p), err)
			}
		}
		if m.st != nil && m.st.Started != nil {
			if err := m.st.Started(m.p.Pid()); err != nil {
				return out, fmt.Errorf("started hook for %d%s: %w", m.p.Pid(), resentNote(m.p), err)
			}
		}
	}
	ph.mark("started")
	if useSpare && e.cfg.Warm {
		for _, tm := range e.tmpls(c) {
			e.goSpare(tm)
		}
	}
	return out, nil
}

// resentNote names the signals a released copy got again at its release
// (inject.Proc.ResentSignals), for the error of a hook that found the copy
// gone: one of them may have ended it.
func resentNote(p *inject.Proc) string {
	sigs := p.ResentSignals()
	if len(sigs) == 0 {
		return ""
	}
	names := make([]string, len(sigs))
	for i, s := range sigs {
		names[i] = unix.SignalName(s)
	}
	return " (signals held during its set-up and sent again at its release: " + strings.Join(names, ", ") + ")"
}

// imagePath names the restore path taken from an image.
func (e *Engine) imagePath() string {
	if e.cfg.LazyPages {
		return "criu-lazy"
	}
	return "criu"
}

// strayed reports whether a process of sandbox sb may be outside its
// cgroup (Engine.strays).
func (e *Engine) strayed(sb string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.strays[sb]
}

// checkStrays records whether some descendant of t's init is missing from
// t's member list (Members), after a CRIU restore into t: from then on the
// kill's confirming listing walks the descendants. The check walks once.
func (e *Engine) checkStrays(t Target) {
	m, ok := t.(Members)
	if !ok {
		return
	}
	members, merr := m.MemberPIDs()
	procs, werr := walk(t.InitPID(), nil, false)
	in := map[int]bool{}
	for _, p := range members {
		in[p] = true
	}
	stray := merr != nil || werr != nil
	for _, p := range procs {
		if !in[p.PID] && !exiting(p.PID) {
			stray = true
		}
	}
	if !stray {
		return
	}
	e.log.Warn("a process of the sandbox is outside its cgroup: its restores confirm kills with a walk", "sandbox", t.ID())
	e.mu.Lock()
	if e.strays == nil {
		e.strays = map[string]bool{}
	}
	e.strays[t.ID()] = true
	e.mu.Unlock()
}

// sparesOf returns the pids of the warm spares of c's templates, or nil
// unless every template has one.
func (e *Engine) sparesOf(c *ckpt) []int {
	e.mu.Lock()
	defer e.mu.Unlock()
	var out []int
	for _, tm := range c.templates {
		if tm.spare == nil {
			return nil
		}
		out = append(out, tm.spare.Pid())
	}
	return out
}

// tmpls returns a snapshot of c's templates.
func (e *Engine) tmpls(c *ckpt) []*template {
	e.mu.Lock()
	defer e.mu.Unlock()
	return append([]*template(nil), c.templates...)
}

func (e *Engine) imageReady(c *ckpt) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	return c.image.Image
}

// Drop frees checkpoint id: its templates are killed and its image removed.
func (e *Engine) Drop(id string) {
	e.mu.Lock()
	c, ok := e.ckpts[id]
	var r retired
	if ok {
		delete(e.ckpts, id)
		r = e.retireLocked(c)
		e.writingLocked(id, c.rec.Sandbox) // until its image is removed
	}
	e.mu.Unlock()
	if !ok {
		return
	}
	defer e.written(id)
	e.kill(r)
	e.removeImage(c)
}

func (e *Engine) dropTemplates(c *ckpt) {
	e.mu.Lock()
	r := e.retireLocked(c)
	e.mu.Unlock()
	e.kill(r)
}

// retired are templates taken from their checkpoint, to be killed.
type retired struct {
	tms    []*template
	spares []*inject.Proc
	io     []*pipePair // the spares' pipes
}

// retireLocked takes c's templates away (e.mu held). They stay helpers
// (TemplatePIDs) until kill is done with them, so that a listing of the
// live processes taken meanwhile never counts them as the agent's. A spare
// being warmed is makeSpare's to kill.
func (e *Engine) retireLocked(c *ckpt) retired {
	r := retired{tms: append(append([]*template(nil), c.templates...), c.parked...)}
	c.templates, c.parked = nil, nil
	for _, tm := range r.tms {
		tm.dropped = true
		e.aux[tm.proc.Pid()] = tm.sandbox
		e.retireSpareLocked(tm, &r)
		if tm.warming != nil {
			e.aux[tm.warming.Pid()] = tm.sandbox
		}
	}
	return r
}

// retireSpareLocked takes tm's warm spare, if it has one, into r (e.mu
// held); it stays a helper until kill is done with it.
func (e *Engine) retireSpareLocked(tm *template, r *retired) {
	if tm.spare == nil {
		return
	}
	e.aux[tm.spare.Pid()] = tm.sandbox
	r.spares = append(r.spares, tm.spare)
	r.io = append(r.io, tm.spareIO)
	tm.spare, tm.spareIO = nil, nil
}

// kill kills retired templates and their spares.
func (e *Engine) kill(r retired) {
	for _, sp := range r.spares {
		_ = sp.Kill()
	}
	for _, io := range r.io {
		io.close()
	}
	for _, tm := range r.tms {
		_ = tm.proc.Kill()
	}
	pids := make([]int, 0, len(r.tms)+len(r.spares))
	for _, tm := range r.tms {
		pids = append(pids, tm.proc.Pid())
	}
	for _, sp := range r.spares {
		pids = append(pids, sp.Pid())
	}
	e.forgetWhenGone(pids...)
}

// forgetWhenGone stops counting killed helpers pids as helpers once each
// is exiting (listings skip those). Kill waits only briefly for a killed
// tracee: SIGKILL takes effect when the process is next scheduled, which
// for a large one still in a fork or fault can be later, and until then
// it looks alive; forgotten at once, it would be listed as one of the
// agent's processes and the next checkpoint would try to seize it.
func (e *Engine) forgetWhenGone(pids ...int) {
	var later []int
	e.mu.Lock()
	for _, p := range pids {
		if exiting(p) {
			delete(e.aux, p)
		} else {
			later = append(later, p)
		}
	}
	e.mu.Unlock()
	if len(later) == 0 {
		return
	}
	go func() {
		for _, p := range later {
			waitUntil(context.Background(), 10*time.Second, func() bool { return exiting(p) })
			e.mu.Lock()
			delete(e.aux, p)
			e.mu.Unlock()
		}
	}()
}

// DropSandbox drops every checkpoint of sandbox sb (call before the sandbox
// is closed, so no stopped template outlives it).
func (e *Engine) DropSandbox(sb string) {
	e.mu.Lock()
	var ids []string
	for id, c := range e.ckpts {
		if c.rec.Sandbox == sb {
			ids = append(ids, id)
		}
	}
	delete(e.strays, sb)
	e.mu.Unlock()
	sort.Strings(ids)
	for _, id := range ids {
		e.Drop(id)
	}
}

// Hint records whether checkpoint id is still reachable by the caller's
// search; unreachable checkpoints are evicted first.
func (e *Engine) Hint(id string, reachable bool) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if c, ok := e.ckpts[id]; ok {
		c.reachable = reachable
	}
}
