package probe

import (
	"errors"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
)

// FSSource yields the file-system effects of a sandbox since its previous
// call. The fs layer (fs.(*FS)) implements it; DirSource is a scanning
// implementation for hosts and tests without the fs layer.
type FSSource interface {
	TakeFSEffects() effect.FS
}

// Target identifies the sandbox a window observes.
type Target struct {
	// Sandbox is the sandbox id; at most one window per Sandbox is open at a
	// time, and turns are numbered per Sandbox.
	Sandbox string
	// CgroupV2Dir is the sandbox's cgroup v2 directory. Its cgroup.procs
	// (and those of nested directories) list the sandbox's processes.
	CgroupV2Dir string
	// CgroupID is the cgroup v2 id (inode number of CgroupV2Dir); 0 makes
	// the probe look it up.
	CgroupID uint64
	// InitPID is the host pid of the sandbox's PID 1. Its memory is rewind's,
	// not the agent's: it is excluded from memory accounting. 0 if none.
	InitPID int
	// FS supplies file-system effects; nil leaves them to the backend (the
	// eBPF backend counts syscalls; the userspace backend cannot see them
	// and flags the report with LostEvents = 1).
	FS FSSource
	// Exclude, if set, names processes of the cgroup that are not the
	// agent's (checkpoint templates, warm spares): the process snapshots
	// ignore them, so they never count as alive, new, exited or writing
	// memory. It is called for every pid of the cgroup at Begin and at End
	// and must be cheap and safe for concurrent use.
	Exclude func(pid int) bool
	// ExcludeStat, if set, is asked by the snapshots instead of Exclude:
	// stat returns the process's /proc/PID/stat, read at most once per
	// process and snapshot, and the snapshot parses the same bytes, so an
	// exclusion that looks at the process's own stat costs no read of its
	// own. The same rules as for Exclude apply.
	ExcludeStat func(pid int, stat func() ([]byte, error)) bool
	// Files, if set, keeps the files the snapshots read open from one
	// snapshot of the sandbox to the next (see Files). The caller closes
	// it once the sandbox's windows are done.
	Files *Files
}

// excluder returns the snapshots' exclusion test of t (nil: none).
func (t Target) excluder() excludeFunc {
	switch {
	case t.ExcludeStat != nil:
		return t.ExcludeStat
	case t.Exclude != nil:
		return func(pid int, _ func() ([]byte, error)) bool { return t.Exclude(pid) }
	}
	return nil
}

// excludeFunc is Target.ExcludeStat's type.
type excludeFunc func(pid int, stat func() ([]byte, error)) bool

// Probe observes sandboxes turn by turn. Implementations are safe for
// concurrent use by many sandboxes.
type Probe interface {
	// Backend returns effect.BackendEBPF or effect.BackendUserspace.
	Backend() string
	// Begin opens the observation window of one turn of t.Sandbox.
	Begin(t Target) (Window, error)
	// Close ends every open window and releases the probe's resources.
	Close() error
}

// KnownBeginner is implemented by probes that can open a window on
// processes the caller knows: pids are every process of the agent's in the
// target's cgroup at this moment (a restore just made them and killed the
// rest), so the window's first snapshot reads only those, without listing
// the cgroup or asking Target.Exclude. A process of pids that is gone is
// left out. The caller must not forget one: End would count it as new if
// it still runs, and not at all had it exited.
type KnownBeginner interface {
	BeginKnown(t Target, pids []int) (Window, error)
}

// Window is the observation of one turn of one sandbox.
type Window interface {
	// End closes the window and returns the turn's report.
	End() (*effect.Report, error)
	// Next is End followed by Begin of the next turn of the same target,
	// without a gap between the two windows and at the cost of one /proc
	// snapshot instead of two. On error no window is open.
	Next() (*effect.Report, Window, error)
	// Abort closes the window without a report. It is idempotent, and a
	// no-op after End.
	Abort()
}

// Backend selectors for Options.Backend.
const (
	BackendAuto      = "auto"
	BackendEBPF      = effect.BackendEBPF
	BackendUserspace = effect.BackendUserspace
)

// Options configure Open.
type Options struct {
	// Backend is BackendAuto (or ""), BackendEBPF or BackendUserspace.
	Backend string
	// Logger receives diagnostics; nil means slog.Default().
	Logger *slog.Logger
	// RingBufferBytes sizes the eBPF sample ring buffer (power of two, at
	// least one page); 0 means 4 MiB.
	RingBufferBytes int
}

// Errors returned by probes.
var (
	// ErrWindowOpen is returned by Begin when the sandbox already has an
	// open window.
	ErrWindowOpen = errors.New("probe: window already open for this sandbox")
	// ErrClosed is returned when the probe or window is closed.
	ErrClosed = errors.New("probe: closed")
	// ErrUnsupported is returned where the platform lacks the backend.
	ErrUnsupported = errors.New("probe: not supported on this platform")
)

// Open returns a probe with the backend chosen by opts.
func Open(opts Options) (Probe, error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	opts.Logger = log
	switch opts.Backend {
	case "", BackendAuto:
		p, err := OpenEBPF(opts)
		if err == nil {
			return p, nil
		}
		log.Info("probe: eBPF backend unavailable, using userspace backend", "err", err)
		return NewUserspace(opts)
	case BackendEBPF:
		return OpenEBPF(opts)
	case BackendUserspace:
		return NewUserspace(opts)
	default:
		return nil, fmt.Errorf("probe: unknown backend %q (want auto, ebpf or userspace)", opts.Backend)
	}
}

// turns numbers turns per sandbox and tracks which sandboxes have an open
// window.
type turns struct {
	mu   sync.Mutex
	next map[string]uint64
	open map[string]bool
}

func newTurns() *turns {
	return &turns{next: map[string]uint64{}, open: map[string]bool{}}
}

// acquire marks sandbox's window open and returns its turn number.
func (t *turns) acquire(sandbox string) (uint64, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.open[sandbox] {
		return 0, fmt.Errorf("begin %s: %w", sandbox, ErrWindowOpen)
	}
	t.open[sandbox] = true
	t.next[sandbox]++
	return t.next[sandbox], nil
}

// advance returns the next turn number of a sandbox whose window stays open.
func (t *turns) advance(sandbox string) uint64 {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.next[sandbox]++
	return t.next[sandbox]
}

// giveBack returns turn number n of sandbox, taken by a window that was
// aborted without a report, when no later number was handed out since:
// the next window reuses it, so the reports of a sandbox's turns are
// numbered 1, 2, 3 even when each turn's End opens a window (Next) that
// the caller replaces with one of its own (Begin) after rewind's own work.
func (t *turns) giveBack(sandbox string, n uint64) {
	t.mu.Lock()
	defer t.mu.Unlock()
	if t.next[sandbox] == n {
		t.next[sandbox]--
	}
}

func (t *turns) release(sandbox string) {
	t.mu.Lock()
	defer t.mu.Unlock()
	delete(t.open, sandbox)
}

// newReport starts a report for a window.
func newReport(backend, sandbox string, turn uint64, began, ended time.Time) *effect.Report {
	return &effect.Report{
		Version:    effect.Version,
		Sandbox:    sandbox,
		Turn:       turn,
		Backend:    backend,
		DurationUS: ended.Sub(began).Microseconds(),
	}
}
