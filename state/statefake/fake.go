// Package statefake provides in-memory back ends for the state manager, for
// tests and for running the daemon without root (rewind daemon --fake).
//
// The fake sandbox understands a tiny command language, through Exec and
// through sessions:
//
//	write PATH DATA   write a file            cat PATH    print it
//	rm PATH           delete a file           set K V     set a process variable
//	get K             print a variable        exit N      exit with code N
//	echo WORDS...     print words             sleep MS    wait
//
// Files live in the fake fs mount, variables in the fake "process memory";
// both are checkpointed and restored like the real thing.
package statefake

import (
	"context"
	"errors"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/state"
)

// Disk is what survives a simulated host reboot: fs layers and process
// images. Share one Disk between the back ends of successive "daemons".
type Disk struct {
	mu     sync.Mutex
	layers map[string]map[string]string // fs checkpoint id -> files
	images map[string]map[string]string // image dir -> memory
	// Deleted and Released record what GC freed, for assertions.
	Deleted  map[string]bool
	Released map[string]bool
	mounts   map[string]*Mount
	n        int
}

// NewDisk returns an empty disk.
func NewDisk() *Disk {
	return &Disk{
		layers: map[string]map[string]string{}, images: map[string]map[string]string{},
		Deleted: map[string]bool{}, Released: map[string]bool{}, mounts: map[string]*Mount{},
	}
}

func (d *Disk) next(prefix string) string {
	d.n++
	return prefix + strconv.Itoa(d.n)
}

// Layers returns how many fs checkpoints were ever taken.
func (d *Disk) Layers() int {
	d.mu.Lock()
	defer d.mu.Unlock()
	return len(d.layers) + len(d.Deleted)
}

// HasLayer reports whether fs checkpoint id exists.
func (d *Disk) HasLayer(id string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	_, ok := d.layers[id]
	return ok
}

// WasReleased reports whether GC released template t.
func (d *Disk) WasReleased(t string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.Released[t]
}

// WasDeleted reports whether GC deleted fs checkpoint id.
func (d *Disk) WasDeleted(id string) bool {
	d.mu.Lock()
	defer d.mu.Unlock()
	return d.Deleted[id]
}

// Faults injects failures; set fields atomically from tests.
type Faults struct {
	// FailSwitch and FailRestore fail the next N calls.
	FailSwitch     atomic.Int32
	FailCheckpoint atomic.Bool
	FailRestore    atomic.Int32
	// RestoreFailsForGood makes FailRestore's failures permanent ones
	// (their error's Permanent method says so, as for a process image
	// that names a file the sandbox lacks).
	RestoreFailsForGood atomic.Bool
	// Restores counts process restores attempted (fork children's too).
	Restores    atomic.Int32
	FailPersist atomic.Bool
	FailStart   atomic.Bool
	// FailStarts fails the next N process starts.
	FailStarts atomic.Int32
	// FailAwait makes FS.AwaitCheckpoint fail (an fs checkpoint whose
	// layer could not be written after it returned).
	FailAwait atomic.Bool
	// PersistDelay slows every process image write (nanoseconds).
	PersistDelay atomic.Int64
	// CheckpointDelay slows every fs checkpoint (nanoseconds).
	CheckpointDelay atomic.Int64
	// ReleaseDelay slows every process part's release (nanoseconds).
	ReleaseDelay atomic.Int64
	// TemplatesKeepNoPids makes sandboxes say that a restore through a
	// template needs no exact pids (state.ExactPidsRestorer), as the real
	// engine does; by default every restore needs them.
	TemplatesKeepNoPids atomic.Bool
}

// FS is a fake state.FSBackend.
type FS struct {
	Disk   *Disk
	Faults *Faults
}

// Mount is a fake mounted root.
type Mount struct {
	fs    *FS
	id    string
	mu    sync.Mutex
	files map[string]string
	dirty atomic.Int64
	gone  bool
}

var (
	_ state.FSBackend = (*FS)(nil)
	_ state.FSChecker = (*FS)(nil)
	_ state.FSWaiter  = (*FS)(nil)
)

// Mount implements state.FSBackend.
func (f *FS) Mount(_ context.Context, id string, spec state.FSSpec) (state.FSMount, error) {
	m := &Mount{fs: f, id: id, files: map[string]string{}}
	for i, b := range spec.Bases {
		m.files["/base"+strconv.Itoa(i)] = b
	}
	f.Disk.mu.Lock()
	f.Disk.mounts["fake:"+id] = m
	f.Disk.mu.Unlock()
	return m, nil
}

// MountFrom implements state.FSBackend.
func (f *FS) MountFrom(_ context.Context, id string, _ state.FSSpec, ckpt string) (state.FSMount, error) {
	f.Disk.mu.Lock()
	defer f.Disk.mu.Unlock()
	l, ok := f.Disk.layers[ckpt]
	if !ok {
		return nil, fmt.Errorf("fake fs: no checkpoint %s", ckpt)
	}
	m := &Mount{fs: f, id: id, files: maps.Clone(l)}
	f.Disk.mounts["fake:"+id] = m
	return m, nil
}

// Delete implements state.FSBackend.
func (f *FS) Delete(_ context.Context, ckpt string) error {
	f.Disk.mu.Lock()
	defer f.Disk.mu.Unlock()
	if _, ok := f.Disk.layers[ckpt]; !ok {
		return fmt.Errorf("fake fs: delete of unknown checkpoint %s", ckpt)
	}
	delete(f.Disk.layers, ckpt)
	f.Disk.Deleted[ckpt] = true
	return nil
}

// Cleanup implements state.FSBackend.
func (f *FS) Cleanup(context.Context, string) error { return nil }

// AwaitCheckpoint implements state.FSWaiter (fake checkpoints are
// complete when made, unless Faults.FailAwait).
func (f *FS) AwaitCheckpoint(_ context.Context, ckpt string) error {
	if f.Faults.FailAwait.Load() {
		return fmt.Errorf("fake fs: injected failure writing checkpoint %s", ckpt)
	}
	return nil
}

// Lost implements state.FSChecker: the checkpoint's layer is not on the
// disk (LoseCheckpoint, or deleted).
func (f *FS) Lost(_ context.Context, ckpt string) bool {
	f.Disk.mu.Lock()
	defer f.Disk.mu.Unlock()
	_, ok := f.Disk.layers[ckpt]
	return !ok
}

// WriteUnseen writes a file into the view of the sandbox with id sbID
// behind the state manager's back: no operation runs and the probe does
// not see it, as with a write a background process makes between two
// probe windows. It reports whether the sandbox has a mount.
func (d *Disk) WriteUnseen(sbID, path, data string) bool {
	d.mu.Lock()
	m := d.mounts["fake:"+sbID]
	d.mu.Unlock()
	if m == nil {
		return false
	}
	m.write(path, data)
	return true
}

// LoseCheckpoint forgets fs checkpoint ckpt as a crash before its layer
// was written would (tests of recovery).
func (d *Disk) LoseCheckpoint(ckpt string) {
	d.mu.Lock()
	defer d.mu.Unlock()
	delete(d.layers, ckpt)
}

// Root implements state.FSMount.
func (m *Mount) Root() string { return "fake:" + m.id }

// Checkpoint implements state.FSMount.
func (m *Mount) Checkpoint(context.Context) (string, int64, error) {
	if d := m.fs.Faults.CheckpointDelay.Load(); d > 0 {
		time.Sleep(time.Duration(d))
	}
	if m.fs.Faults.FailCheckpoint.Load() {
		return "", 0, errors.New("fake fs: injected checkpoint failure")
	}
	m.mu.Lock()
	snap := maps.Clone(m.files)
	m.mu.Unlock()
	d := m.fs.Disk
	d.mu.Lock()
	id := d.next("fs")
	d.layers[id] = snap
	d.mu.Unlock()
	return id, m.dirty.Swap(0), nil
}

// Switch implements state.FSMount.
func (m *Mount) Switch(_ context.Context, ckpt string) error {
	if m.fs.Faults.FailSwitch.Add(-1) >= 0 {
		return errors.New("fake fs: injected switch failure")
	}
	d := m.fs.Disk
	d.mu.Lock()
	l, ok := d.layers[ckpt]
	d.mu.Unlock()
	if !ok {
		return fmt.Errorf("fake fs: no checkpoint %s", ckpt)
	}
	m.mu.Lock()
	m.files = maps.Clone(l)
	m.mu.Unlock()
	m.dirty.Store(0) // the view is the checkpoint's again
	return nil
}

func (m *Mount) write(path, data string) {
	m.writeQuiet(path, data)
	m.dirty.Add(int64(len(data)))
}

// writeQuiet writes a file outside what checkpoints account (the real
// sandboxes' /run/rewind is a tmpfs of their own).
func (m *Mount) writeQuiet(path, data string) {
	m.mu.Lock()
	m.files[path] = data
	m.mu.Unlock()
}

// Read returns a file's content.
func (m *Mount) Read(path string) (string, bool) {
	m.mu.Lock()
	defer m.mu.Unlock()
	v, ok := m.files[path]
	return v, ok
}

// Unmount implements state.FSMount.
func (m *Mount) Unmount() error {
	d := m.fs.Disk
	d.mu.Lock()
	delete(d.mounts, "fake:"+m.id)
	d.mu.Unlock()
	m.mu.Lock()
	m.gone = true
	m.mu.Unlock()
	return nil
}

// Proc is a fake state.ProcBackend. Templates live in the back end (they
// die with it); images live on the Disk.
type Proc struct {
	Disk   *Disk
	Faults *Faults
	// Prefetches counts the sandboxes' PrefetchMapped calls.
	Prefetches atomic.Int64
	mu         sync.Mutex
	tpls       map[string]map[string]string
	tplOwner   map[string]string // template -> the sandbox it was taken in
	events     []string          // see Events
}

// Events returns what the process back end did, in order: "checkpoint T"
// (template T taken), "restore T" (a restore of T's part began) and
// "release T" (T's part released, logged once the release is done).
func (p *Proc) Events() []string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return slices.Clone(p.events)
}

func (p *Proc) event(what string, tpls []string) {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, t := range tpls {
		p.events = append(p.events, what+" "+t)
	}
}

var (
	_ state.ProcBackend      = (*Proc)(nil)
	_ state.ProcMeter        = (*Proc)(nil)
	_ state.MappedPrefetcher = (*Sandbox)(nil)
)

// Sandbox is a fake live sandbox.
type Sandbox struct {
	p        *Proc
	id       string
	mount    *Mount
	mu       sync.Mutex
	mem      map[string]string
	sessions map[string]bool
	frozen   bool
	closed   bool
	// effects since the last Take
	fsOps, procOps int
}

// Start implements state.ProcBackend.
func (p *Proc) Start(_ context.Context, id, root string) (state.ProcSandbox, error) {
	if p.Faults.FailStart.Load() {
		return nil, errors.New("fake proc: injected start failure")
	}
	if p.Faults.FailStarts.Add(-1) >= 0 {
		return nil, errors.New("fake proc: injected start failure")
	}
	p.Disk.mu.Lock()
	m := p.Disk.mounts[root]
	p.Disk.mu.Unlock()
	if m == nil {
		return nil, fmt.Errorf("fake proc: no mount %s", root)
	}
	return &Sandbox{p: p, id: id, mount: m, mem: map[string]string{}, sessions: map[string]bool{}}, nil
}

// Release implements state.ProcBackend.
func (p *Proc) Release(_ context.Context, part *state.ProcPart) error {
	time.Sleep(time.Duration(p.Faults.ReleaseDelay.Load()))
	defer p.event("release", part.Templates)
	p.mu.Lock()
	for _, t := range part.Templates {
		delete(p.tpls, t)
	}
	p.mu.Unlock()
	p.Disk.mu.Lock()
	defer p.Disk.mu.Unlock()
	if part.ImageDir != "" {
		delete(p.Disk.images, part.ImageDir)
	}
	for _, t := range part.Templates {
		p.Disk.Released[t] = true
	}
	return nil
}

// Recover implements state.ProcBackend: templates are gone, images remain.
func (p *Proc) Recover(_ context.Context, part *state.ProcPart) *state.ProcPart {
	np := *part
	p.mu.Lock()
	np.TemplateReady = false
	for _, t := range part.Templates {
		if _, ok := p.tpls[t]; ok {
			np.TemplateReady = true
		}
	}
	p.mu.Unlock()
	p.Disk.mu.Lock()
	_, np.ImageReady = p.Disk.images[part.ImageDir]
	p.Disk.mu.Unlock()
	return &np
}

// TemplateUsage implements state.ProcMeter: 64 bytes per template
// variable (the checkpoint's Bytes).
func (p *Proc) TemplateUsage(parts []*state.ProcPart) (int, int64) {
	p.mu.Lock()
	defer p.mu.Unlock()
	n, b := 0, int64(0)
	for _, part := range parts {
		for _, t := range part.Templates {
			if snap, ok := p.tpls[t]; ok {
				n++
				b += int64(len(snap)) * 64
			}
		}
	}
	return n, b
}

// Cleanup implements state.ProcBackend.
func (p *Proc) Cleanup(context.Context, string) error { return nil }

// Exec implements state.ProcSandbox.
// PrefetchMapped implements state.MappedPrefetcher: it counts the call.
func (s *Sandbox) PrefetchMapped(context.Context) error {
	s.p.Prefetches.Add(1)
	return nil
}

func (s *Sandbox) Exec(ctx context.Context, req state.ExecRequest) (int, error) {
	out, code := s.run(ctx, req.Argv)
	if req.Stdout != nil {
		fmt.Fprint(req.Stdout, out)
	}
	return code, nil
}

func (s *Sandbox) run(ctx context.Context, argv []string) (string, int) {
	s.mu.Lock()
	if s.closed {
		s.mu.Unlock()
		return "sandbox closed\n", 137
	}
	s.mu.Unlock()
	if len(argv) == 0 {
		return "", 0
	}
	arg := func(i int) string {
		if i < len(argv) {
			return argv[i]
		}
		return ""
	}
	switch argv[0] {
	case "write":
		s.mount.write(arg(1), strings.Join(argv[min(2, len(argv)):], " "))
		s.note(true)
		return "", 0
	case "rm":
		s.mount.mu.Lock()
		delete(s.mount.files, arg(1))
		s.mount.mu.Unlock()
		s.note(true)
		return "", 0
	case "cat":
		v, ok := s.mount.Read(arg(1))
		if !ok {
			return "cat: " + arg(1) + ": No such file or directory\n", 1
		}
		return v + "\n", 0
	case "set":
		s.mu.Lock()
		s.mem[arg(1)] = strings.Join(argv[min(2, len(argv)):], " ")
		s.procOps++
		s.mu.Unlock()
		return "", 0
	case "get":
		s.mu.Lock()
		defer s.mu.Unlock()
		return s.mem[arg(1)] + "\n", 0
	case "echo":
		return strings.Join(argv[1:], " ") + "\n", 0
	case "sleep":
		ms, _ := strconv.Atoi(arg(1))
		select {
		case <-time.After(time.Duration(ms) * time.Millisecond):
		case <-ctx.Done():
		}
		return "", 0
	case "exit":
		n, _ := strconv.Atoi(arg(1))
		return "", n
	}
	return argv[0] + ": command not found\n", 127
}

func (s *Sandbox) note(fs bool) {
	s.mu.Lock()
	if fs {
		s.fsOps++
	} else {
		s.procOps++
	}
	s.mu.Unlock()
}

// StartSession implements state.ProcSandbox.
func (s *Sandbox) StartSession(_ context.Context, id string, _, _ []string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	s.sessions[id] = true
	s.mem["session:"+id] = "1"
	s.procOps++
	return nil
}

// Send implements state.ProcSandbox.
func (s *Sandbox) Send(ctx context.Context, req state.SendRequest) (state.SendAnswer, error) {
	out, _ := s.run(ctx, strings.Fields(req.Text))
	return state.SendAnswer{Output: out, Ended: state.EndedIdle}, nil
}

// WriteRunFile implements state.ProcSandbox (the fake keeps it in the
// mount, under /run/rewind).
func (s *Sandbox) WriteRunFile(name string, data []byte) error {
	s.mount.writeQuiet("/run/rewind/"+name, string(data))
	return nil
}

// StopSession implements state.SessionStopper.
func (s *Sandbox) StopSession(_ context.Context, id string) error {
	s.mu.Lock()
	defer s.mu.Unlock()
	if !s.sessions[id] {
		return fmt.Errorf("fake proc: no session %s", id)
	}
	delete(s.sessions, id)
	return nil
}

// Sessions implements state.ProcSandbox.
func (s *Sandbox) Sessions() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	var out []string
	for id := range s.sessions {
		out = append(out, id)
	}
	sort.Strings(out)
	return out
}

// Checkpoint implements state.ProcSandbox.
func (s *Sandbox) Checkpoint(_ context.Context, barrier func() error) (*state.ProcPart, error) {
	start := time.Now()
	s.mu.Lock()
	s.frozen = true
	s.mu.Unlock()
	defer func() {
		s.mu.Lock()
		s.frozen = false
		s.mu.Unlock()
	}()
	if err := barrier(); err != nil {
		return nil, err
	}
	s.mu.Lock()
	snap := maps.Clone(s.mem)
	for id := range s.sessions {
		snap["session:"+id] = "1"
	}
	s.mu.Unlock()
	s.p.Disk.mu.Lock()
	t := s.p.Disk.next("tpl")
	s.p.Disk.mu.Unlock()
	s.p.mu.Lock()
	if s.p.tpls == nil {
		s.p.tpls = map[string]map[string]string{}
	}
	s.p.tpls[t] = snap
	if s.p.tplOwner == nil {
		s.p.tplOwner = map[string]string{}
	}
	s.p.tplOwner[t] = s.id
	s.p.mu.Unlock()
	s.p.event("checkpoint", []string{t})
	return &state.ProcPart{Templates: []string{t}, TemplateReady: true, Processes: 1,
		Bytes: int64(len(snap)) * 64, FrozenUS: max(1, time.Since(start).Microseconds())}, nil
}

func (p *Proc) owner(tpl string) string {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.tplOwner[tpl]
}

// Persist implements state.ProcSandbox.
func (s *Sandbox) Persist(_ context.Context, part *state.ProcPart) (*state.ProcPart, error) {
	time.Sleep(time.Duration(s.p.Faults.PersistDelay.Load()))
	if s.p.Faults.FailPersist.Load() {
		return nil, errors.New("fake proc: injected persist failure")
	}
	s.p.mu.Lock()
	snap, ok := s.p.tpls[part.Templates[0]]
	s.p.mu.Unlock()
	if !ok {
		return nil, errors.New("fake proc: template gone")
	}
	np := *part
	s.p.Disk.mu.Lock()
	np.ImageDir = s.p.Disk.next("img")
	s.p.Disk.images[np.ImageDir] = maps.Clone(snap)
	s.p.Disk.mu.Unlock()
	np.ImageReady = true
	return &np, nil
}

// NeedsExactPids implements state.ExactPidsRestorer: see
// Faults.TemplatesKeepNoPids.
func (s *Sandbox) NeedsExactPids(part *state.ProcPart) bool {
	return !(s.p.Faults.TemplatesKeepNoPids.Load() && part.TemplateReady)
}

// Restore implements state.ProcSandbox like the real engine: the live
// processes die first, then the fs switches, then the copies start. With
// FailRestore the processes are gone and the copies never come.
func (s *Sandbox) Restore(_ context.Context, part *state.ProcPart, switchFS func() error) (string, error) {
	s.p.event("restore", part.Templates)
	var snap map[string]string
	path := ""
	s.p.mu.Lock()
	foreign := len(part.Templates) > 0 && s.p.tplOwner[part.Templates[0]] != s.id
	if part.TemplateReady && len(part.Templates) > 0 && !foreign {
		snap, path = s.p.tpls[part.Templates[0]], "template"
	}
	s.p.mu.Unlock()
	if foreign && !part.ImageReady {
		// As the real engine: another sandbox's templates cannot be
		// forked into this one; its image can be restored here.
		return "", fmt.Errorf("fake proc: %s was taken in sandbox %s and has no image yet", part.Templates[0], s.p.owner(part.Templates[0]))
	}
	if snap == nil && part.ImageReady {
		s.p.Disk.mu.Lock()
		snap, path = s.p.Disk.images[part.ImageDir], "criu"
		s.p.Disk.mu.Unlock()
	}
	if snap == nil {
		return "", errors.New("fake proc: part not restorable")
	}
	s.mu.Lock()
	s.mem = map[string]string{} // killed
	s.sessions = map[string]bool{}
	s.mu.Unlock()
	if err := switchFS(); err != nil {
		return "", err
	}
	s.p.Faults.Restores.Add(1)
	if s.p.Faults.FailRestore.Add(-1) >= 0 {
		if s.p.Faults.RestoreFailsForGood.Load() {
			return "", permanentError{errors.New("fake proc: injected permanent restore failure")}
		}
		return "", errors.New("fake proc: injected restore failure")
	}
	s.mu.Lock()
	s.mem = maps.Clone(snap)
	for k := range snap {
		if id, ok := strings.CutPrefix(k, "session:"); ok {
			s.sessions[id] = true
		}
	}
	s.mu.Unlock()
	return path, nil
}

// permanentError is a failure that the same call would meet again.
type permanentError struct{ error }

func (e permanentError) Unwrap() error { return e.error }

// Permanent reports that trying again cannot help.
func (permanentError) Permanent() bool { return true }

// Close implements state.ProcSandbox.
func (s *Sandbox) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	return nil
}

// Mem returns a process variable (for assertions).
func (s *Sandbox) Mem(k string) string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return s.mem[k]
}

// Probe is a fake state.Probe: it reports the fake sandbox's fs and
// process operations since the last Take.
type Probe struct{}

// Watch implements state.Probe.
func (Probe) Watch(_ context.Context, name string, _ state.FSMount, proc state.ProcSandbox) (state.ProbeWindow, error) {
	s, ok := proc.(*Sandbox)
	if !ok {
		return nil, errors.New("fake probe: not a fake sandbox")
	}
	return &window{s: s, name: name}, nil
}

type window struct {
	s    *Sandbox
	name string
	turn uint64
}

func (w *window) End(context.Context) (*effect.Report, error) {
	w.s.mu.Lock()
	fsOps, procOps := w.s.fsOps, w.s.procOps
	w.s.fsOps, w.s.procOps = 0, 0
	w.s.mu.Unlock()
	w.turn++
	r := &effect.Report{Version: effect.Version, Sandbox: w.name, Turn: w.turn, Backend: "fake"}
	r.FS.Modified = uint64(fsOps)
	r.FS.UpperNonEmpty = w.s.mount.dirty.Load() > 0
	r.Mem.PagesWritten = uint64(procOps)
	return r, nil
}

// Begin forgets what happened between windows (the manager's own work).
func (w *window) Begin(context.Context) error {
	w.s.mu.Lock()
	w.s.fsOps, w.s.procOps = 0, 0
	w.s.mu.Unlock()
	return nil
}

func (w *window) Close() error { return nil }

// Policy is a fake policy: skip when nothing changed, fs when only files
// changed, full otherwise. With IgnoreFS it skips file changes too (as a
// policy that ignores a cache directory would).
type Policy struct{ IgnoreFS bool }

// Decide implements state.Policy.
func (p Policy) Decide(_ context.Context, r *effect.Report) (state.Decision, error) {
	switch {
	case r.ProcChanged():
		return state.Decision{Mode: state.ModeFull, Reason: "process state changed"}, nil
	case r.FSChanged() && !p.IgnoreFS:
		return state.Decision{Mode: state.ModeFS, Reason: "files changed"}, nil
	}
	return state.Decision{Mode: state.ModeSkip, Reason: "no effect"}, nil
}

// Policies loads the fake policy under any name; "ignore-fs" loads it
// with IgnoreFS.
type Policies struct{}

// Load implements state.PolicyLoader.
func (Policies) Load(_ context.Context, name string) (state.Policy, error) {
	return Policy{IgnoreFS: name == "ignore-fs"}, nil
}

// Backends bundles a fake FS and Proc over one Disk.
type Backends struct {
	Disk   *Disk
	Faults *Faults
	FS     *FS
	Proc   *Proc
}

// New returns fake back ends over disk (a new Disk if nil).
func New(disk *Disk) *Backends {
	if disk == nil {
		disk = NewDisk()
	}
	f := &Faults{}
	return &Backends{Disk: disk, Faults: f, FS: &FS{Disk: disk, Faults: f}, Proc: &Proc{Disk: disk, Faults: f}}
}
