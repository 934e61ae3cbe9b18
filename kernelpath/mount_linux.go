package kernelpath

import (
	"encoding/json"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// FS is a sandbox view mounted as a native overlayfs. It implements
// layer.FS. Methods are safe for concurrent use.
type FS struct {
	st       *layer.Store
	id       string
	mp       string
	log      *slog.Logger
	freeze   string // FreezeIoctl, FreezeReflink or FreezeCopy
	fstype   string // of the state dir
	syncCkpt bool
	mntID    uint64 // our overlay's mount id at mp (0 = unknown)

	mu     sync.Mutex
	closed bool
	lowers []string // external base dirs, topmost first
	layers []string // frozen layers under the upper, bottom first
	upper  string   // id of the live upper layer
	base   string   // last checkpoint taken or switched to
	gen    uint64   // ioctl generation (ioctl mode only)
	ckpt   *fpIndex // the upper as the last checkpoint froze it (nil = none)
	chain  []string // layers frozen from the live upper, bottom first
	live   []string // frozen layers the live overlay uses (the mount record's)
	taken  *fpIndex // the upper as the last effect report saw it (nil = as the last checkpoint froze it)

	// track follows the live upper's changes (nil: every incremental
	// checkpoint walks the upper); lastFreeze says how the last
	// checkpoint found its entries ("tracked", "walk: <why>", "full").
	track       *tracker
	noTrack     bool
	lastFreeze  string
	lastEffects string // how the last effect report found its entries

	// pending is the checkpoint whose layer is being written after its
	// freeze (nil: none); failed are the errors of those dropped since
	// the last Flush.
	pending *pendingCkpt
	failed  []error
	// spare is an empty layer made after the last checkpoint for the
	// next one ("" = none).
	spare string
	// noDefer writes every checkpoint's layer inside the freeze (tests
	// and benchmarks compare the two).
	noDefer bool
	// finishHook, when set, runs before a deferred checkpoint's layer is
	// written; its error drops the checkpoint (tests).
	finishHook func() error

	// pool holds unnamed files for the copies of the next checkpoint
	// (copyfile_linux.go); nil in ioctl mode and off XFS.
	pool *tmpPool

	// teardown counts detached overlays still being torn down in the
	// background (Switch); Unmount waits for them.
	teardown sync.WaitGroup

	// The background sync of checkpoint records (syncSoon).
	syncMu    sync.Mutex
	syncing   bool // a sync goroutine runs
	syncAgain bool // a record came while it ran: sync once more
	syncWG    sync.WaitGroup
}

// maxChain bounds the delta layers stacked by consecutive checkpoints: at
// the bound the chain is merged into one layer (a full freeze of the upper
// if the merge is skipped or fails).
const maxChain = 16

var _ layer.FS = (*FS)(nil)

// Mount mounts a native overlayfs view of the store st at mountpoint: a
// fresh view, or the content of checkpoint opts.From, plus a fresh upper.
// A stale overlay left at mountpoint by a crashed process of this store is
// detached first (and logged); any other mount there is an error.
func Mount(st *layer.Store, mountpoint string, opts Options) (*FS, error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	id := opts.MountID
	if id == "" {
		id = layer.NewID()
	}
	if !layer.ValidID(id) {
		return nil, fmt.Errorf("kernel mount: invalid mount id %q", id)
	}
	mp, err := filepath.Abs(mountpoint)
	if err != nil {
		return nil, fmt.Errorf("kernel mount %s: %w", id, err)
	}
	if rec, err := st.Mount(id); err == nil && rec.PID != os.Getpid() && layer.ProcessAlive(rec.PID) {
		return nil, fmt.Errorf("kernel mount %s: mount id in use by live process %d", id, rec.PID)
	}
	if err := detachStale(st, mp, log); err != nil {
		return nil, fmt.Errorf("kernel mount %s: %w", id, err)
	}
	f := &FS{st: st, id: id, mp: mp, log: log, lowers: append([]string(nil), opts.Lowers...), fstype: fsType(st.Dir()), syncCkpt: opts.SyncCheckpoint, noTrack: opts.NoTrack}
	if opts.From != "" {
		c, err := st.Checkpoint(opts.From)
		if err != nil {
			return nil, fmt.Errorf("kernel mount %s: %w", id, err)
		}
		f.lowers, f.layers, f.base = c.Lowers, c.Layers, c.ID
	}
	for i, l := range f.lowers {
		abs, err := filepath.Abs(l)
		if err != nil {
			return nil, fmt.Errorf("kernel mount %s: lower %s: %w", id, l, err)
		}
		f.lowers[i] = abs
	}
	switch opts.Freeze {
	case "":
		if probeReflink(st.WorkDir()) {
			f.freeze = FreezeReflink
		} else {
			f.freeze = FreezeCopy
		}
	case FreezeReflink, FreezeCopy:
		f.freeze = opts.Freeze
	default:
		return nil, fmt.Errorf("kernel mount %s: unknown freeze mode %q", id, opts.Freeze)
	}
	cleanupWork(st, id, "")
	upper, err := f.newUpper("")
	if err != nil {
		return nil, fmt.Errorf("kernel mount %s: %w", id, err)
	}
	f.startTracking(upper)
	mfd, err := createOverlay(f.stackFor(f.layers, upper))
	if err != nil {
		f.stopTracking()
		return nil, fmt.Errorf("kernel mount %s: %w", id, err)
	}
	defer unix.Close(mfd)
	if err := attach(mfd, mp); err != nil {
		f.stopTracking()
		return nil, fmt.Errorf("kernel mount %s: %w", id, err)
	}
	f.upper, f.live = upper, f.layers
	f.mntID = mountID(mp)
	if !opts.NoIoctl {
		if gen, err := f.query(); err == nil {
			f.freeze, f.gen = FreezeIoctl, gen
		}
	}
	if f.freeze == FreezeIoctl {
		f.stopTracking()
	} else if f.fstype == "xfs" {
		// Measured on XFS only (copyfile_linux.go); on btrfs both the
		// pool and the helper make checkpoints slower.
		f.pool = newTmpPool(st.WorkDir())
		f.pool.refill()
	}
	if err := f.saveRecord(true); err != nil {
		_ = unix.Unmount(mp, unix.MNT_DETACH)
		f.stopTracking()
		f.pool.close()
		return nil, fmt.Errorf("kernel mount %s: %w", id, err)
	}
	log.Info("kernelpath: mounted", "mount", id, "mountpoint", mp, "layers", len(f.layers), "freeze", f.freeze, "fstype", f.fstype)
	return f, nil
}

// detachStale detaches an overlay left at mp by a crashed mount of st.
func detachStale(st *layer.Store, mp string, log *slog.Logger) error {
	root, err := isMountRoot(mp)
	if err != nil {
		return fmt.Errorf("mountpoint %s: %w", mp, err)
	}
	if !root {
		return nil
	}
	recs, _ := st.Mounts()
	for _, r := range recs {
		if r.Mountpoint == mp && (r.PID == os.Getpid() || !layer.ProcessAlive(r.PID)) && fsType(mp) == "overlay" {
			log.Warn("kernelpath: detaching stale overlay left by a crashed mount", "mountpoint", mp, "mount", r.ID, "pid", r.PID)
			if err := unix.Unmount(mp, unix.MNT_DETACH); err != nil {
				return fmt.Errorf("detach stale mount at %s: %w", mp, err)
			}
			return nil
		}
	}
	return fmt.Errorf("mountpoint %s is already a mount point (not a stale mount of this store)", mp)
}

// cleanupWork removes this mount's overlay work dirs except keep.
func cleanupWork(st *layer.Store, id, keep string) {
	ms, _ := filepath.Glob(filepath.Join(st.WorkDir(), "kp-"+id+"-*"))
	for _, m := range ms {
		if m != keep {
			_ = os.RemoveAll(m)
		}
	}
}

func (f *FS) workFor(upper string) string {
	return filepath.Join(f.st.WorkDir(), "kp-"+f.id+"-"+upper)
}

func (f *FS) emptyLower() (string, error) {
	d := filepath.Join(f.st.WorkDir(), "kp-empty")
	if err := os.Mkdir(d, 0o755); err != nil && !errors.Is(err, os.ErrExist) {
		return "", err
	}
	return d, nil
}

// newUpper creates an empty layer for the upper and its work dir. The
// upper's root takes the root attributes of the directory given (the
// view's root attributes are the upper root's), or, when from is empty, of
// the top of the stack it goes on (f.layers, then the lowers).
func (f *FS) newUpper(from string) (string, error) {
	parent := ""
	if len(f.layers) > 0 {
		parent = f.layers[len(f.layers)-1]
	}
	upper, err := f.st.NewLayer(parent)
	if err != nil {
		return "", err
	}
	if from == "" {
		if ls := f.stackFor(f.layers, upper).lowers; len(ls) > 0 {
			from = ls[0]
		}
	}
	if from != "" {
		if err := layer.CopyRootAttrs(from, f.st.LayerPath(upper)); err != nil {
			return "", err
		}
	}
	if err := os.Mkdir(f.workFor(upper), 0o700); err != nil {
		return "", fmt.Errorf("work dir: %w", err)
	}
	return upper, nil
}

// stackFor is the overlay stack of frozen layers (bottom first) + upper.
func (f *FS) stackFor(layers []string, upper string) stack {
	s := stack{upper: f.st.LayerPath(upper), work: f.workFor(upper)}
	for i := len(layers) - 1; i >= 0; i-- {
		s.lowers = append(s.lowers, f.st.LayerPath(layers[i]))
	}
	s.lowers = append(s.lowers, f.lowers...)
	if len(s.lowers) == 0 {
		if e, err := f.emptyLower(); err == nil {
			s.lowers = []string{e}
		}
	}
	return s
}

func (f *FS) saveRecord(durable bool) error {
	return f.st.SaveMount(layer.MountRecord{
		ID: f.id, PID: os.Getpid(), Mountpoint: f.mp, Lowers: f.lowers,
		Layers: f.live, Upper: f.upper, Base: f.base, Spare: f.spare,
	}, durable)
}

func (f *FS) query() (uint64, error) {
	fd, err := unix.Open(f.mp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return 0, err
	}
	defer unix.Close(fd)
	return queryIoctl(fd)
}

// MountID is the id of this mount in its store.
func (f *FS) MountID() string { return f.id }

// Mountpoint is where the view is mounted.
func (f *FS) Mountpoint() string { return f.mp }

// FreezeMode says how Checkpoint freezes the upper: FreezeIoctl,
// FreezeReflink or FreezeCopy.
func (f *FS) FreezeMode() string { return f.freeze }

// Tracked reports whether the last checkpoint found the upper's changed
// entries by the change tracker (fanotify) rather than by a walk of the
// whole upper.
func (f *FS) Tracked() bool {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	return f.track != nil && f.lastFreeze == "tracked"
}

// Upper is the directory of the live upper layer (for tests and tools).
func (f *FS) Upper() string {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.st.LayerPath(f.upper)
}

// Checkpoint freezes the view into a new checkpoint and returns its id.
//
// Stock kernel: the entries of the live upper are reflinked (or copied)
// into a new frozen layer stacked on the mount's base layers; the live
// mount is untouched (fds and cwds stay valid). The caller must hold the
// sandbox frozen meanwhile for a consistent image. Unless
// Options.SyncCheckpoint is set, Checkpoint returns once it has read the
// upper, and the layer and record are written after it returns
// (finish_linux.go): readers of the checkpoint in this process wait for
// them, and Flush reports a checkpoint dropped because they could not be
// written. On error nothing is recorded and the view is unchanged.
func (f *FS) Checkpoint() (string, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	if f.closed {
		return "", fmt.Errorf("checkpoint %s: unmounted", f.id)
	}
	if f.freeze == FreezeIoctl {
		return f.checkpointIoctl()
	}
	if f.track != nil {
		// The freeze's own opens are dropped from the tracker's queue,
		// by settle when the checkpoint is deferred (off the window).
		defer func() {
			if f.pending == nil && f.track != nil {
				f.track.drainOwn()
			}
		}()
	}
	defer f.pool.refill()
	if f.ckpt != nil && len(f.chain) >= maxChain {
		// Bound the chain by merging its deltas (cost: the entries changed
		// since the chain's first, full freeze) rather than by a new full
		// freeze (cost: the whole upper).
		below := append(append([]string(nil), f.layers...), f.chain[0])
		if id, err := f.mergeRun(below, f.chain[1:]); err != nil {
			f.log.Warn("kernelpath: merging the delta chain failed; full freeze instead", "mount", f.id, "err", err)
		} else if id != "" {
			f.chain = []string{f.chain[0], id}
		}
	}
	incremental := f.ckpt != nil && len(f.chain) > 0 && len(f.chain) < maxChain
	parent := ""
	switch {
	case incremental:
		parent = f.chain[len(f.chain)-1]
	case len(f.layers) > 0:
		parent = f.layers[len(f.layers)-1]
	}
	// The spare made after the last checkpoint (the mount record keeps
	// it from GC; nothing else writes it).
	lid, err := f.spare, error(nil)
	f.spare = ""
	if lid == "" {
		if lid, err = f.st.NewLayer(parent); err != nil {
			return "", fmt.Errorf("checkpoint %s: %w", f.id, err)
		}
	}
	dst := f.st.LayerPath(lid)
	var later *finishQueue
	if !f.syncCkpt && !f.noDefer {
		later = &finishQueue{}
	}
	chain := []string{lid}
	var fc freezeCommit
	if incremental {
		fc, err = f.freezeIncremental(dst, later)
		chain = append(append([]string(nil), f.chain...), lid)
	} else {
		fc, err = f.freezeFull(dst, later)
	}
	var root layer.RootAttrs
	if err == nil {
		// The frozen layer's root carries the view's root attributes.
		root, err = layer.ReadRootAttrs(f.st.LayerPath(f.upper))
	}
	if err != nil {
		later.close()
		return "", fmt.Errorf("checkpoint %s: freeze upper: %w", f.id, err)
	}
	c := layer.Checkpoint{
		ID: layer.NewID(), Mount: f.id, Parent: f.base, Created: time.Now().UTC(),
		Lowers: f.lowers, Layers: append(append([]string(nil), f.layers...), chain...),
	}
	if later == nil {
		if err := root.Apply(dst); err != nil {
			return "", fmt.Errorf("checkpoint %s: freeze upper: %w", f.id, err)
		}
		if err := f.saveCheckpoint(c); err != nil {
			return "", fmt.Errorf("checkpoint %s: %w", f.id, err)
		}
		fc.track()
		fc.fp()
		f.base, f.chain = c.ID, chain
		if err := f.saveRecord(false); err != nil {
			f.log.Warn("kernelpath: mount record not updated", "mount", f.id, "err", err)
		}
		return c.ID, nil
	}
	// The sandbox may run on once the tracker has its new baseline: the
	// layer is written by the queue (finish_linux.go).
	fc.track()
	p := &pendingCkpt{id: c.ID, chain: chain, fp: fc.fp, done: make(chan struct{})}
	f.pending = p
	end := f.st.BeginCheckpoint(c.ID)
	hook := f.finishHook
	go func() {
		var err error
		if hook != nil {
			err = hook()
		}
		if err == nil {
			err = later.run()
		} else {
			later.close()
		}
		if err == nil {
			err = root.Apply(dst)
		}
		if err == nil {
			err = f.saveCheckpoint(c)
		}
		if err == nil {
			// The next checkpoint's layer, made here rather than in its
			// freeze window (settle records it in the mount record, so GC
			// keeps it).
			if id, serr := f.st.NewLayer(""); serr == nil {
				p.spare = id
			}
		}
		p.err = err
		close(p.done)
		end(err)
		f.mu.Lock()
		f.settle()
		f.mu.Unlock()
	}()
	return c.ID, nil
}

// pendingCkpt is a deferred checkpoint whose layer is being written.
type pendingCkpt struct {
	id    string
	chain []string
	fp    func() // records the fingerprint once the layer is complete
	spare string // an empty layer for the next checkpoint ("" = none)
	done  chan struct{}
	err   error // set before done is closed
}

// settle waits for the deferred checkpoint being written, if any, and
// makes it the mount's last checkpoint, or drops it if its layer could not
// be written. f.mu is held. Every method that uses the frozen layers, the
// fingerprint or the tracker calls it first.
func (f *FS) settle() {
	p := f.pending
	if p == nil {
		return
	}
	<-p.done
	f.pending = nil
	if f.track != nil {
		f.track.drainOwn()
	}
	if p.err != nil {
		f.failed = append(f.failed, fmt.Errorf("checkpoint %s: writing its layer: %w", p.id, p.err))
		f.log.Error("kernelpath: a checkpoint's layer could not be written after the freeze; the checkpoint is dropped", "mount", f.id, "checkpoint", p.id, "err", p.err)
		if f.track != nil {
			// Its names were consumed: the next checkpoint must walk.
			f.track.breakf("checkpoint %s was dropped", p.id)
		}
		return
	}
	p.fp()
	f.base, f.chain, f.spare = p.id, p.chain, p.spare
	if err := f.saveRecord(false); err != nil {
		f.log.Warn("kernelpath: mount record not updated", "mount", f.id, "err", err)
	}
}

// Flush waits until every checkpoint returned so far has its layer and
// record written (a checkpoint returns once the upper is read, and writes
// its layer after the freeze window; see finish_linux.go) and returns the
// errors of those that could not be written and were dropped since the
// last Flush.
func (f *FS) Flush() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	err := errors.Join(f.failed...)
	f.failed = nil
	return err
}

// freezeCommit ends a freeze once its checkpoint is recorded: track gives
// the tracker its new baseline (inside the freeze window, before the
// sandbox runs on), fp records the upper's fingerprint (once the layer is
// complete).
type freezeCommit struct {
	track func()
	fp    func()
}

// startTracking watches the new upper's changes (track_linux.go); without
// fanotify every incremental checkpoint walks the upper.
func (f *FS) startTracking(upper string) {
	if f.noTrack {
		return
	}
	t, err := newTracker(f.st.LayerPath(upper))
	if err != nil {
		f.log.Info("kernelpath: no change tracking of the upper; checkpoints walk it", "mount", f.id, "err", err)
		return
	}
	f.track = t
}

func (f *FS) stopTracking() {
	if f.track != nil {
		f.track.close()
		f.track = nil
	}
}

// freezeFull copies the whole upper into the empty layer dir dst (its
// writes queued on later when set).
func (f *FS) freezeFull(dst string, later *finishQueue) (freezeCommit, error) {
	if f.track != nil {
		f.track.drain() // what the copy sees needs no events (an overflow: test every file)
	}
	tr := newTrackCtx(f.track)
	fp, err := freezeTree(f.st.LayerPath(f.upper), dst, f.freeze == FreezeReflink, f.fstype, tr, f.pool, later)
	if err != nil {
		return freezeCommit{}, err
	}
	return freezeCommit{
		track: func() {
			if tr != nil {
				f.commitWalk(tr)
			}
		},
		fp: func() { f.ckpt, f.lastFreeze = newIndex(fp), "full" },
	}, nil
}

// commitWalk ends a walk's checkpoint for the tracker: the files opened
// since the last checkpoint and the writers then are tested wherever they
// are now.
func (f *FS) commitWalk(tr *trackCtx) {
	for _, h := range tr.t.opened {
		tr.l.checkHandle(h)
	}
	for _, h := range tr.t.writers {
		tr.l.checkHandle(h)
	}
	tr.t.committed(tr.l, tr.broken())
}

// freezeIncremental writes into the empty layer dir dst the delta of the
// upper since the last checkpoint (its writes queued on later when set):
// from the tracker's events when they suffice, else by a walk of the
// upper.
func (f *FS) freezeIncremental(dst string, later *finishQueue) (freezeCommit, error) {
	src, reflink := f.st.LayerPath(f.upper), f.freeze == FreezeReflink
	if f.track != nil {
		f.track.drain()
	}
	tr := newTrackCtx(f.track)
	why := "no tracking"
	if tr != nil {
		todo, err := tr.t.plan()
		if err == nil {
			var d trackedDelta
			d, _, err = freezeTracked(src, dst, f.ckpt, todo, reflink, f.fstype, tr, f.pool, later)
			if err == nil {
				return freezeCommit{
					track: func() { tr.t.committed(tr.l, tr.broken()) },
					fp: func() {
						d.apply(f.ckpt, tr.t.forget)
						f.lastFreeze = "tracked"
					},
				}, nil
			}
		}
		if !errors.Is(err, errNeedWalk) {
			return freezeCommit{}, err
		}
		why = err.Error()
		f.log.Debug("kernelpath: checkpoint walks the upper", "mount", f.id, "reason", why)
		// The queue's writes are the tracked attempt's: drop them with it.
		later.close()
		if later != nil {
			*later = finishQueue{}
		}
		if err := emptyDir(dst); err != nil {
			return freezeCommit{}, err
		}
		tr = newTrackCtx(f.track)
	}
	fp, _, err := freezeDelta(src, dst, f.ckpt, reflink, f.fstype, tr, f.pool, later)
	if err != nil {
		return freezeCommit{}, err
	}
	return freezeCommit{
		track: func() {
			if tr != nil {
				f.commitWalk(tr)
			}
		},
		fp: func() { f.ckpt, f.lastFreeze = newIndex(fp), "walk: "+why },
	}, nil
}

// emptyDir removes everything in directory dir (a layer being written:
// no mount, no sandbox path reaches it).
func emptyDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

// saveCheckpoint writes the record rename-atomically (a crash of this
// process never leaves a partial record) and fsyncs it in the background,
// as the FUSE backend does; Options.SyncCheckpoint fsyncs the layer's file
// system and the record before returning (power-loss durability, ~2 ms
// more on a loop XFS here).
func (f *FS) saveCheckpoint(c layer.Checkpoint) error {
	if f.syncCkpt {
		if err := syncFS(f.st.Dir()); err != nil {
			return err
		}
		return f.st.SaveCheckpoint(c)
	}
	b, err := json.Marshal(c)
	if err != nil {
		return err
	}
	p := filepath.Join(f.st.Dir(), "meta", "checkpoints", c.ID+".json")
	if err := layer.WriteFileAtomic(p, b, false); err != nil {
		return err
	}
	f.syncSoon()
	return nil
}

// syncDelay is how long the background sync of checkpoint records waits
// for more checkpoints to share one syncfs: frequent checkpoints (a tree
// search takes one every few milliseconds) then pay one sync per window
// rather than one each, which slowed the next checkpoint's own writes
// (100-entry delta p50 1.9-2.2 ms with one sync per checkpoint, 1.6 ms
// without any, on loop XFS).
const syncDelay = 20 * time.Millisecond

// syncSoon syncs the store's file system in the background, once for all
// the checkpoints recorded within syncDelay (and again if more come while
// it syncs). Unmount waits for it.
func (f *FS) syncSoon() {
	f.syncMu.Lock()
	defer f.syncMu.Unlock()
	if f.syncing {
		f.syncAgain = true
		return
	}
	f.syncing = true
	f.syncWG.Add(1)
	go func() {
		defer f.syncWG.Done()
		for {
			time.Sleep(syncDelay)
			if err := syncFS(f.st.Dir()); err != nil {
				f.log.Debug("kernelpath: background sync of checkpoint records", "err", err)
			}
			f.syncMu.Lock()
			again := f.syncAgain
			f.syncAgain, f.syncing = false, again
			f.syncMu.Unlock()
			if !again {
				return
			}
		}
	}()
}

// syncFS syncs the file system holding path.
func syncFS(path string) error {
	fd, err := unix.Open(path, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	return unix.Syncfs(fd)
}

// checkpointIoctl: the patched kernel freezes the upper in place.
// UNTESTED ON THIS HOST (see ioctl_linux.go).
func (f *FS) checkpointIoctl() (string, error) {
	upper, err := f.newUpper(f.st.LayerPath(f.upper))
	if err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", f.id, err)
	}
	fd, err := unix.Open(f.mp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", f.id, err)
	}
	defer unix.Close(fd)
	gen, err := ioctlCheckpoint(fd, f.gen, f.st.LayerPath(upper), f.workFor(upper))
	if err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", f.id, err)
	}
	frozen := f.upper
	layers := append(append([]string(nil), f.layers...), frozen)
	c := layer.Checkpoint{ID: layer.NewID(), Mount: f.id, Parent: f.base, Created: time.Now().UTC(), Lowers: f.lowers, Layers: layers}
	f.layers, f.live, f.upper, f.gen, f.base, f.ckpt = layers, layers, upper, gen, c.ID, nil
	if err := f.saveCheckpoint(c); err != nil {
		return "", fmt.Errorf("checkpoint %s: %w", f.id, err)
	}
	if err := f.saveRecord(false); err != nil {
		f.log.Warn("kernelpath: mount record not updated", "mount", f.id, "err", err)
	}
	return c.ID, nil
}

// Switch makes the view equal to checkpoint id (of this mount) plus a fresh
// upper. Stock kernel: a new overlay over the target stack is mounted
// beneath the old one, which is then lazily detached; processes holding
// fds or a cwd in the old view keep the old view (the cr engine re-creates
// the process tree after a switch). On error the view is unchanged.
func (f *FS) Switch(id string) error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	if f.closed {
		return fmt.Errorf("switch %s to %s: unmounted", f.id, id)
	}
	c, err := f.st.Checkpoint(id)
	if err != nil {
		return fmt.Errorf("switch %s: %w", f.id, err)
	}
	if c.Mount != f.id {
		return fmt.Errorf("switch %s to %s: checkpoint belongs to mount %s (fork it with Mount(From: id) instead)", f.id, id, c.Mount)
	}
	if !sameStrings(c.Lowers, f.lowers) {
		return fmt.Errorf("switch %s to %s: checkpoint has other base directories", f.id, id)
	}
	oldUpper, oldLayers := f.upper, f.layers
	f.layers = c.Layers
	upper, err := f.newUpper("")
	if err != nil {
		f.layers = oldLayers
		return fmt.Errorf("switch %s to %s: %w", f.id, id, err)
	}
	oldTrack := f.track
	f.track = nil
	if f.freeze == FreezeIoctl {
		err = f.switchIoctl(upper)
	} else {
		f.startTracking(upper)
		err = f.switchRemount(upper, oldLayers, oldUpper)
	}
	if err != nil {
		f.stopTracking()
		f.track = oldTrack
		f.layers = oldLayers
		return fmt.Errorf("switch %s to %s: %w", f.id, id, err)
	}
	if oldTrack != nil {
		// Closing a fanotify group waits for an SRCU grace period once
		// it has marks (10-20 ms measured here, most of a switch's
		// cost): in the background, Unmount waits for it.
		f.teardown.Add(1)
		go func() {
			defer f.teardown.Done()
			oldTrack.close()
		}()
	}
	f.upper, f.base, f.ckpt, f.taken, f.chain, f.live = upper, id, nil, nil, nil, f.layers
	f.mntID = mountID(f.mp)
	if err := f.saveRecord(false); err != nil {
		f.log.Warn("kernelpath: mount record not updated", "mount", f.id, "err", err)
	}
	if f.freeze != FreezeIoctl {
		// The detached overlay may still be used by dying processes; its
		// work dir is removed at the next switch or at unmount.
		f.pruneWork(oldUpper, upper)
	}
	return nil
}

func (f *FS) switchRemount(upper string, oldLayers []string, oldUpper string) error {
	mfd, err := createOverlay(f.stackFor(f.layers, upper))
	if err != nil {
		return err
	}
	defer unix.Close(mfd)
	oldGone, pin, err := replace(mfd, f.mp)
	if pin >= 0 {
		// The old overlay's teardown (a sync of the upper's file system)
		// runs when its last reference goes: here, in the background.
		f.teardown.Add(1)
		go func() {
			defer f.teardown.Done()
			unix.Close(pin)
		}()
	}
	if err != nil && oldGone {
		// The fallback without MOVE_MOUNT_BENEATH failed after the old view
		// was detached: mount the previous stack again (same upper) so the
		// view is unchanged.
		f.log.Error("kernelpath: switch failed with the old view detached; remounting the previous stack", "mount", f.id, "err", err)
		if rfd, rerr := createOverlay(f.stackFor(oldLayers, oldUpper)); rerr == nil {
			rerr = attach(rfd, f.mp)
			unix.Close(rfd)
			if rerr != nil {
				f.log.Error("kernelpath: remount of the previous stack failed", "mount", f.id, "err", rerr)
			}
		}
	}
	return err
}

// switchIoctl: UNTESTED ON THIS HOST (see ioctl_linux.go).
func (f *FS) switchIoctl(upper string) error {
	fd, err := unix.Open(f.mp, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(fd)
	s := f.stackFor(f.layers, upper)
	gen, err := ioctlSwitch(fd, f.gen, s.lowers, s.upper, s.work)
	if err != nil {
		return err
	}
	f.gen = gen
	return nil
}

// pruneWork removes work dirs of uppers older than the previous one.
func (f *FS) pruneWork(prev, cur string) {
	ms, _ := filepath.Glob(filepath.Join(f.st.WorkDir(), "kp-"+f.id+"-*"))
	for _, m := range ms {
		if m != f.workFor(prev) && m != f.workFor(cur) {
			_ = os.RemoveAll(m)
		}
	}
}

// Depth returns the number of frozen store layers a switch to the latest
// checkpoint would stack under its upper: the layers the view was mounted
// from or switched to plus the delta chain frozen since. Every restore
// starts a new chain on top of the target's stack, so without Compact the
// depth grows with the restores (towards overlayfs's limit of 500 lower
// layers), and a create in a directory merged from the lower layers costs
// more with every layer (negative lookups in each).
func (f *FS) Depth() int {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	return len(f.layers) + len(f.chain)
}

// Compact merges runs of frozen layers into single layers without changing
// any checkpoint's content. See compact_linux.go.
func (f *FS) Compact() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	if f.closed {
		return fmt.Errorf("compact %s: unmounted", f.id)
	}
	return f.compactLocked()
}

// lowerStat finds path p in the frozen layers and base dirs, topmost first
// (approximate: redirects and opaque dirs are not followed; for effects
// only). All lookups are beneath a layer root without following symlinks.
func (f *FS) lowerStat(p string) (entryFP, bool) {
	dirs := make([]string, 0, len(f.layers)+len(f.lowers))
	for i := len(f.layers) - 1; i >= 0; i-- {
		dirs = append(dirs, f.st.LayerPath(f.layers[i]))
	}
	dirs = append(dirs, f.lowers...)
	for _, d := range dirs {
		root, err := unix.Open(d, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			continue
		}
		fd, err := unix.Openat2(root, p, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
		})
		unix.Close(root)
		if err != nil {
			continue
		}
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		unix.Close(fd)
		if err != nil {
			continue
		}
		e := fpOf(&st)
		if e.isWhiteout() {
			return entryFP{}, false
		}
		return e, true
	}
	return entryFP{}, false
}

func sameFP(a, b map[string]entryFP) bool {
	if len(a) != len(b) {
		return false
	}
	for p, x := range a {
		y, ok := b[p]
		if ok && x.isWhiteout() && y.isWhiteout() {
			continue
		}
		if !ok || x.mode != y.mode || x.size != y.size || x.mtime != y.mtime || x.ctime != y.ctime {
			return false
		}
	}
	return true
}

// Unmount unmounts the view (lazily if busy) and releases the mount's
// record; the upper is freed by the store's next GC.
func (f *FS) Unmount() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	f.settle()
	if f.closed {
		return nil
	}
	defer f.syncWG.Wait()
	defer f.teardown.Wait()
	defer f.stopTracking()
	defer f.pool.close()
	if cur := mountID(f.mp); f.mntID != 0 && cur != f.mntID {
		// Our overlay is no longer there (detached as stale, or replaced by
		// a newer mount of the same id): never unmount someone else's.
		f.log.Warn("kernelpath: view already gone from the mount point; not unmounting", "mountpoint", f.mp)
		f.closed = true
		if rec, err := f.st.Mount(f.id); err == nil && rec.Upper != f.upper {
			cleanupWork(f.st, f.id, f.workFor(rec.Upper)) // the newer mount's stays
		} else {
			cleanupWork(f.st, f.id, "")
			_ = f.st.RemoveMount(f.id)
		}
		return nil
	}
	if err := unix.Unmount(f.mp, 0); err != nil {
		if !errors.Is(err, unix.EBUSY) {
			return fmt.Errorf("unmount %s: %w", f.mp, err)
		}
		f.log.Info("kernelpath: mount busy, detaching lazily", "mountpoint", f.mp)
		if err := unix.Unmount(f.mp, unix.MNT_DETACH); err != nil {
			return fmt.Errorf("unmount %s: %w", f.mp, err)
		}
	}
	f.closed = true
	cleanupWork(f.st, f.id, "")
	if err := f.st.RemoveMount(f.id); err != nil {
		return fmt.Errorf("unmount %s: %w", f.mp, err)
	}
	return nil
}

func sameStrings(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if strings.TrimRight(a[i], "/") != strings.TrimRight(b[i], "/") {
			return false
		}
	}
	return true
}
