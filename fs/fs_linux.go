package fs

import (
	"context"
	"errors"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	gofs "github.com/hanwen/go-fuse/v2/fs"
	"github.com/hanwen/go-fuse/v2/fuse"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/layer"
)

// Options configure a mount.
type Options struct {
	// MountID names the mount in the store; "" picks a random id. If a
	// record for MountID exists and its process is dead (a crash), the
	// mount resumes from it: same frozen layers, same upper.
	MountID string
	// From is a checkpoint id to start from (a fork); "" starts empty over
	// Lowers.
	From string
	// Lowers are read-only base directories, topmost first (like
	// overlayfs's lowerdir). Ignored when From is set (the checkpoint
	// records its lowers).
	Lowers []string
	// LowerCache, if set, is shared with other mounts over the same
	// lowers: the directory listings one reads serve them all, each
	// checked against its directory's ctime at most once a second (see
	// LowerCache). Entry stats stay the mount's own, as before.
	LowerCache *LowerCache
	// CacheTimeout is the kernel entry/attr/negative cache timeout; 0 means
	// one hour (correctness comes from explicit invalidation).
	CacheTimeout time.Duration
	// SyncCheckpoint makes Checkpoint fsync its record before returning.
	// By default the record is renamed into place (safe against a crash of
	// the process) and fsynced in the background right after (safe against
	// power loss a few milliseconds later), keeping the fsync out of the
	// checkpoint's latency.
	SyncCheckpoint bool
	// NoDurable skips fsyncing checkpoint records altogether (tests).
	NoDurable bool
	// Passthrough turns FUSE passthrough on (experimental). With it, files
	// whose data is in the writable upper are read and written by the
	// kernel directly; checkpoints and switches move such a file's live
	// inode into the new upper (copying its content into the frozen layer,
	// resp. the target's content into it), so open descriptors behave as
	// without passthrough at a cost proportional to those files' size.
	Passthrough bool
	// PassthroughLower (with Passthrough) also passes read-only opens of
	// files in frozen and lower layers through to the layer's file, so
	// reading a checkpointed or base-image file costs no daemon round
	// trip and shares the host's page cache across mounts (forks). Such a
	// descriptor keeps reading the content it was opened on, as on
	// overlayfs: a copy-up of the file (a write or metadata change
	// through another descriptor or path) and a switch that changes the
	// file do not reach it; new opens see the current view.
	PassthroughLower bool
	// NoOpen keeps OPEN, RELEASE and FLUSH off the wire (FUSE's no_open
	// mode): the kernel opens and closes regular files without a round
	// trip and the daemon serves their reads and writes through per-node
	// handles it opens on the first request (see noopen_linux.go). A
	// program that opens a few dozen files (a shell command starting up
	// over a fresh mount) costs two requests less per file. Copy-up
	// happens at a file's first write rather than at an open for
	// writing. Ignored with Passthrough, which needs the open.
	NoOpen bool
	// MaxIO is the largest READ and WRITE request the mount negotiates
	// and its kernel readahead window, in bytes; 0 means DefaultMaxIO.
	// go-fuse keeps a request buffer of this size per reader goroutine
	// and reads ahead this much of a file on a cold page cache, both per
	// mount: a smaller value costs more round trips on large sequential
	// I/O and less memory and CPU per mount (fork children, many at once,
	// each reading its base image into a page cache of its own). Values
	// under 64 KiB are raised to it; others are rounded down to whole
	// pages.
	MaxIO int
	// Debug logs every FUSE request.
	Debug bool
	// Logger receives diagnostics; nil means slog.Default().
	Logger *slog.Logger
	// UnmountGrace is how long Unmount waits, after the unmount, for the
	// FUSE connection to end before it aborts it; 0 means
	// DefaultUnmountGrace. The connection outlives the unmount while a
	// process blocks on a request, has the file system open, or lives in
	// a mount namespace holding a copy of the mount — and any process on
	// the host that makes a mount namespace (unshare, a container start)
	// copies every mount there is, this one included, and keeps it until
	// that namespace ends. A caller that knows no process of its own uses
	// the mount any more (the daemon, once a sandbox's processes are dead)
	// sets it short.
	UnmountGrace time.Duration
}

// DefaultUnmountGrace is the default of Options.UnmountGrace: time for
// requests in flight to be answered and for clients to close their files.
const DefaultUnmountGrace = 20 * time.Second

// FS is a mounted DeltaFS view. It implements layer.FS.
type FS struct {
	store      *layer.Store
	id         string
	mountpoint string
	opts       Options
	log        *slog.Logger

	server *fuse.Server
	root   *node
	reg    layers

	// mu is the write barrier: every request holds it shared; Checkpoint
	// and Switch hold it exclusively while they swap the stack.
	mu  sync.RWMutex
	st  *stack        // guarded by mu
	gen atomic.Uint64 // bumped by every checkpoint and switch
	// viewGen is bumped by switches only (content changes).
	viewGen atomic.Uint64

	// ns serialises namespace mutations and copy-ups (exclusive) against
	// resolutions (shared).
	ns sync.RWMutex

	// dirty is set when the upper receives anything.
	dirty atomic.Bool

	inoMu   sync.Mutex
	inos    map[inoKey]uint64
	nextIno uint64
	// inoGone are layers the registry forgot whose inos keys are still
	// to be dropped (dropInos; the background worker only).
	inoGone []*layerDir
	nodes   map[uint64]*node
	// inoGen is the generation of the newest node of an inode number,
	// for numbers whose node was replaced while pinned (node.ptLower).
	inoGen map[uint64]uint64

	spareMu sync.Mutex
	spare   string // a pre-created empty store layer for the next upper
	// spareKick asks the spare worker to pre-create the next upper; it
	// holds at most one request. The spare worker runs apart from bg, so
	// that the next checkpoint finds its upper ready even while bg is
	// still fsyncing the previous ones.
	spareKick chan struct{}
	spareDone chan struct{}

	// recSeq numbers snapshots of the mount record in the order of the
	// state they describe; recMu serialises writing them, and recDone
	// (guarded by recMu) is the newest one written, so that an older
	// snapshot never replaces a newer one.
	recSeq  atomic.Uint64
	recMu   sync.Mutex
	recDone uint64

	// pending holds this mount's checkpoints whose record file the
	// background worker has not written yet (Switch reads them here, not
	// from the journal).
	pendMu  sync.Mutex
	pending map[string]layer.Checkpoint

	journal *layer.Journal
	// bg runs record materialization, journal syncs, spare creation and
	// mount-record updates in order, off the critical paths.
	bg     chan func()
	bgDone chan struct{}

	effMu sync.Mutex
	eff   effect.FS

	reads, writes atomic.Uint64 // READ/WRITE requests served by the daemon
	ops           opCounts      // every request, by opcode

	ptMu    sync.Mutex
	ptNodes map[*node]struct{} // nodes with passthrough handles open
	rel     releases           // RELEASE requests in flight

	implMu    sync.Mutex
	implNodes map[*node]struct{} // nodes holding implicit handles (Options.NoOpen)
	upper     atomic.Pointer[layerDir]

	// afterCreate, when set (by tests), runs when a Create handler has
	// released f.mu but before go-fuse attaches the new node to its
	// parent.
	afterCreate atomic.Pointer[func()]

	unmountOnce sync.Once
	unmountErr  error
	// dev is the mount's device number: its FUSE connection's id (minor)
	// in fusectl, to abort a connection whose requests never finish.
	dev uint64
}

type inoKey struct {
	l   *layerDir
	ino uint64
}

var _ layer.FS = (*FS)(nil)

// Mount mounts a view of store at mountpoint and starts serving it. It
// returns once the mount is ready.
func Mount(store *layer.Store, mountpoint string, opts Options) (*FS, error) {
	mp, err := filepath.Abs(mountpoint)
	if err != nil {
		return nil, fmt.Errorf("mount %s: %w", mountpoint, err)
	}
	if opts.MountID == "" {
		opts.MountID = layer.NewID()
	}
	if !layer.ValidID(opts.MountID) {
		return nil, fmt.Errorf("mount %s: invalid mount id %q", mp, opts.MountID)
	}
	if opts.CacheTimeout == 0 {
		opts.CacheTimeout = time.Hour
	}
	lg := opts.Logger
	if lg == nil {
		lg = slog.Default()
	}
	f := &FS{
		store: store, id: opts.MountID, mountpoint: mp, opts: opts, log: lg,
		reg:     layers{byID: map[string]*layerDir{}, lowers: opts.LowerCache},
		inos:    map[inoKey]uint64{},
		nextIno: 2,
		nodes:   map[uint64]*node{},
		inoGen:  map[uint64]uint64{},
		ptNodes: map[*node]struct{}{},
		rel:     releases{m: map[<-chan struct{}]*node{}},

		implNodes: map[*node]struct{}{},
	}
	st, err := f.initialStack()
	if err != nil {
		f.reg.closeAll()
		return nil, fmt.Errorf("mount %s: %w", mp, err)
	}
	f.setStack(st)
	f.gen.Store(1)
	// A resumed upper may hold a crashed session's changes.
	f.dirty.Store(!dirEmpty(st.upper.path))
	if f.journal, err = store.OpenJournal(f.id); err != nil {
		f.reg.closeAll()
		return nil, fmt.Errorf("mount %s: %w", mp, err)
	}
	if err := f.journal.Append(f.entry("mount", layer.Checkpoint{ID: st.base})); err != nil {
		f.journal.Close()
		f.reg.closeAll()
		return nil, fmt.Errorf("mount %s: %w", mp, err)
	}
	if err := f.saveMount(true); err != nil {
		f.journal.Close()
		f.reg.closeAll()
		return nil, fmt.Errorf("mount %s: %w", mp, err)
	}
	f.bg = make(chan func(), 1024)
	f.bgDone = make(chan struct{})
	go func() {
		defer close(f.bgDone)
		for fn := range f.bg {
			fn()
		}
	}()
	f.spareKick = make(chan struct{}, 1)
	f.spareDone = make(chan struct{})
	go func() {
		defer close(f.spareDone)
		for range f.spareKick {
			f.refillSpare()
		}
	}()
	f.root = &node{f: f}
	f.root.srcs = rootSrcs(st)
	f.root.gen = 1
	f.nodes[1] = f.root
	to := opts.CacheTimeout
	maxIO := opts.maxIO()
	fo := &gofs.Options{
		EntryTimeout:    &to,
		AttrTimeout:     &to,
		NegativeTimeout: &to,
		NullPermissions: true,
		RootStableAttr:  &gofs.StableAttr{Ino: 1},
		MountOptions: fuse.MountOptions{
			AllowOther:           true,
			DirectMount:          true,
			DirectMountStrict:    true, // never fusermount (see mountCounting)
			FsName:               "rewind:" + f.id,
			Name:                 "rewind",
			Options:              []string{"default_permissions", "suid", "dev"},
			MaxWrite:             maxIO,
			MaxReadAhead:         maxIO,
			EnableSymlinkCaching: true,
			// Reads are answered from buffers, never from an fd: with
			// splice on, go-fuse still fills a pipe with each READ
			// reply's header before falling back to a plain write (two
			// wasted system calls per READ), and for a 1 MiB READ it
			// cannot even grow the pipe (pipe-max-size without
			// CAP_SYS_RESOURCE) and logs a line per request.
			DisableSplice: true,
			Debug:         opts.Debug,
			// The kernel then asks for security.capability once per
			// inode instead of before every write(2) (SB_NOSEC), and
			// leaves dropping setuid/setgid bits to us (see Setattr).
			ExtraCapabilities: fuse.CAP_HANDLE_KILLPRIV_V2,
		},
	}
	srv, err := mountCounting(mp, f.root, fo, &f.ops, &f.rel, f.noOpen())
	if err != nil {
		close(f.bg)
		<-f.bgDone
		close(f.spareKick)
		<-f.spareDone
		f.journal.Close()
		_ = store.RemoveMount(f.id)
		f.reg.closeAll()
		return nil, fmt.Errorf("mount %s: %w", mp, err)
	}
	f.server = srv
	var mst unix.Stat_t
	if unix.Stat(mp, &mst) == nil {
		f.dev = mst.Dev
		if err := setReadahead(f.dev, maxIO); err != nil {
			f.log.Warn("mount: kernel readahead stays at its default", "mount", mp, "err", err)
		}
		// WaitIdle and Unmount's abort read and write the connection's
		// files in fusectl, which a fresh machine may not have mounted.
		if _, err := os.Stat(connFile(f.dev, "waiting")); err != nil {
			f.log.Warn("mount: no fusectl entry for the connection: WaitIdle cannot wait for write-back", "mount", mp, "err", err)
		}
	}
	f.kickSpare()
	return f, nil
}

func rootSrcs(st *stack) []src {
	s := make([]src, len(st.top))
	for i, l := range st.top {
		s[i] = src{l, "."}
	}
	return s
}

// initialStack builds the first stack: resume a crashed mount, start from a
// checkpoint, or start empty over the lowers.
func (f *FS) initialStack() (*stack, error) {
	if rec, err := f.store.Mount(f.id); err == nil {
		if layer.ProcessAlive(rec.PID) && rec.PID != os.Getpid() {
			return nil, fmt.Errorf("mount id %s is in use by pid %d", f.id, rec.PID)
		}
		if f.opts.From == "" {
			// The journal is ahead of the (lazily written) record.
			if js, err := f.store.JournalEntries(f.id); err == nil && len(js) > 0 {
				last := js[len(js)-1]
				return f.buildStack(last.Checkpoint.Lowers, last.Checkpoint.Layers, last.Upper, last.Checkpoint.ID)
			}
			return f.buildStack(rec.Lowers, rec.Layers, rec.Upper, rec.Base)
		}
		// Starting anew from a checkpoint replaces the crashed record.
	}
	if f.opts.From != "" {
		cp, err := f.store.Checkpoint(f.opts.From)
		if err != nil {
			return nil, err
		}
		up, err := f.store.NewLayer(cp.ID)
		if err != nil {
			return nil, err
		}
		return f.freshStack(cp.Lowers, cp.Layers, up, cp.ID)
	}
	var lowers []string
	for _, l := range f.opts.Lowers {
		a, err := filepath.Abs(l)
		if err != nil {
			return nil, err
		}
		if st, err := os.Stat(a); err != nil {
			return nil, fmt.Errorf("lower %s: %w", l, err)
		} else if !st.IsDir() {
			return nil, fmt.Errorf("lower %s: not a directory", l)
		}
		lowers = append(lowers, a)
	}
	up, err := f.store.NewLayer("")
	if err != nil {
		return nil, err
	}
	return f.freshStack(lowers, nil, up, "")
}

// freshStack is buildStack for a new, empty upper: it takes the root
// attributes of the layers below (inheritRootMeta).
func (f *FS) freshStack(lowers, frozen []string, upper, base string) (*stack, error) {
	st, err := f.buildStack(lowers, frozen, upper, base)
	if err != nil {
		return nil, err
	}
	if err := inheritRootMeta(st); err != nil {
		return nil, err
	}
	return st, nil
}

// buildStack opens the layers of a stack. The stack holds a reference on
// each of them (see layers): the caller makes it the current stack
// (setStack) or releases them (f.reg.release(st.top...)).
func (f *FS) buildStack(lowers, frozen []string, upper, base string) (_ *stack, err error) {
	var fl, ll []*layerDir
	defer func() {
		if err != nil {
			f.reg.release(fl...)
			f.reg.release(ll...)
		}
	}()
	for _, id := range frozen {
		if !f.reg.has(id) {
			if err := f.store.CheckLayer(id); err != nil {
				return nil, err
			}
		}
		l, err := f.reg.open(id, f.store.LayerPath(id))
		if err != nil {
			return nil, err
		}
		fl = append(fl, l)
	}
	for _, p := range lowers {
		l, err := f.reg.open("", p)
		if err != nil {
			return nil, err
		}
		ll = append(ll, l)
	}
	if err := f.store.CheckLayer(upper); err != nil {
		return nil, err
	}
	ul, err := f.reg.open(upper, f.store.LayerPath(upper))
	if err != nil {
		return nil, err
	}
	return newStack(ul, fl, ll, base), nil
}

// setStack makes next the current stack and releases the references of
// the stack it replaces: a layer next does not have closes its descriptor
// unless someone else holds it. next holds its own references (see
// buildStack). The caller holds f.mu exclusively, so no request is using
// the old stack; requests after it see next (a node resolved against the
// old stack is resolved again first, as the caller bumps f.gen whenever
// layers change).
func (f *FS) setStack(next *stack) {
	old := f.st
	f.st = next
	f.upper.Store(next.upper)
	if old != nil {
		f.reg.release(old.top...)
	}
}

// entry describes the current stack (caller holds f.mu) as a journal entry.
func (f *FS) entry(op string, cp layer.Checkpoint) layer.JournalEntry {
	st := f.st
	cp.Layers = st.frozenIDs()
	cp.Lowers = st.lowerPaths()
	if cp.Mount == "" {
		cp.Mount = f.id
	}
	return layer.JournalEntry{Op: op, Checkpoint: cp, Upper: st.upper.id}
}

// saveMount writes the mount record; the caller holds f.mu (any mode).
func (f *FS) saveMount(durable bool) error {
	m, seq := f.mountRecord()
	return f.writeMountRecord(m, seq, durable)
}

// mountRecord snapshots the mount record; the caller holds f.mu (any
// mode), which orders the snapshot after every stack change it sees.
func (f *FS) mountRecord() (layer.MountRecord, uint64) {
	st := f.st
	f.spareMu.Lock()
	spare := f.spare
	seq := f.recSeq.Add(1)
	f.spareMu.Unlock()
	return layer.MountRecord{
		ID: f.id, PID: os.Getpid(), Mountpoint: f.mountpoint,
		Lowers: st.lowerPaths(), Layers: st.frozenIDs(), Upper: st.upper.id, Base: st.base, Spare: spare,
	}, seq
}

// writeMountRecord writes snapshot seq of the mount record unless a newer
// one is written already.
func (f *FS) writeMountRecord(m layer.MountRecord, seq uint64, durable bool) error {
	f.recMu.Lock()
	defer f.recMu.Unlock()
	if seq < f.recDone {
		return nil
	}
	if err := f.store.SaveMount(m, durable); err != nil {
		return err
	}
	f.recDone = seq
	return nil
}

// saveMountBG records the mount in the background. It holds f.mu only to
// take the snapshot, so that the write barrier of the next checkpoint does
// not wait for the file system.
func (f *FS) saveMountBG() {
	f.mu.RLock()
	m, seq := f.mountRecord()
	f.mu.RUnlock()
	if err := f.writeMountRecord(m, seq, false); err != nil {
		f.log.Warn("save mount record", "err", err)
	}
}

// kickSpare asks the spare worker to pre-create the next upper.
func (f *FS) kickSpare() {
	select {
	case f.spareKick <- struct{}{}:
	default: // a request is pending already
	}
}

// refillSpare pre-creates the next upper (runs on the spare worker) and
// records it in the mount record so GC never frees it.
func (f *FS) refillSpare() {
	f.spareMu.Lock()
	have := f.spare != ""
	f.spareMu.Unlock()
	if !have {
		id, err := f.store.NewLayer("")
		if err != nil {
			f.log.Warn("pre-create upper layer", "err", err)
			return
		}
		f.spareMu.Lock()
		extra := f.spare != "" // a switch gave back the one it took meanwhile
		if !extra {
			f.spare = id
		}
		f.spareMu.Unlock()
		if extra {
			_ = os.RemoveAll(f.store.LayerPath(id))
			_ = os.Remove(filepath.Join(f.store.Dir(), "meta/layers", id+".json"))
		}
	}
	f.saveMountBG()
}

// putSpare gives back spare upper id, taken but not used.
func (f *FS) putSpare(id string) {
	f.spareMu.Lock()
	defer f.spareMu.Unlock()
	if f.spare == "" {
		f.spare = id
	}
}

// upperReusable reports whether a switch may keep the current upper as the
// new view's: nothing was written to it since it was pushed (so it is an
// empty directory), and no passthrough file was moved into it. The caller
// holds f.mu (any mode).
func (f *FS) upperReusable() bool {
	return !f.opts.Passthrough && !f.dirty.Load()
}

// dirEmpty reports whether directory p has no entries (false if it cannot
// be read).
func dirEmpty(p string) bool {
	d, err := os.Open(p)
	if err != nil {
		return false
	}
	defer d.Close()
	names, err := d.Readdirnames(1)
	return len(names) == 0 && err == io.EOF
}

func (f *FS) takeSpare() (string, error) {
	f.spareMu.Lock()
	id := f.spare
	f.spare = ""
	f.spareMu.Unlock()
	if id != "" {
		return id, nil
	}
	return f.store.NewLayer("")
}

// MountID implements layer.FS.
func (f *FS) MountID() string { return f.id }

// Mountpoint implements layer.FS.
func (f *FS) Mountpoint() string { return f.mountpoint }

// Store returns the store the mount lives in.
func (f *FS) Store() *layer.Store { return f.store }

// Wait blocks until the file system is unmounted.
func (f *FS) Wait() { f.server.Wait() }

// Base returns the checkpoint the view was last checkpointed or switched to.
func (f *FS) Base() string {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return f.st.base
}

// upperNow is the current upper layer (readable without f.mu).
func (f *FS) upperNow() *layerDir { return f.upper.Load() }

// Requests returns how many READ and WRITE requests reached the daemon
// (reads served by passthrough never do).
func (f *FS) Requests() (reads, writes uint64) { return f.reads.Load(), f.writes.Load() }

// Depth returns the number of frozen store layers under the upper.
func (f *FS) Depth() int {
	f.mu.RLock()
	defer f.mu.RUnlock()
	return len(f.st.frozen)
}

// Checkpoint implements layer.FS: a short write barrier, the upper is
// frozen as a new layer, a fresh empty upper is pushed. No data is copied
// and no tree is walked.
func (f *FS) Checkpoint() (string, error) {
	id := layer.NewID()
	f.mu.Lock()
	old := f.st
	frozen := old.frozen
	var next *stack
	if f.dirty.Load() {
		upID, err := f.takeSpare()
		if err != nil {
			f.mu.Unlock()
			return "", fmt.Errorf("checkpoint: %w", err)
		}
		ul, err := f.reg.open(upID, f.store.LayerPath(upID))
		if err != nil {
			f.mu.Unlock()
			return "", fmt.Errorf("checkpoint: %w", err)
		}
		frozen = append(append([]*layerDir(nil), old.frozen...), old.upper)
		next = newStack(ul, frozen, old.lowers, id)
		// next's references: ul's from open, its own on the layers it
		// shares with old.
		f.reg.ref(next.top[1:]...)
		err = inheritRootMeta(next)
		if err == nil {
			err = f.swapPassthrough(old, next)
		}
		if err != nil {
			f.reg.release(next.top...)
			f.spareMu.Lock()
			if f.spare == "" {
				f.spare = upID
			}
			f.spareMu.Unlock()
			f.mu.Unlock()
			return "", fmt.Errorf("checkpoint: %w", err)
		}
	} else {
		// Nothing changed since the last checkpoint: a new id for the
		// same stack, no layer pushed.
		next = newStack(old.upper, frozen, old.lowers, id)
		f.reg.ref(next.top...)
	}
	cp := layer.Checkpoint{
		ID: id, Mount: f.id, Parent: old.base, Created: time.Now().UTC(),
		Lowers: next.lowerPaths(), Layers: next.frozenIDs(),
	}
	// The journal append (one write to an O_APPEND file) is the commit
	// point; the per-checkpoint record file is written in the background.
	err := f.journal.Append(layer.JournalEntry{Op: "checkpoint", Checkpoint: cp, Upper: next.upper.id})
	if err == nil && f.opts.SyncCheckpoint {
		err = f.journal.Sync()
	}
	if err != nil {
		if next.upper != old.upper {
			// Keep the unused layer as the spare.
			f.spareMu.Lock()
			if f.spare == "" {
				f.spare = next.upper.id
			}
			f.spareMu.Unlock()
		}
		f.reg.release(next.top...)
		f.mu.Unlock()
		return "", fmt.Errorf("checkpoint: %w", err)
	}
	f.pendMu.Lock()
	if f.pending == nil {
		f.pending = map[string]layer.Checkpoint{}
	}
	f.pending[id] = cp
	f.pendMu.Unlock()
	f.setStack(next)
	pushed := next.upper != old.upper
	if pushed {
		f.dirty.Store(f.hasPassthroughWriters())
		f.gen.Add(1)
	}
	f.mu.Unlock()
	if pushed {
		f.kickSpare()
	}
	f.bg <- func() {
		if !f.opts.NoDurable {
			_ = f.journal.Sync()
		}
		// Never over a tombstone: the checkpoint may be deleted already.
		if err := f.store.MaterializeCheckpoint(cp, !f.opts.NoDurable); err != nil {
			f.log.Warn("materialize checkpoint record", "id", id, "err", err)
		} else {
			f.pendMu.Lock()
			delete(f.pending, id)
			f.pendMu.Unlock()
		}
		f.saveMountBG()
		if pushed {
			// The layer just frozen is walked now, not by the first
			// switch into or out of it (a tree search's next restore).
			_, _ = old.upper.touchedPaths()
		}
	}
	return id, nil
}

// Switch implements layer.FS: the view becomes checkpoint id's content plus
// a fresh empty upper. Only the entries that differ are invalidated in the
// kernel. The current upper's un-checkpointed changes are discarded.
func (f *FS) Switch(id string) error {
	f.pendMu.Lock()
	pc, pending := f.pending[id]
	f.pendMu.Unlock()
	var cp layer.Checkpoint
	var err error
	if pending {
		cp, err = f.store.CheckpointPending(pc)
	} else {
		cp, err = f.store.Checkpoint(id)
	}
	if err != nil {
		return fmt.Errorf("switch: %w", err)
	}
	if cp.Mount != f.id {
		return fmt.Errorf("switch to %s: checkpoint belongs to mount %s, not %s (fork a new mount from it instead)", id, cp.Mount, f.id)
	}
	// An upper that received nothing since the last checkpoint or switch
	// is empty: the new view keeps it (no spare taken, nothing to remove).
	f.mu.RLock()
	keep := f.upperReusable()
	upID := f.st.upper.id
	f.mu.RUnlock()
	if !keep {
		if upID, err = f.takeSpare(); err != nil {
			return fmt.Errorf("switch to %s: %w", id, err)
		}
	}
	next, err := f.buildStack(cp.Lowers, cp.Layers, upID, cp.ID)
	if err != nil {
		if !keep {
			f.putSpare(upID)
		}
		return fmt.Errorf("switch to %s: %w", id, err)
	}
	f.mu.Lock()
	old := f.st
	if keep && (next.upper != old.upper || !f.upperReusable()) {
		// Written to or checkpointed meanwhile: a fresh upper after all.
		keep = false
		if upID, err = f.takeSpare(); err == nil {
			if err = f.store.CheckLayer(upID); err == nil {
				var ul *layerDir
				if ul, err = f.reg.open(upID, f.store.LayerPath(upID)); err == nil {
					f.reg.release(next.upper)
					next = newStack(ul, next.frozen, next.lowers, next.base)
				}
			}
			if err != nil {
				f.putSpare(upID)
			}
		}
		if err != nil {
			f.mu.Unlock()
			f.reg.release(next.top...)
			return fmt.Errorf("switch to %s: %w", id, err)
		}
	}
	if err := inheritRootMeta(next); err != nil {
		f.mu.Unlock()
		f.reg.release(next.top...)
		if !keep {
			f.putSpare(upID)
		}
		return fmt.Errorf("switch to %s: %w", id, err)
	}
	// The delta: layers above the common ancestor on both sides, plus the
	// current upper.
	k := 0
	for k < len(old.frozen) && k < len(next.frozen) && old.frozen[k] == next.frozen[k] {
		k++
	}
	sameLowers := len(old.lowers) == len(next.lowers)
	for i := 0; sameLowers && i < len(old.lowers); i++ {
		sameLowers = old.lowers[i] == next.lowers[i]
	}
	var delta []*layerDir
	delta = append(delta, old.frozen[k:]...)
	delta = append(delta, next.frozen[k:]...)
	// A kept upper received nothing: it is empty, and no walk is needed.
	upper := old.upper
	if keep {
		upper = nil
	}
	touched, terr := touchedPaths(upper, delta)
	f.retargetPassthrough(old, next)
	if err := f.journal.Append(layer.JournalEntry{Op: "switch", Checkpoint: cp, Upper: next.upper.id}); err != nil {
		f.mu.Unlock()
		f.reg.release(next.top...)
		if !keep {
			f.putSpare(upID)
		}
		return fmt.Errorf("switch to %s: %w", id, err)
	}
	// The layers the switch leaves lose the old stack's references: their
	// descriptors close (they stay registered, idle, for a switch back).
	f.setStack(next)
	f.gen.Add(1)
	f.viewGen.Add(1)
	f.dirty.Store(f.hasPassthroughWriters())
	f.mu.Unlock()
	if keep {
		f.bg <- func() {
			f.saveMountBG()
			f.dropInos(f.reg.prune())
		}
	} else {
		// Discard the old upper (nothing references it any more).
		gone := old.upper
		forgot := f.reg.forget(gone)
		oldUpper := gone.id
		f.kickSpare()
		f.bg <- func() {
			// The mount record names the new upper before the old one goes.
			f.saveMountBG()
			tmp := filepath.Join(f.store.WorkDir(), "gc-"+oldUpper)
			if os.Rename(f.store.LayerPath(oldUpper), tmp) == nil {
				_ = os.RemoveAll(tmp)
				_ = os.Remove(filepath.Join(f.store.Dir(), "meta/layers", oldUpper+".json"))
			}
			dropped := f.reg.prune()
			if forgot {
				dropped = append(dropped, gone)
			}
			f.dropInos(dropped)
		}
	}
	if terr != nil || !sameLowers {
		f.invalidateAll()
		return nil
	}
	if keep && len(delta) == 0 {
		// The same layers and the kept (empty) upper: the view did not
		// change, and the kernel's caches (the root's attributes among
		// them) hold. A tree search returning to the node it just left
		// through a turn that changed nothing lands here.
		return nil
	}
	f.invalidate(touched)
	return nil
}

// touchedPaths lists the relative paths present in upper (if not nil) and
// in the frozen layers (a frozen layer never changes, so its walk is done
// once); the value is true for a path whose subtree may come from
// elsewhere on one side (a whiteout, an opaque or a redirected directory).
func touchedPaths(upper *layerDir, frozen []*layerDir) (map[string]bool, error) {
	t := map[string]bool{}
	if upper != nil {
		if err := walkTouched(upper, t); err != nil {
			return nil, err
		}
	}
	for _, l := range frozen {
		lt, err := l.touchedPaths()
		if err != nil {
			return nil, err
		}
		for p, special := range lt {
			t[p] = t[p] || special
		}
	}
	return t, nil
}

// touchedPaths returns the paths frozen layer l holds, walked on first use
// (a failed walk is tried again next time). The map is shared: read only.
func (l *layerDir) touchedPaths() (map[string]bool, error) {
	l.touchedMu.Lock()
	defer l.touchedMu.Unlock()
	if l.touched == nil {
		t := map[string]bool{}
		if err := walkTouched(l, t); err != nil {
			return nil, err
		}
		l.touched = t
	}
	return l.touched, nil
}

// walkTouched adds the paths layer l holds to t, each marked special when
// it is an opaque or redirected directory or a whiteout.
func walkTouched(l *layerDir, t map[string]bool) error {
	return layer.Walk(l.path, func(rel string, d os.DirEntry) error {
		special := false
		switch {
		case d.IsDir():
			hp := l.path + "/" + rel
			special = layer.IsOpaque(hp) || layer.Redirect(hp) != ""
		case d.Type()&os.ModeCharDevice != 0:
			var st unix.Stat_t
			special = unix.Lstat(l.path+"/"+rel, &st) == nil && layer.IsWhiteout(&st)
		}
		t[rel] = t[rel] || special
		return nil
	})
}

// invalidate drops the kernel's cached entries and attributes for the
// given view paths. It must be called without f.mu held.
//
// A directory whose entry is dropped and that the new view no longer has
// takes its subtree with it: the kernel prunes the dentries below it
// (d_invalidate), and the node leaves the tree, so a later lookup of the
// name gets a new node rather than splicing the old dentry (and whatever
// is still held below it) back in. The paths below it need no
// notification of their own. A tree search switching away from a branch
// that installed a package skipped hundreds that way.
func (f *FS) invalidate(paths map[string]bool) {
	type inval struct {
		path    string
		parent  *gofs.Inode
		name    string
		child   *gofs.Inode
		special bool
	}
	var list []inval
	rootIn := f.root.EmbeddedInode()
	for p, special := range paths {
		dir, name := filepath.Split(p)
		parent := rootIn
		for _, c := range splitPath(dir) {
			if parent = parent.GetChild(c); parent == nil {
				break
			}
		}
		if parent == nil {
			continue
		}
		list = append(list, inval{p, parent, name, parent.GetChild(name), special})
	}
	// A directory before what it holds: a path sorts before every path
	// it is a prefix of.
	slices.SortFunc(list, func(a, b inval) int { return strings.Compare(a.path, b.path) })
	gone := map[string]bool{} // dropped directories the new view lacks
	// The root's attributes (mtime, nlink) may differ too.
	_ = rootIn.NotifyContent(0, 0)
	for _, iv := range list {
		if len(gone) > 0 && underAny(iv.path, gone) {
			continue
		}
		var cn *node
		if iv.child != nil {
			cn, _ = iv.child.Operations().(*node)
		}
		if cn != nil && iv.child.IsDir() && !iv.special && !cn.isUnlinked() && f.stillDir(iv.child) {
			// Same directory on both sides, and the kernel's dentry is
			// this node: keep it (it may be a cwd or a mount point) and
			// refresh its attributes and listing only.
			_ = iv.child.NotifyContent(0, 0)
			continue
		}
		if cn != nil {
			// Before the notification, so a lookup racing with it and
			// handing the node out again wins.
			cn.setUnlinked(true)
		}
		_ = iv.parent.NotifyEntry(iv.name)
		if iv.child != nil {
			_ = iv.child.NotifyContent(0, 0)
		}
		if cn != nil && iv.child.IsDir() && f.goneFromView(cn) {
			iv.parent.RmChild(iv.name)
			gone[iv.path] = true
		}
	}
}

// underAny reports whether a directory above path p is in dirs.
func underAny(p string, dirs map[string]bool) bool {
	for i := strings.LastIndexByte(p, '/'); i > 0; i = strings.LastIndexByte(p[:i], '/') {
		if dirs[p[:i]] {
			return true
		}
	}
	return false
}

// goneFromView reports whether node n has no entry in the current view
// (or one of another type).
func (f *FS) goneFromView(n *node) bool {
	f.mu.RLock()
	defer f.mu.RUnlock()
	f.ns.RLock()
	defer f.ns.RUnlock()
	return n.resolve(f.st, f.gen.Load()) != 0
}

// stillDir reports whether directory node in resolves to a plain directory
// in the new view (not opaque or redirected there).
func (f *FS) stillDir(in *gofs.Inode) bool {
	n, ok := in.Operations().(*node)
	if !ok {
		return false
	}
	f.mu.RLock()
	defer f.mu.RUnlock()
	f.ns.RLock()
	defer f.ns.RUnlock()
	st := f.st
	if n.resolve(st, f.gen.Load()) != 0 {
		return false
	}
	n.mu.Lock()
	srcs := n.srcs
	n.mu.Unlock()
	for _, s := range srcs {
		// A frozen or lower layer's entry (and its opaque and redirect
		// attributes) never changes: its cached stat answers.
		if le := s.l.stat(s.path, s.l != st.upper); le.opaque || le.redirect != "" {
			return false
		}
	}
	return true
}

func (f *FS) invalidateAll() {
	var walk func(in *gofs.Inode)
	walk = func(in *gofs.Inode) {
		for name, ch := range in.Children() {
			if cn, ok := ch.Operations().(*node); ok {
				cn.setUnlinked(true)
			}
			_ = in.NotifyEntry(name)
			_ = ch.NotifyContent(0, 0)
			if ch.IsDir() {
				walk(ch)
			}
		}
	}
	walk(f.root.EmbeddedInode())
}

func splitPath(p string) []string {
	var out []string
	for _, c := range strings.Split(p, "/") {
		if c != "" {
			out = append(out, c)
		}
	}
	return out
}

// abortWait is how long waitServer waits for the server's loops after it
// aborted the connection.
const abortWait = 20 * time.Second

// waitServer waits for the server's loops to end. If the connection is
// still alive after Options.UnmountGrace (see there; a client blocked in
// the kernel on a request that is never answered would otherwise keep the
// daemon from exiting), it aborts the FUSE connection through fusectl,
// which fails every pending request and ends the copies of the mount
// elsewhere, and waits once more. It reports whether the server ended.
func (f *FS) waitServer() bool {
	done := make(chan struct{})
	go func() { f.server.Wait(); close(done) }()
	grace := f.opts.UnmountGrace
	if grace <= 0 {
		grace = DefaultUnmountGrace
	}
	select {
	case <-done:
		return true
	case <-time.After(grace):
	}
	// Named before the abort, which unblocks them.
	why := fuseHolders(f.dev)
	f.log.Error("unmount: the FUSE connection is still in use; aborting it", "mount", f.mountpoint, "holders", why, "err", AbortConnection(f.dev))
	select {
	case <-done:
		return true
	case <-time.After(abortWait):
		return false
	}
}

// DefaultMaxIO is the default of Options.MaxIO: the largest READ and
// WRITE request a mount negotiates, and its kernel readahead window.
const DefaultMaxIO = 1 << 20

// minMaxIO is the smallest Options.MaxIO a mount takes.
const minMaxIO = 64 << 10

func (o Options) maxIO() int {
	switch {
	case o.MaxIO == 0:
		return DefaultMaxIO
	case o.MaxIO < minMaxIO:
		return minMaxIO
	}
	return o.MaxIO &^ (os.Getpagesize() - 1)
}

// setReadahead sets the readahead window of the FUSE connection of device
// dev to size bytes. The kernel caps a FUSE connection's window at its
// 128 KiB default whatever the INIT reply offers, so a cold sequential
// read of a file not passed through (a lower file on a new mount) would
// cost one READ round trip per 128 KiB; with the window at the
// negotiated request size it costs one per MiB. Files opened afterwards
// get the new window.
func setReadahead(dev uint64, size int) error {
	if dev == 0 {
		return errors.New("no device number recorded")
	}
	p := fmt.Sprintf("/sys/class/bdi/%d:%d/read_ahead_kb", unix.Major(dev), unix.Minor(dev))
	if err := os.WriteFile(p, []byte(strconv.Itoa(size>>10)), 0o644); err != nil {
		return fmt.Errorf("set readahead: %w", err)
	}
	return nil
}

// fusectl is where the FUSE control file system shows each connection, by
// its device's minor number.
const fusectl = "/sys/fs/fuse/connections"

// connFile returns the path of file name of FUSE connection dev in
// fusectl, mounting fusectl first when the connection is not there (a
// fresh machine may not have it mounted; systemd mounts it only when the
// fuse module loads).
func connFile(dev uint64, name string) string {
	dir := filepath.Join(fusectl, strconv.FormatUint(uint64(unix.Minor(dev)), 10))
	if _, err := os.Stat(dir); err != nil {
		_ = unix.Mount("fusectl", fusectl, "fusectl", 0, "")
	}
	return filepath.Join(dir, name)
}

// AbortConnection aborts FUSE connection dev (the device number of a FUSE
// mount, as stat gives it), through fusectl: every request waiting on it
// fails at once with ECONNABORTED, and every later one too, whoever still
// holds the connection's /dev/fuse. For connections no server will answer
// any more (a dead daemon's): a process blocked on one waits for ever,
// and SIGKILL does not free it.
func AbortConnection(dev uint64) error {
	if dev == 0 {
		return errors.New("abort FUSE connection: no device number")
	}
	if err := os.WriteFile(connFile(dev, "abort"), []byte("1"), 0o200); err != nil {
		return fmt.Errorf("abort FUSE connection %d: %w", unix.Minor(dev), err)
	}
	return nil
}

// Unmount implements layer.FS.
func (f *FS) Unmount() error {
	f.unmountOnce.Do(func() {
		// The unmount itself, not go-fuse's Server.Unmount: that also
		// waits for the server's loops, which run for as long as the
		// connection lives, and the connection may outlive the unmount
		// (see Options.UnmountGrace); waitServer bounds that wait.
		var err error
		for i := 0; i < 50; i++ {
			if err = unix.Unmount(f.mountpoint, 0); err == nil || errors.Is(err, unix.EINVAL) {
				err = nil // EINVAL: not mounted (any more)
				break
			}
			if errors.Is(err, unix.EPERM) {
				err = f.server.Unmount() // not root: fusermount
				break
			}
			time.Sleep(20 * time.Millisecond)
		}
		if err != nil {
			// Lazy detach so the mount never lingers.
			if derr := unix.Unmount(f.mountpoint, unix.MNT_DETACH); derr == nil {
				err = nil
			}
		}
		if !f.waitServer() {
			// A request still being served may use the worker and the
			// journal: leave them open rather than crash it.
			f.unmountErr = fmt.Errorf("unmount %s: FUSE requests still in flight after aborting the connection", f.mountpoint)
			return
		}
		f.closeAllImplicit()
		close(f.bg)
		<-f.bgDone
		close(f.spareKick)
		<-f.spareDone
		_ = f.journal.Sync()
		_ = f.journal.Close()
		f.reg.closeAll()
		f.spareMu.Lock()
		if f.spare != "" {
			_ = os.RemoveAll(f.store.LayerPath(f.spare))
			_ = os.Remove(filepath.Join(f.store.Dir(), "meta/layers", f.spare+".json"))
			f.spare = ""
		}
		f.spareMu.Unlock()
		if rerr := f.store.RemoveMount(f.id); err == nil {
			err = rerr
		}
		if err != nil {
			f.unmountErr = fmt.Errorf("unmount %s: %w", f.mountpoint, err)
		}
	})
	return f.unmountErr
}

// TakeFSEffects implements layer.FS and the probe seam: counts of mutating
// operations since the previous call, bounded samples, and whether the
// upper holds anything.
func (f *FS) TakeFSEffects() effect.FS {
	f.effMu.Lock()
	e := f.eff
	f.eff = effect.FS{}
	f.effMu.Unlock()
	e.UpperNonEmpty = f.dirty.Load()
	return e
}

func (f *FS) record(op string, n *node, name string, bytes uint64) {
	f.effMu.Lock()
	defer f.effMu.Unlock()
	switch op {
	case "create":
		f.eff.Created++
	case "modify":
		f.eff.Modified++
	case "delete":
		f.eff.Deleted++
	case "rename":
		f.eff.Renamed++
	case "meta":
		f.eff.MetaChanged++
	}
	f.eff.BytesWritten += bytes
	if len(f.eff.Samples) < effect.MaxSamples && n != nil {
		p := "/" + join(n.vpath(), name)
		if name == "" {
			p = "/" + n.vpath()
		}
		if k := len(f.eff.Samples); k > 0 && f.eff.Samples[k-1].Path == p && f.eff.Samples[k-1].Op == op {
			return
		}
		f.eff.Samples = append(f.eff.Samples, effect.PathSample{Op: op, Path: filepath.Clean(p)})
	}
}

// inoFor returns the inode number for the entry whose top source is
// (l, ino), allocating one if needed.
func (f *FS) inoFor(l *layerDir, ino uint64) uint64 {
	f.inoMu.Lock()
	defer f.inoMu.Unlock()
	k := inoKey{l, ino}
	if v, ok := f.inos[k]; ok {
		return v
	}
	v := f.nextIno
	f.nextIno++
	f.inos[k] = v
	return v
}

// dropInos forgets the inode numbers of entries of layers the registry
// forgot (their directories are gone, or the mount discarded them): a
// long tree search would otherwise keep a key for every file of every
// layer it ever passed through. The map is scanned once a batch of such
// layers has gathered (inoGoneBatch), so a switch does not pay for it.
// Called by the background worker only.
func (f *FS) dropInos(ls []*layerDir) {
	f.inoGone = append(f.inoGone, ls...)
	if len(f.inoGone) < inoGoneBatch {
		return
	}
	gone := make(map[*layerDir]bool, len(f.inoGone))
	for _, l := range f.inoGone {
		gone[l] = true
	}
	f.inoGone = f.inoGone[:0]
	f.inoMu.Lock()
	for k := range f.inos {
		if gone[k.l] {
			delete(f.inos, k)
		}
	}
	f.inoMu.Unlock()
}

// inoGoneBatch is how many forgotten layers dropInos gathers before it
// scans the inode numbers.
const inoGoneBatch = 32

// freshIno allocates a new inode number for a newly created entry.
func (f *FS) freshIno(l *layerDir, ino uint64) uint64 {
	f.inoMu.Lock()
	defer f.inoMu.Unlock()
	v := f.nextIno
	f.nextIno++
	f.inos[inoKey{l, ino}] = v
	return v
}

func (f *FS) aliasIno(l *layerDir, ino, v uint64) {
	f.inoMu.Lock()
	f.inos[inoKey{l, ino}] = v
	f.inoMu.Unlock()
}

func errnoOf(err error) syscall.Errno {
	if err == nil {
		return 0
	}
	var e syscall.Errno
	if errors.As(err, &e) {
		return e
	}
	return syscall.EIO
}

var _ = context.Background

// hasPassthroughWriters reports whether writable passthrough handles are
// open (their writes bypass the daemon, so the upper counts as dirty).
func (f *FS) hasPassthroughWriters() bool {
	f.ptMu.Lock()
	defer f.ptMu.Unlock()
	for n := range f.ptNodes {
		n.mu.Lock()
		w := n.ptWrite > 0
		n.mu.Unlock()
		if w {
			return true
		}
	}
	return false
}

// swapPassthrough keeps passthrough backing files out of the layer being
// frozen: the live inode of every file with passthrough handles open moves
// into the new upper (the kernel keeps using it) and a copy of its content
// takes its place in the frozen layer. Cost: the size of those files only.
// The caller holds f.mu exclusively.
func (f *FS) swapPassthrough(old, next *stack) error {
	f.ptMu.Lock()
	nodes := make([]*node, 0, len(f.ptNodes))
	for n := range f.ptNodes {
		nodes = append(nodes, n)
	}
	f.ptMu.Unlock()
	for _, n := range nodes {
		n.mu.Lock()
		open, ino := n.ptOpen > 0 && n.ptLower == nil, n.ptIno
		n.mu.Unlock()
		if !open {
			continue // closed, or reading a frozen or lower file
		}
		p, s, ok := f.livePath(old.upper, n, ino)
		if !ok {
			continue // unlinked: not part of the frozen layer
		}
		if err := f.copyUpDirs(next, path.Dir(p)); err != nil {
			return fmt.Errorf("move open file %s: %w", p, err)
		}
		if err := unix.Renameat(old.upper.fd, p, next.upper.fd, p); err != nil {
			return fmt.Errorf("move open file %s: %w", p, err)
		}
		if err := copyFile(next.upper.fd, p, old.upper.fd, p, s, next.upper.path+"/"+p, false); err != nil {
			_ = unix.Renameat(next.upper.fd, p, old.upper.fd, p)
			return fmt.Errorf("freeze open file %s: %w", p, err)
		}
		if s.Nlink > 1 {
			if err := f.relinkMoved(old, next, p, s); err != nil {
				return fmt.Errorf("keep the links of open file %s: %w", p, err)
			}
		}
	}
	return nil
}

// livePath finds the name in upper layer u of the backing inode ino of
// node n's passthrough handles. Passthrough writes bypass the daemon, so
// the node's resolution may be stale, and its place in the kernel's tree
// can lag the layer: go-fuse attaches a created node to its parent, and
// moves a renamed one, only after the handler has returned and released
// f.mu, so a checkpoint can run in between. The node's path is tried
// first; when it names another inode (or none), the upper is searched by
// inode number: the upper holds only the changes since the last
// checkpoint. ok is false when the inode has no name in u (unlinked).
func (f *FS) livePath(u *layerDir, n *node, ino uint64) (string, *unix.Stat_t, bool) {
	var s unix.Stat_t
	p := n.vpath()
	if unix.Fstatat(u.fd, p, &s, unix.AT_SYMLINK_NOFOLLOW) == nil && s.Ino == ino {
		return p, &s, true
	}
	names := f.linkNames(u, ino, 1)
	if len(names) == 0 {
		return "", nil, false
	}
	if unix.Fstatat(u.fd, names[0], &s, unix.AT_SYMLINK_NOFOLLOW) != nil || s.Ino != ino {
		return "", nil, false
	}
	return names[0], &s, true
}

// relinkMoved keeps a hard link linked on both sides of a checkpoint
// after swapPassthrough moved the name p of a multiply-linked live inode
// (stat s) into the new upper and left a copy at p in the layer being
// frozen: the inode's other names there now point at that copy, and the
// new upper gets the same names for the live inode. The caller holds f.mu
// exclusively.
func (f *FS) relinkMoved(old, next *stack, p string, s *unix.Stat_t) error {
	for _, q := range f.linkNames(old.upper, s.Ino, s.Nlink) {
		if q == p {
			continue
		}
		tmp := path.Join(path.Dir(q), ".rewind-relink-"+layer.NewID())
		if err := unix.Linkat(old.upper.fd, p, old.upper.fd, tmp, 0); err != nil {
			return err
		}
		if err := unix.Renameat(old.upper.fd, tmp, old.upper.fd, q); err != nil {
			_ = unix.Unlinkat(old.upper.fd, tmp, 0)
			return err
		}
		if err := f.copyUpDirs(next, path.Dir(q)); err != nil {
			return err
		}
		if err := unix.Linkat(next.upper.fd, p, next.upper.fd, q, 0); err != nil {
			return err
		}
	}
	return nil
}

// retargetPassthrough makes files held open with passthrough follow a
// switch, as every other descriptor does: the live inode (which the kernel
// reads and writes directly) gets the target view's content and moves into
// the new upper. A file absent from the target keeps its old content, like
// an unlinked open file. Cost: the size of those files only. The caller
// holds f.mu exclusively.
func (f *FS) retargetPassthrough(old, next *stack) {
	f.ptMu.Lock()
	nodes := make([]*node, 0, len(f.ptNodes))
	for n := range f.ptNodes {
		nodes = append(nodes, n)
	}
	f.ptMu.Unlock()
	for _, n := range nodes {
		n.mu.Lock()
		open, ino := n.ptOpen > 0 && n.ptLower == nil, n.ptIno
		n.mu.Unlock()
		if !open {
			continue // closed, or reading a frozen or lower file
		}
		p, _, ok := f.livePath(old.upper, n, ino)
		if !ok {
			continue
		}
		e, ok := f.resolvePath(next, p)
		if !ok || e.st.Mode&unix.S_IFMT != unix.S_IFREG {
			continue
		}
		if err := f.copyUpDirs(next, path.Dir(p)); err != nil {
			f.log.Warn("retarget open file", "path", p, "err", err)
			continue
		}
		s := e.srcs[0]
		in, err := openBeneath(s.l.fd, s.path, unix.O_RDONLY, 0)
		if err != nil {
			continue
		}
		out, err := openBeneath(old.upper.fd, p, unix.O_WRONLY, 0)
		if err == nil {
			err = unix.Ftruncate(out, 0)
			if err == nil {
				err = copyData(in, out, e.st.Size)
			}
			if err == nil {
				_ = unix.Fchown(out, int(e.st.Uid), int(e.st.Gid))
				_ = unix.Fchmod(out, e.st.Mode&07777)
				// The target's xattrs replace the live file's.
				if names, lerr := listXattrs(old.upper.path + "/" + p); lerr == nil {
					for _, a := range names {
						_ = unix.Fremovexattr(out, a)
					}
				}
				_ = copyXattrsFd(s.l.path+"/"+s.path, out)
				_ = unix.UtimesNanoAt(out, "", []unix.Timespec{e.st.Atim, e.st.Mtim}, unix.AT_EMPTY_PATH)
			}
			unix.Close(out)
		}
		unix.Close(in)
		if err == nil {
			err = unix.Renameat(old.upper.fd, p, next.upper.fd, p)
		}
		if err != nil {
			f.log.Warn("retarget open file", "path", p, "err", err)
			continue
		}
		var ls unix.Stat_t
		if unix.Fstatat(next.upper.fd, p, &ls, unix.AT_SYMLINK_NOFOLLOW) == nil && ls.Nlink > 1 {
			// The live inode's other names in the discarded upper would
			// count in its link count until that layer is removed in the
			// background.
			for _, q := range f.linkNames(old.upper, ls.Ino, uint64(ls.Nlink)-1) {
				_ = unix.Unlinkat(old.upper.fd, q, 0)
			}
		}
		if e.st.Nlink > 1 {
			// The target's other names of that inode now name the live
			// one in the new upper, so the link holds.
			f.copyUpLinks(next, s, p)
		}
	}
}
