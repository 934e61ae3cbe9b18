package layer

import (
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"golang.org/x/sys/unix"
)

// Store is a state directory holding layers, checkpoint records and mount
// records. Several mounts (in one or several processes) may share a Store.
type Store struct {
	dir string
	// recMu orders DeleteCheckpoint and RewriteCheckpoint, so a rewrite
	// never brings back a checkpoint deleted meanwhile (in this process).
	recMu sync.Mutex

	// pendMu guards pending and failed: checkpoints of this process whose
	// record is still being written (BeginCheckpoint).
	pendMu  sync.Mutex
	pending map[string]chan struct{}
	failed  map[string]error

	// recs caches decoded checkpoint records by id, each with the identity
	// of the file it was read from (see cachedRecord).
	recMemo sync.Mutex
	recs    map[string]cachedRecord
}

// cachedRecord is a decoded checkpoint record and the identity of its
// file when it was read. Record files are never written in place (a
// record is linked into place, a rewrite or tombstone is renamed over
// it), so a file of the same inode, size, mtime and ctime holds the same
// record, also when another process shares the store.
type cachedRecord struct {
	c   Checkpoint
	key recordKey
}

type recordKey struct {
	dev, ino uint64
	size     int64
	mtime    unix.Timespec
	ctime    unix.Timespec
}

// maxCachedRecords bounds the record cache; when full it starts over.
const maxCachedRecords = 4096

// Checkpoint is a checkpoint record: an id naming an immutable stack.
type Checkpoint struct {
	// ID is unique in the store.
	ID string `json:"id"`
	// Mount is the id of the mount that took the checkpoint.
	Mount string `json:"mount"`
	// Parent is the checkpoint this one was taken on top of ("" if none).
	Parent string `json:"parent,omitempty"`
	// Created is the creation time.
	Created time.Time `json:"created"`
	// Lowers are external read-only base directories, topmost first.
	Lowers []string `json:"lowers,omitempty"`
	// Layers are the frozen layer ids of the stack, bottom first.
	Layers []string `json:"layers"`
	// Deleted marks a tombstone left by DeleteCheckpoint.
	Deleted bool `json:"deleted,omitempty"`
}

// MountRecord describes a live (or crashed) mount of the store.
type MountRecord struct {
	ID         string   `json:"id"`
	PID        int      `json:"pid"`
	Mountpoint string   `json:"mountpoint"`
	Lowers     []string `json:"lowers,omitempty"`
	// Layers are the frozen layers under the upper, bottom first.
	Layers []string `json:"layers"`
	// Upper is the id of the writable upper layer.
	Upper string `json:"upper"`
	// Base is the last checkpoint taken or switched to ("" if none).
	Base string `json:"base,omitempty"`
	// Spare is a pre-created empty layer the next checkpoint will use as
	// its upper.
	Spare string `json:"spare,omitempty"`
}

// LayerMeta is the metadata of one layer.
type LayerMeta struct {
	ID      string    `json:"id"`
	Parent  string    `json:"parent,omitempty"`
	Created time.Time `json:"created"`
	// Size is the byte size of a compacted layer (0 when not computed).
	Size int64 `json:"size,omitempty"`
}

// ErrNotFound is returned (wrapped) for an unknown checkpoint, layer or mount.
var ErrNotFound = errors.New("not found")

// OpenStore opens (creating if needed) the state directory dir.
func OpenStore(dir string) (*Store, error) {
	abs, err := filepath.Abs(dir)
	if err != nil {
		return nil, fmt.Errorf("open store %s: %w", dir, err)
	}
	for _, d := range []string{"", "layers", "meta", "meta/checkpoints", "meta/mounts", "meta/layers", "work", "ctl"} {
		if err := os.MkdirAll(filepath.Join(abs, d), 0o700); err != nil {
			return nil, fmt.Errorf("open store %s: %w", dir, err)
		}
	}
	if err := os.Chmod(filepath.Join(abs, "ctl"), 0o700); err != nil {
		return nil, fmt.Errorf("open store %s: %w", dir, err)
	}
	// No descriptor is kept open: a store on a file system of its own
	// (rewind init-store) must stay unmountable.
	s := &Store{dir: abs}
	s.keepReserve()
	return s, nil
}

// reserveSize is the disk space a store keeps allocated in meta/.reserve
// for deleting checkpoints on a full file system: a deletion writes a
// tombstone record first (about 4 KiB on disk), so with the disk full GC
// could free nothing. A thousand tombstones' worth.
const reserveSize = 4 << 20

// keepReserve allocates the reserve file if it is not whole (best effort:
// on a full disk it stays as large as it got).
func (s *Store) keepReserve() {
	p := filepath.Join(s.dir, "meta", ".reserve")
	if st, err := os.Stat(p); err == nil && st.Size() >= reserveSize {
		return
	}
	f, err := os.OpenFile(p, os.O_WRONLY|os.O_CREATE, 0o600)
	if err != nil {
		return
	}
	defer f.Close()
	_ = unix.Fallocate(int(f.Fd()), 0, 0, reserveSize)
}

// releaseReserve frees the reserve (see reserveSize); GC allocates it again
// once it freed layers. It reports whether there was one to free.
func (s *Store) releaseReserve() bool {
	return os.Remove(filepath.Join(s.dir, "meta", ".reserve")) == nil
}

// Dir is the absolute state directory.
func (s *Store) Dir() string { return s.dir }

// LayerPath is the directory of layer id.
func (s *Store) LayerPath(id string) string { return filepath.Join(s.dir, "layers", id) }

// ControlSocket is the path of the control socket of mount id (in a
// root-only directory of the store, never inside a mount).
func (s *Store) ControlSocket(mountID string) string {
	return filepath.Join(s.dir, "ctl", mountID+".sock")
}

// WorkDir is a scratch directory on the store's file system.
func (s *Store) WorkDir() string { return filepath.Join(s.dir, "work") }

// NewID returns a fresh random id.
func NewID() string {
	var b [8]byte
	if _, err := rand.Read(b[:]); err != nil {
		panic(err)
	}
	return hex.EncodeToString(b[:])
}

// ValidID reports whether id is usable as a file name component.
func ValidID(id string) bool {
	if id == "" || len(id) > 128 || id == "." || id == ".." {
		return false
	}
	for _, c := range id {
		if !(c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9' || c == '-' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// NewLayer creates an empty layer directory and its metadata and returns
// its id. The directory appears under layers/ only once its metadata is
// written (it is made in the work directory and renamed into place), so a
// concurrent GC always sees its creation time and keeps it.
func (s *Store) NewLayer(parent string) (string, error) {
	id := NewID()
	tmp := filepath.Join(s.WorkDir(), "new-"+id)
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return "", fmt.Errorf("new layer: %w", err)
	}
	m := LayerMeta{ID: id, Parent: parent, Created: time.Now().UTC()}
	if err := s.writeJSON(filepath.Join("meta/layers", id+".json"), m, false); err != nil {
		_ = os.Remove(tmp)
		return "", fmt.Errorf("new layer %s: %w", id, err)
	}
	if err := os.Rename(tmp, s.LayerPath(id)); err != nil {
		_ = os.Remove(tmp)
		_ = os.Remove(filepath.Join(s.dir, "meta/layers", id+".json"))
		return "", fmt.Errorf("new layer %s: %w", id, err)
	}
	return id, nil
}

// Layer returns the metadata of layer id.
func (s *Store) Layer(id string) (LayerMeta, error) {
	var m LayerMeta
	if !ValidID(id) {
		return m, fmt.Errorf("layer %q: %w", id, ErrNotFound)
	}
	err := s.readJSON(filepath.Join("meta/layers", id+".json"), &m)
	return m, err
}

// SaveCheckpoint writes a checkpoint record durably (temp, fsync, rename).
func (s *Store) SaveCheckpoint(c Checkpoint) error {
	if !ValidID(c.ID) {
		return fmt.Errorf("save checkpoint: invalid id %q", c.ID)
	}
	if err := s.writeJSON(filepath.Join("meta/checkpoints", c.ID+".json"), c, true); err != nil {
		return fmt.Errorf("save checkpoint %s: %w", c.ID, err)
	}
	return nil
}

// RewriteCheckpoint re-reads checkpoint id's record, lets fn change it and
// writes it back when fn returns true. A checkpoint that is deleted, or
// deleted meanwhile by DeleteCheckpoint, is left alone (nil error).
func (s *Store) RewriteCheckpoint(id string, fn func(*Checkpoint) bool) error {
	s.recMu.Lock()
	defer s.recMu.Unlock()
	c, err := s.Checkpoint(id)
	if errors.Is(err, ErrNotFound) {
		return nil
	}
	if err != nil {
		return err
	}
	if !fn(&c) {
		return nil
	}
	return s.SaveCheckpoint(c)
}

// Record reads checkpoint id's record file only: unlike Checkpoint it
// never scans the mounts' journals (whose cost grows with every
// checkpoint), so a record not yet materialized is ErrNotFound. Deleted
// records are ErrNotFound too; layers are not checked.
func (s *Store) Record(id string) (Checkpoint, error) {
	var c Checkpoint
	if !ValidID(id) {
		return c, fmt.Errorf("checkpoint %q: %w", id, ErrNotFound)
	}
	if err := s.AwaitCheckpoint(id); err != nil {
		return c, err
	}
	if err := s.readRecord(id, &c); err != nil {
		return c, fmt.Errorf("checkpoint %s: %w", id, err)
	}
	if c.Deleted || c.ID != id {
		return c, fmt.Errorf("checkpoint %s: %w", id, ErrNotFound)
	}
	return c, nil
}

// MaterializeCheckpoint writes the record of a checkpoint already
// committed to a mount's journal, unless a record of that id exists: a
// checkpoint deleted before its record was written stays deleted (its
// tombstone is not replaced). durable fsyncs the record and its directory.
func (s *Store) MaterializeCheckpoint(c Checkpoint, durable bool) error {
	if !ValidID(c.ID) {
		return fmt.Errorf("save checkpoint: invalid id %q", c.ID)
	}
	b, err := json.Marshal(c)
	if err != nil {
		return fmt.Errorf("save checkpoint %s: %w", c.ID, err)
	}
	dir := filepath.Join(s.dir, "meta/checkpoints")
	final := filepath.Join(dir, c.ID+".json")
	tmp := filepath.Join(dir, "."+c.ID+".json."+NewID()+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return fmt.Errorf("save checkpoint %s: %w", c.ID, err)
	}
	_, err = f.Write(b)
	if err == nil && durable {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		// link(2) never replaces an existing name.
		if err = os.Link(tmp, final); errors.Is(err, os.ErrExist) {
			err = nil
		}
	}
	_ = os.Remove(tmp)
	if err != nil {
		return fmt.Errorf("save checkpoint %s: %w", c.ID, err)
	}
	if durable {
		if d, err := os.Open(dir); err == nil {
			_ = d.Sync()
			_ = d.Close()
		}
	}
	return nil
}

// BeginCheckpoint announces checkpoint id, whose id its mount has handed
// out while its layer and record are still being written (the kernel path
// finishes a frozen layer after the sandbox is thawed). Until end is
// called, Checkpoint, CheckpointPending, Record and DeleteCheckpoint of id
// in this process wait for it; end(err) with err != nil makes them fail
// with err from then on (the record was never written). end must be
// called exactly once.
func (s *Store) BeginCheckpoint(id string) (end func(error)) {
	done := make(chan struct{})
	s.pendMu.Lock()
	if s.pending == nil {
		s.pending = map[string]chan struct{}{}
	}
	s.pending[id] = done
	s.pendMu.Unlock()
	return func(err error) {
		s.pendMu.Lock()
		delete(s.pending, id)
		if err != nil {
			if s.failed == nil {
				s.failed = map[string]error{}
			}
			s.failed[id] = err
		}
		s.pendMu.Unlock()
		close(done)
	}
}

// AwaitCheckpoint waits while checkpoint id is being written by this
// process (BeginCheckpoint) and returns the error it ended with: nil for a
// checkpoint written, or not announced here at all.
func (s *Store) AwaitCheckpoint(id string) error {
	s.pendMu.Lock()
	done := s.pending[id]
	s.pendMu.Unlock()
	if done != nil {
		<-done
	}
	s.pendMu.Lock()
	defer s.pendMu.Unlock()
	if err := s.failed[id]; err != nil {
		return fmt.Errorf("checkpoint %s: %w: %w", id, ErrNotFound, err)
	}
	return nil
}

// Checkpoint reads the record of checkpoint id and checks that its layers
// exist.
func (s *Store) Checkpoint(id string) (Checkpoint, error) {
	return s.checkpoint(id, nil)
}

// CheckpointPending is Checkpoint for the mount that journaled checkpoint c
// itself and may not have materialized its record yet: with no record file
// it takes c as the record instead of scanning every mount's journal (whose
// length grows with the session). A record that exists wins, so a
// checkpoint deleted meanwhile stays deleted.
func (s *Store) CheckpointPending(c Checkpoint) (Checkpoint, error) {
	return s.checkpoint(c.ID, &c)
}

func (s *Store) checkpoint(id string, pending *Checkpoint) (Checkpoint, error) {
	var c Checkpoint
	if !ValidID(id) {
		return c, fmt.Errorf("checkpoint %q: %w", id, ErrNotFound)
	}
	if err := s.AwaitCheckpoint(id); err != nil {
		return c, err
	}
	err := s.readRecord(id, &c)
	if errors.Is(err, ErrNotFound) && pending != nil {
		c, err = *pending, nil
	} else if errors.Is(err, ErrNotFound) {
		// Not materialized yet: look in the mounts' journals.
		js, jerr := s.journalCheckpoints()
		if jerr != nil {
			return c, fmt.Errorf("checkpoint %s: %w", id, jerr)
		}
		jc, ok := js[id]
		if !ok {
			return c, fmt.Errorf("checkpoint %s: %w", id, ErrNotFound)
		}
		c, err = jc, nil
	}
	if err != nil {
		return c, fmt.Errorf("checkpoint %s: %w", id, err)
	}
	if c.Deleted {
		return c, fmt.Errorf("checkpoint %s: %w (deleted)", id, ErrNotFound)
	}
	if c.ID != id {
		return c, fmt.Errorf("checkpoint %s: corrupted record (id %q)", id, c.ID)
	}
	if len(c.Layers) == 0 {
		return c, nil
	}
	// The layers are looked up relative to layers/, opened for this call:
	// one walk of the store's path instead of one per layer.
	dfd, err := unix.Open(filepath.Join(s.dir, "layers"), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return c, fmt.Errorf("checkpoint %s: open layers: %w", id, err)
	}
	defer unix.Close(dfd)
	for _, l := range c.Layers {
		if !ValidID(l) {
			return c, fmt.Errorf("checkpoint %s: corrupted record (layer %q)", id, l)
		}
		var st unix.Stat_t
		err := unix.Fstatat(dfd, l, &st, unix.AT_SYMLINK_NOFOLLOW)
		if err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return c, fmt.Errorf("checkpoint %s: layer %s missing or corrupted", id, l)
		}
	}
	return c, nil
}

// readRecord reads checkpoint id's record file into c (ErrNotFound if
// there is none), from the cache when the file is the one read before.
// c gets slices of its own.
func (s *Store) readRecord(id string, c *Checkpoint) error {
	name := id + ".json"
	var st unix.Stat_t
	err := unix.Lstat(filepath.Join(s.dir, "meta/checkpoints", name), &st)
	if err != nil {
		if err == unix.ENOENT {
			return ErrNotFound
		}
		return fmt.Errorf("stat record %s: %w", name, err)
	}
	key := recordKey{dev: st.Dev, ino: st.Ino, size: st.Size, mtime: st.Mtim, ctime: st.Ctim}
	s.recMemo.Lock()
	e, ok := s.recs[id]
	s.recMemo.Unlock()
	if ok && e.key == key {
		*c = e.c.clone()
		return nil
	}
	// The stat is older than the read: if the file is replaced in
	// between, the entry pairs the new content with the old file's key,
	// and the next read finds the key changed and reads again.
	var rc Checkpoint
	if err := s.readJSON(filepath.Join("meta/checkpoints", name), &rc); err != nil {
		return err
	}
	s.recMemo.Lock()
	if s.recs == nil || len(s.recs) >= maxCachedRecords {
		s.recs = map[string]cachedRecord{}
	}
	s.recs[id] = cachedRecord{c: rc.clone(), key: key}
	s.recMemo.Unlock()
	*c = rc
	return nil
}

// clone returns c with slices of its own.
func (c Checkpoint) clone() Checkpoint {
	c.Lowers = append([]string(nil), c.Lowers...)
	c.Layers = append([]string(nil), c.Layers...)
	return c
}

// Checkpoints lists every checkpoint of the store, oldest first.
func (s *Store) Checkpoints() ([]Checkpoint, error) {
	ents, err := os.ReadDir(filepath.Join(s.dir, "meta/checkpoints"))
	if err != nil {
		return nil, fmt.Errorf("list checkpoints: %w", err)
	}
	seen := map[string]bool{}
	var out []Checkpoint
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !ValidID(name) {
			continue
		}
		var c Checkpoint
		if err := s.readJSON(filepath.Join("meta/checkpoints", e.Name()), &c); err != nil {
			continue
		}
		seen[name] = true
		if !c.Deleted {
			out = append(out, c)
		}
	}
	js, err := s.journalCheckpoints()
	if err != nil {
		return nil, fmt.Errorf("list checkpoints: %w", err)
	}
	for id, c := range js {
		if !seen[id] {
			out = append(out, c)
		}
	}
	sort.Slice(out, func(i, j int) bool {
		if !out[i].Created.Equal(out[j].Created) {
			return out[i].Created.Before(out[j].Created)
		}
		return out[i].ID < out[j].ID
	})
	return out, nil
}

// DeleteCheckpoint removes checkpoint id (a tombstone record replaces it).
// Its layers are freed by the next GC if nothing else references them.
func (s *Store) DeleteCheckpoint(id string) error {
	s.recMu.Lock()
	defer s.recMu.Unlock()
	c, err := s.Checkpoint(id)
	if errors.Is(err, ErrNotFound) {
		return fmt.Errorf("delete checkpoint %s: %w", id, ErrNotFound)
	}
	if c.ID != id {
		return fmt.Errorf("delete checkpoint %s: %w", id, err)
	}
	tomb := Checkpoint{ID: id, Mount: c.Mount, Created: c.Created, Deleted: true}
	err = s.writeJSON(filepath.Join("meta/checkpoints", id+".json"), tomb, true)
	if errors.Is(err, unix.ENOSPC) && s.releaseReserve() {
		// A full disk: the reserve makes room for the tombstones of a GC
		// that then frees layers (and allocates the reserve again).
		err = s.writeJSON(filepath.Join("meta/checkpoints", id+".json"), tomb, true)
	}
	if err != nil {
		return fmt.Errorf("delete checkpoint %s: %w", id, err)
	}
	return nil
}

// SaveMount writes a mount record (rename-atomic; durable=true adds fsync).
func (s *Store) SaveMount(m MountRecord, durable bool) error {
	if !ValidID(m.ID) {
		return fmt.Errorf("save mount: invalid id %q", m.ID)
	}
	if err := s.writeJSON(filepath.Join("meta/mounts", m.ID+".json"), m, durable); err != nil {
		return fmt.Errorf("save mount %s: %w", m.ID, err)
	}
	return nil
}

// Mount reads the record of mount id.
func (s *Store) Mount(id string) (MountRecord, error) {
	var m MountRecord
	if !ValidID(id) {
		return m, fmt.Errorf("mount %q: %w", id, ErrNotFound)
	}
	err := s.readJSON(filepath.Join("meta/mounts", id+".json"), &m)
	return m, err
}

// Mounts lists the mount records (live or left by a crash).
func (s *Store) Mounts() ([]MountRecord, error) {
	ents, err := os.ReadDir(filepath.Join(s.dir, "meta/mounts"))
	if err != nil {
		return nil, fmt.Errorf("list mounts: %w", err)
	}
	var out []MountRecord
	for _, e := range ents {
		name, ok := strings.CutSuffix(e.Name(), ".json")
		if !ok || !ValidID(name) {
			continue
		}
		m, err := s.Mount(name)
		if err == nil {
			out = append(out, m)
		}
	}
	return out, nil
}

// RemoveMount deletes the record of mount id (on a clean unmount). Its
// upper layer is freed by the next GC.
func (s *Store) RemoveMount(id string) error {
	err := os.Remove(filepath.Join(s.dir, "meta/mounts", id+".json"))
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return fmt.Errorf("remove mount %s: %w", id, err)
	}
	return nil
}

// ProcessAlive reports whether pid names a live process.
func ProcessAlive(pid int) bool {
	if pid <= 0 {
		return false
	}
	err := syscall.Kill(pid, 0)
	return err == nil || errors.Is(err, syscall.EPERM)
}

// Referenced returns the set of layer ids referenced by a checkpoint record
// or a mount record (live or crashed: a crashed mount can be resumed).
func (s *Store) Referenced() (map[string]bool, error) {
	refs := map[string]bool{}
	cps, err := s.Checkpoints()
	if err != nil {
		return nil, err
	}
	for _, c := range cps {
		for _, l := range c.Layers {
			refs[l] = true
		}
	}
	ms, err := s.Mounts()
	if err != nil {
		return nil, err
	}
	for _, m := range ms {
		for _, l := range m.Layers {
			refs[l] = true
		}
		refs[m.Upper] = true
		refs[m.Spare] = true
		// The journal is ahead of the lazily written record.
		if js, err := s.JournalEntries(m.ID); err == nil && len(js) > 0 {
			last := js[len(js)-1]
			refs[last.Upper] = true
			for _, l := range last.Checkpoint.Layers {
				refs[l] = true
			}
		}
	}
	return refs, nil
}

// GC removes every layer referenced by no checkpoint and no mount record
// and returns the removed ids. Layers younger than minAge are kept, so a
// layer being created concurrently by another process is never freed;
// except the layers a mount's journal names in an entry that a later
// entry of the same journal superseded (settledLayers): they were part of
// a mount's stack, so their creation is over, and once nothing references
// them they are garbage whatever their age. A deletion's GC frees them at
// once (such as the changed upper a restore froze as its undo point, when
// that checkpoint is deleted right after the restore) instead of leaving
// them to a GC that may never come.
func (s *Store) GC(minAge time.Duration) ([]string, error) {
	refs, err := s.Referenced()
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	ents, err := os.ReadDir(filepath.Join(s.dir, "layers"))
	if err != nil {
		return nil, fmt.Errorf("gc: %w", err)
	}
	var removed []string
	var settled map[string]bool // read when a young layer needs it
	for _, e := range ents {
		id := e.Name()
		if refs[id] || !ValidID(id) {
			continue
		}
		if s.layerYoung(id, minAge) {
			if settled == nil {
				if settled, err = s.settledLayers(); err != nil {
					return removed, fmt.Errorf("gc: %w", err)
				}
			}
			if !settled[id] {
				continue
			}
		}
		// Rename first so a half-removed layer is never mistaken for a
		// valid one.
		tmp := filepath.Join(s.WorkDir(), "gc-"+id)
		if err := os.Rename(s.LayerPath(id), tmp); err != nil {
			if errors.Is(err, os.ErrNotExist) {
				// Removed meanwhile: by its mount (an upper a switch
				// discarded) or by another GC.
				continue
			}
			return removed, fmt.Errorf("gc layer %s: %w", id, err)
		}
		if err := os.RemoveAll(tmp); err != nil {
			return removed, fmt.Errorf("gc layer %s: %w", id, err)
		}
		_ = os.Remove(filepath.Join(s.dir, "meta/layers", id+".json"))
		removed = append(removed, id)
	}
	s.sweepWork(minAge)
	s.keepReserve()
	return removed, nil
}

// sweepWork removes what a crash left in the work directory: layers
// NewLayer had not yet moved into place (new-*) and layers a removal had
// not finished (gc-*), once older than minAge.
func (s *Store) sweepWork(minAge time.Duration) {
	ents, err := os.ReadDir(s.WorkDir())
	if err != nil {
		return
	}
	for _, e := range ents {
		name := e.Name()
		if !strings.HasPrefix(name, "new-") && !strings.HasPrefix(name, "gc-") {
			continue
		}
		p := filepath.Join(s.WorkDir(), name)
		var st syscall.Stat_t
		if syscall.Lstat(p, &st) != nil || time.Since(time.Unix(st.Ctim.Sec, st.Ctim.Nsec)) < minAge {
			continue
		}
		_ = os.RemoveAll(p)
	}
}

// layerYoung reports whether layer id is younger than minAge: by its
// metadata, or, for a directory without metadata (left by a crash), by the
// directory's change time. A layer it cannot date is kept.
func (s *Store) layerYoung(id string, minAge time.Duration) bool {
	if m, err := s.Layer(id); err == nil {
		return time.Since(m.Created) < minAge
	}
	var st syscall.Stat_t
	if err := syscall.Lstat(s.LayerPath(id), &st); err != nil {
		return true
	}
	return time.Since(time.Unix(st.Ctim.Sec, st.Ctim.Nsec)) < minAge
}

func (s *Store) writeJSON(rel string, v any, durable bool) error {
	b, err := json.Marshal(v)
	if err != nil {
		return err
	}
	return WriteFileAtomic(filepath.Join(s.dir, rel), b, durable)
}

func (s *Store) readJSON(rel string, v any) error {
	b, err := os.ReadFile(filepath.Join(s.dir, rel))
	if errors.Is(err, os.ErrNotExist) {
		return ErrNotFound
	}
	if err != nil {
		return err
	}
	if err := json.Unmarshal(b, v); err != nil {
		return fmt.Errorf("corrupted record %s: %w", filepath.Base(rel), err)
	}
	return nil
}

// WriteFileAtomic writes data to path via a temporary file and a rename;
// with durable it fsyncs the file before the rename and the directory after.
func WriteFileAtomic(path string, data []byte, durable bool) error {
	dir := filepath.Dir(path)
	tmp := filepath.Join(dir, "."+filepath.Base(path)+"."+NewID()+".tmp")
	f, err := os.OpenFile(tmp, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	_, err = f.Write(data)
	if err == nil && durable {
		err = f.Sync()
	}
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Rename(tmp, path)
	}
	if err != nil {
		_ = os.Remove(tmp)
		return err
	}
	if durable {
		if d, err := os.Open(dir); err == nil {
			_ = d.Sync()
			_ = d.Close()
		}
	}
	return nil
}

// AdoptLayer moves the directory dir (on the store's file system) into the
// store as layer id with metadata m.
func (s *Store) AdoptLayer(id, dir string, m LayerMeta) error {
	if !ValidID(id) {
		return fmt.Errorf("adopt layer: invalid id %q", id)
	}
	if err := s.writeJSON(filepath.Join("meta/layers", id+".json"), m, true); err != nil {
		return fmt.Errorf("adopt layer %s: %w", id, err)
	}
	if err := os.Rename(dir, s.LayerPath(id)); err != nil {
		return fmt.Errorf("adopt layer %s: %w", id, err)
	}
	return nil
}
