package state

import (
	"context"
	"io"
	"time"

	"github.com/rewind-sandbox/rewind/effect"
)

// FSSpec describes the file system a sandbox's root is built from.
type FSSpec struct {
	// Bases are read-only lower directories, bottom first. Empty means the
	// host's root file system.
	Bases []string
	// Kind is "auto", "fuse" or "kernel".
	Kind string
	// Hide lists host paths that must never be visible inside (the
	// daemon's state dir and socket dir).
	Hide []string
}

// FSBackend creates sandbox roots and owns the store of frozen layers.
// Layers are reference-counted by the back end: Delete drops one
// checkpoint's reference, and a layer is freed when no checkpoint and no
// mount uses it.
type FSBackend interface {
	// Mount creates a fresh root for sandbox id: the bases with an empty
	// writable upper.
	Mount(ctx context.Context, id string, spec FSSpec) (FSMount, error)
	// MountFrom creates a root for sandbox id whose content is fs
	// checkpoint ckpt (shared frozen layers, a new empty upper).
	MountFrom(ctx context.Context, id string, spec FSSpec, ckpt string) (FSMount, error)
	// Delete frees fs checkpoint ckpt (GC).
	Delete(ctx context.Context, ckpt string) error
	// Cleanup removes what a dead daemon may have left for sandbox id
	// (a stale mount point). It must succeed when there is nothing.
	Cleanup(ctx context.Context, id string) error
}

// LeftoverLister is implemented by an FSBackend that can name the
// sandboxes it holds something for (mount points, mount records), whether
// or not the store knows them: a daemon that dies while it creates a
// sandbox leaves them behind without a record. Open cleans up (FSBackend
// and ProcBackend Cleanup) every one the store does not know.
type LeftoverLister interface {
	Leftovers(ctx context.Context) ([]string, error)
}

// UndoCheckpointer is implemented by process sandboxes that can take a
// cheaper checkpoint for a restore's undo point: one that lives only until
// the restore ends and is restored, if ever, at once (so it needs no
// durable image and no pre-warmed copy). It is otherwise Checkpoint.
// target is the process part the restore goes to: where restoring it
// needs nothing the live processes hold (their pids), the back end may
// keep the processes themselves, stopped, as the undo point instead of
// copying them; Release then kills them and a restore of the undo point
// lets them run on.
type UndoCheckpointer interface {
	CheckpointUndo(ctx context.Context, target *ProcPart, barrier func() error) (*ProcPart, error)
}

// ExactPidsRestorer is implemented by process sandboxes that can tell
// whether restoring a process part recreates its processes with their
// exact pids (from a CRIU image, where templates are forked with new
// ones). Such a restore waits until the last restore's undo point, which
// is released after that restore returned, has let go of its processes'
// pids; one that does not need them does not wait. Without it, every
// restore of the processes waits.
type ExactPidsRestorer interface {
	NeedsExactPids(part *ProcPart) bool
}

// UnchangedChecker is implemented by process sandboxes that can prove
// that their processes are still in the state a checkpoint's process part
// holds, although they ran (a persistent shell writes its own memory on
// every command, read-only or not). A full checkpoint of the sandbox can
// then share that part instead of taking a new one.
type UnchangedChecker interface {
	// Unchanged reports whether every live process of the sandbox is one
	// that part holds (the process it was taken from, or a restored copy
	// of it), none is missing, and each is provably in the state part
	// saved. It says why not otherwise; any doubt is a "no".
	Unchanged(ctx context.Context, part *ProcPart) (bool, string)
}

// PartAdopter is implemented by process sandboxes that can prove that
// their processes, known to be in the state of process part from (a clean
// head), are just as much in the state of another part to: a restore to a
// checkpoint whose part is to then only switches the file system and keeps
// the processes running. AdoptPart answers fast (from what is known, never
// by stopping a process); when it says yes, the back end treats the live
// processes as to's from then on. Any doubt is a "no", with the reason.
type PartAdopter interface {
	AdoptPart(ctx context.Context, from, to *ProcPart) (bool, string)
}

// ProcStarterFor is implemented by process back ends that can start a
// sandbox made ready for the process part restored into it first (the
// daemon's: its pid counter already past the part's image pids, which
// spares the restore a process started in the sandbox). The manager uses
// it, when present, for every sandbox it starts to restore a part into:
// fork children, prepared children, sandboxes brought back after a
// restart.
type ProcStarterFor interface {
	StartFor(ctx context.Context, id, root string, part *ProcPart) (ProcSandbox, error)
}

// MappedPrefetcher is implemented by process sandboxes that can read the
// files their processes map into their file system's cache ahead of use
// (Sandbox.PrefetchMapped in package sandbox). The manager asks a
// prepared fork child to, before handing it out: its first command then
// faults no program page in through its file system.
type MappedPrefetcher interface {
	PrefetchMapped(ctx context.Context) error
}

// FSKindResolver is implemented by FS back ends that resolve the fs kind
// "auto" to the backend they use on this host ("fuse" or "kernel"): the
// manager records the resolved kind in the sandbox record, so a sandbox
// says which backend it runs on and its forks and restores keep it.
type FSKindResolver interface {
	ResolveKind(kind string) string
}

// ViewReplacer is implemented by mounts whose Switch replaces the
// sandbox's root mount instead of changing the content under it (native
// overlayfs on a stock kernel): processes that keep running through a
// switch keep the old view (their working directories and open files).
// When ReplacesView is true the manager never switches the file system
// under running processes: a restore re-creates them from a process part
// even when they are already in the target's state.
type ViewReplacer interface {
	ReplacesView() bool
}

// FSFlusher is implemented by FS mounts whose page cache can hold writes
// not yet in the view: dirty pages of shared file mappings, which the
// kernel writes back when it likes, at the latest while the process that
// mapped them exits (after the kill of a restore returned). A restore
// calls Flush once the sandbox's processes are killed and before it
// switches, so what they wrote reaches the view being left and never the
// switched one.
type FSFlusher interface {
	Flush(ctx context.Context) error
}

// FSSizer is implemented by FS back ends that can tell, after the fact,
// the bytes an fs checkpoint added (its frozen layer). The manager asks in
// the background, off the checkpoint's critical path, for checkpoints whose
// FSMount.Checkpoint reported 0, so that byte budgets see real sizes.
type FSSizer interface {
	Size(ctx context.Context, ckpt string) (int64, error)
}

// FSChecker is implemented by FS back ends that can lose an fs checkpoint
// to a crash after FSMount.Checkpoint returned its id: the kernel path
// writes a checkpoint's layer and record after the sandbox's freeze
// window, and a checkpoint whose record was never written does not exist.
// When the manager opens its store it drops every checkpoint whose fs part
// Lost reports gone (an error reading it is not a loss).
type FSChecker interface {
	Lost(ctx context.Context, ckpt string) bool
}

// FSWaiter is implemented by FS back ends whose FSMount.Checkpoint returns
// before the checkpoint is complete on disk (the kernel path writes the
// layer and record after the freeze window). AwaitCheckpoint returns once
// fs checkpoint ckpt is written, or the error that dropped it; a
// checkpoint is durable only after it.
type FSWaiter interface {
	AwaitCheckpoint(ctx context.Context, ckpt string) error
}

// FSMount is one mounted sandbox root.
type FSMount interface {
	// Root is the host path of the sandbox's / (empty for fakes).
	Root() string
	// Checkpoint freezes the writable upper into a layer and returns its
	// checkpoint id and the bytes it added.
	Checkpoint(ctx context.Context) (id string, bytes int64, err error)
	// Switch makes the mount show fs checkpoint ckpt with a fresh upper.
	// It is atomic: on error the mount is unchanged.
	Switch(ctx context.Context, ckpt string) error
	// Unmount tears the mount down; frozen layers stay in the store.
	Unmount() error
}

// ProcBackend starts the process side of sandboxes.
type ProcBackend interface {
	// Start starts sandbox id's process side (its init) on root.
	Start(ctx context.Context, id string, root string) (ProcSandbox, error)
	// Release frees a checkpoint's process part (templates, images).
	Release(ctx context.Context, part *ProcPart) error
	// Recover is called once per stored part when the daemon opens its
	// store: it returns the part with its readiness reflecting what
	// survived (templates die with the daemon or the host; images on disk
	// survive).
	Recover(ctx context.Context, part *ProcPart) *ProcPart
	// Cleanup kills whatever a dead daemon left of sandbox id.
	Cleanup(ctx context.Context, id string) error
}

// ImageSweeper is implemented by process back ends that keep process
// parts in files of their own (CRIU image directories), which can outlive
// every checkpoint that used them: a dump that failed, one cut short by a
// daemon killed while writing it, a removal cut short the same way, a
// part released while the back end did not know it (after a restart).
// The manager calls SweepImages with the process parts of every
// checkpoint it keeps: once when it opens its store (start: nothing of
// this daemon is in flight yet) and after every collection. The back end
// removes whatever none of them uses, and never what it is writing or
// holding now.
type ImageSweeper interface {
	SweepImages(ctx context.Context, keep []*ProcPart, start bool) (removed int, bytes int64, err error)
}

// ProcMeter is implemented by process back ends that can say what memory
// the live fast-restore form of checkpoints holds (templates and their
// spares), for Manager.Usage.
type ProcMeter interface {
	// TemplateUsage returns how many template processes the parts keep
	// alive and their private dirty memory in bytes, measured now.
	TemplateUsage(parts []*ProcPart) (processes int, bytes int64)
}

// ExecRequest is a one-shot command.
type ExecRequest struct {
	Argv   []string
	Env    []string
	Dir    string
	Stdin  io.Reader
	Stdout io.Writer
	Stderr io.Writer
}

// SendRequest writes to a session and collects its answer.
type SendRequest struct {
	Session string
	Text    string
	// Idle ends the read once output has been quiet this long.
	Idle time.Duration
	// Until, if set, is a regular expression that ends the read when the
	// output so far matches it.
	Until string
	// Timeout bounds the whole call.
	Timeout time.Duration
}

// What ended a send's read of a session's answer (SendAnswer.Ended).
const (
	// EndedUntil: the output matched SendRequest.Until.
	EndedUntil = "until"
	// EndedIdle: the output was quiet for SendRequest.Idle.
	EndedIdle = "idle"
	// EndedTimeout: SendRequest.Timeout passed first; the process may be
	// busy still, and what it prints later comes with the next send.
	EndedTimeout = "timeout"
	// EndedExit: the session's process exited (SendAnswer.Exit).
	EndedExit = "exit"
)

// SendAnswer is a session's answer to a send.
type SendAnswer struct {
	// Output is what the process printed since the previous send.
	Output string
	// Ended says what ended the read (Ended*).
	Ended string
	// Exit is the exit status of a session's process that exited (128 +
	// the signal of one killed); nil while it runs.
	Exit *int
}

// SessionStopper is implemented by process sandboxes that can stop one
// session: StopSession kills the session's process and its process group
// and forgets the session.
type SessionStopper interface {
	StopSession(ctx context.Context, session string) error
}

// ProcSandbox is the live process side of one sandbox.
type ProcSandbox interface {
	Exec(ctx context.Context, req ExecRequest) (exitCode int, err error)
	StartSession(ctx context.Context, session string, argv, env []string) error
	Send(ctx context.Context, req SendRequest) (SendAnswer, error)
	// WriteRunFile writes /run/rewind/<name> inside the sandbox (a
	// per-sandbox file outside every checkpoint: a fork's copy number).
	WriteRunFile(name string, data []byte) error
	// Sessions lists the session ids alive.
	Sessions() []string
	// Checkpoint stops every process of the sandbox, runs barrier while
	// they are stopped (the state manager takes the fs checkpoint there, so
	// both halves come from one freeze window), captures the processes
	// (the fast part only, for example templates) and resumes them. If
	// barrier fails, Checkpoint resumes the processes and returns its error.
	Checkpoint(ctx context.Context, barrier func() error) (*ProcPart, error)
	// Persist makes a part durable (for example a CRIU dump of the
	// templates) and returns the updated part. It runs outside the
	// sandbox's operation order, while the sandbox runs on.
	Persist(ctx context.Context, part *ProcPart) (*ProcPart, error)
	// Restore kills the sandbox's processes, runs switchFS (the fs
	// switch, so the fs changes first), and recreates the processes of
	// part. It need not be atomic: on error the state manager restores the
	// undo checkpoint it took before. It returns the path taken:
	// "template", "criu" or "criu-lazy".
	Restore(ctx context.Context, part *ProcPart, switchFS func() error) (path string, err error)
	// Close kills every process (templates of this sandbox's own
	// checkpoints excepted only if the back end keeps them elsewhere).
	Close() error
}

// Probe watches a sandbox's effects between turns.
type Probe interface {
	// Watch starts observing a sandbox.
	Watch(ctx context.Context, name string, fs FSMount, proc ProcSandbox) (ProbeWindow, error)
}

// ProbeWindow observes one sandbox turn by turn. Watch returns it with a
// window open; End closes it and reports what happened in it; Begin opens
// the next one. The state manager keeps its own work (a checkpoint's
// template forks, a restore) between End and Begin, so it is never
// reported as the agent's effect.
type ProbeWindow interface {
	End(ctx context.Context) (*effect.Report, error)
	Begin(ctx context.Context) error
	Close() error
}

// ProbeResumer is implemented by probe windows that can open the next
// window from the moment End closed the last one (End's own snapshot of
// the processes, and whatever they did since counted in the new window),
// which costs no new snapshot. The state manager resumes only where its
// own work in between left the processes alone (a restore that only
// switches the fs). Resume fails, opening nothing, when End kept no such
// moment; Begin then opens a fresh window as usual.
type ProbeResumer interface {
	Resume(ctx context.Context) error
}

// Decision is a policy's verdict.
type Decision struct {
	Mode   Mode
	Reason string
	// Fallback is set when the policy failed and Mode is the safe full
	// decision taken in its place.
	Fallback bool
}

// Policy decides what a turn saves from its effect report.
type Policy interface {
	Decide(ctx context.Context, r *effect.Report) (Decision, error)
}

// PolicyLoader resolves a policy name or .wasm path.
type PolicyLoader interface {
	Load(ctx context.Context, name string) (Policy, error)
}

// Observer receives measurements (the daemon turns them into metrics).
// Every method must be cheap and safe for concurrent use.
type Observer interface {
	Checkpointed(kind Mode, took, frozen time.Duration, err error)
	Restored(path string, took time.Duration, err error)
	Decided(policy string, mode Mode)
	Forked(n int, took time.Duration)
	Collected(freed int, took time.Duration)
}

type nopObserver struct{}

func (nopObserver) Checkpointed(Mode, time.Duration, time.Duration, error) {}
func (nopObserver) Restored(string, time.Duration, error)                  {}
func (nopObserver) Decided(string, Mode)                                   {}
func (nopObserver) Forked(int, time.Duration)                              {}
func (nopObserver) Collected(int, time.Duration)                           {}
