package fs

import (
	"errors"
	"fmt"
	"path"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// layerDir is one layer of a stack: a store layer (id != "") or an external
// read-only lower directory.
type layerDir struct {
	id   string
	path string
	// fd is an O_PATH descriptor of the layer root, open while the layer
	// is referenced (refs > 0) and -1 otherwise. Whoever reads it holds a
	// reference: the current stack holds one on each of its layers (and
	// its users hold f.mu), other users take their own (layers.ref).
	fd int
	// refs counts the references; guarded by the registry's mu.
	refs int
	// dev and ino identify the root directory, so that a layer opened
	// again is known to be the same directory as before.
	dev, ino uint64

	// Frozen layers never change: their directory listings and the
	// entries looked up in them are cached, so a lookup through hundreds
	// of layers costs map lookups, not system calls. An external lower's
	// listings may be shared by every mount over it (Options.LowerCache).
	cache  *dirCache
	entsMu sync.Mutex
	ents   map[string]*layerEnt // path -> entry

	// The paths a frozen layer holds (see walkTouched), walked once (in
	// the background after the checkpoint that froze it, or by the first
	// switch that needs them): a switch invalidates the paths of the
	// layers it leaves and enters.
	touchedMu sync.Mutex
	touched   map[string]bool

	// The root attributes of a frozen store layer, read once
	// (inheritRootMeta), and, for an upper, the layer whose root
	// attributes it was last given.
	rootMu   sync.Mutex
	rootRead bool
	root     layer.RootAttrs
	rootFrom atomic.Pointer[layerDir]
}

// layerEnt is a cached entry of a frozen layer.
type layerEnt struct {
	err      error
	st       unix.Stat_t
	opaque   bool
	redirect string
}

// dirCache holds a frozen layer's directory listings. A listing is never
// changed once stored, only replaced.
type dirCache struct {
	mu  sync.Mutex
	idx map[string]listing // dir path -> names
	// shared: the cache serves several mounts, which may start long
	// after a listing was read; a listing is checked against its
	// directory's ctime (at most every lowerRecheck).
	shared bool
}

// listing is the names of a directory and, in a shared cache, the
// directory's ctime when they were read.
type listing struct {
	names map[string]bool
	ctime unix.Timespec
	// checked is when the ctime was last found unchanged (shared
	// caches): within lowerRecheck of it the listing is used unchecked.
	checked time.Time
}

// lowerRecheck is how long a shared listing is used without a look at
// its directory's ctime: a burst of lookups (a program starting, which
// searches a dozen library directories) checks each directory once, and a
// change of the host's packages shows in new lookups within this time.
const lowerRecheck = time.Second

// LowerCache shares the directory listings of the external lower
// directories mounts have in common (Options.Lowers, such as a read-only
// base image or the host's root): one listing of a large system directory
// serves every sandbox over it, instead of one read per mount. A listing
// is checked against its directory's ctime at most once a second
// (lowerRecheck), so lookups see a change of the host's packages within a
// second (a mount that owned its listings never saw one). Safe for
// concurrent use; create it with NewLowerCache.
type LowerCache struct {
	mu   sync.Mutex
	dirs map[lowerKey]*dirCache
}

// lowerKey identifies a lower directory: its device and inode.
type lowerKey struct{ dev, ino uint64 }

// NewLowerCache returns an empty LowerCache.
func NewLowerCache() *LowerCache {
	return &LowerCache{dirs: map[lowerKey]*dirCache{}}
}

// maxSharedLowers bounds a LowerCache: past it, new lowers get caches of
// their own.
const maxSharedLowers = 64

// forDir returns the cache of the lower directory open as fd.
func (c *LowerCache) forDir(fd int) *dirCache {
	var st unix.Stat_t
	if c == nil || unix.Fstat(fd, &st) != nil {
		return &dirCache{}
	}
	k := lowerKey{st.Dev, st.Ino}
	c.mu.Lock()
	defer c.mu.Unlock()
	d := c.dirs[k]
	if d == nil {
		if len(c.dirs) >= maxSharedLowers {
			return &dirCache{}
		}
		d = &dirCache{shared: true}
		c.dirs[k] = d
	}
	return d
}

// racyListing is how recently a directory may have changed for its
// listing to stay out of a shared cache: a change within the same tick of
// the file system's coarse clock would leave the ctime as it was.
const racyListing = time.Second

// stat returns the entry at p in l; cached when l is frozen.
func (l *layerDir) stat(p string, frozen bool) *layerEnt {
	if frozen {
		l.entsMu.Lock()
		if e, ok := l.ents[p]; ok {
			l.entsMu.Unlock()
			return e
		}
		l.entsMu.Unlock()
	}
	e := &layerEnt{}
	e.err = unix.Fstatat(l.fd, p, &e.st, unix.AT_SYMLINK_NOFOLLOW)
	if e.err == nil && e.st.Mode&unix.S_IFMT == unix.S_IFDIR {
		hp := l.path + "/" + p
		e.opaque = layer.IsOpaque(hp)
		e.redirect = layer.Redirect(hp)
	}
	if frozen {
		l.entsMu.Lock()
		if l.ents == nil || len(l.ents) > 1<<17 {
			l.ents = map[string]*layerEnt{} // bound memory
		}
		l.ents[p] = e
		l.entsMu.Unlock()
	}
	return e
}

// stack is an immutable description of a view: a writable upper over
// frozen store layers over external lowers.
type stack struct {
	upper  *layerDir
	frozen []*layerDir // bottom first
	lowers []*layerDir // external, topmost first
	top    []*layerDir // every layer, top-down: upper, frozen (top first), lowers
	base   string      // checkpoint id the view was last checkpointed/switched to
}

func newStack(upper *layerDir, frozen, lowers []*layerDir, base string) *stack {
	s := &stack{upper: upper, frozen: frozen, lowers: lowers, base: base}
	s.top = append(s.top, upper)
	for i := len(frozen) - 1; i >= 0; i-- {
		s.top = append(s.top, frozen[i])
	}
	s.top = append(s.top, lowers...)
	return s
}

func (s *stack) frozenIDs() []string {
	ids := make([]string, len(s.frozen))
	for i, l := range s.frozen {
		ids[i] = l.id
	}
	return ids
}

func (s *stack) lowerPaths() []string {
	ps := make([]string, len(s.lowers))
	for i, l := range s.lowers {
		ps[i] = l.path
	}
	return ps
}

// layers is the registry of the layer directories of one FS, so that the
// same layer in two stacks is the same *layerDir (inode keys stay stable,
// and what a frozen layer's caches and walk learnt is kept).
//
// A layerDir's descriptor is open only while the layer is referenced: by
// the current stack, or by a user outside f.mu (a compaction merging it).
// A layer a switch leaves stays registered without a descriptor, because a
// tree search often switches back to it; it is opened again then. The
// registry forgets such idle layers once their directories are gone (the
// store's GC removed them: prune) or when the mount discards them itself
// (forget): a mount that restores thousands of times keeps only the
// descriptors of its current stack.
type layers struct {
	mu   sync.Mutex
	byID map[string]*layerDir
	// pruneAt is the registry size at which prune next looks for idle
	// layers that are gone.
	pruneAt int
	// lowers, if set, holds the caches of external lowers.
	lowers *LowerCache
}

// pruneMin is the smallest registry size at which prune looks for idle
// layers that are gone; past it, it looks again each time the registry
// has doubled, so that its stat calls cost O(1) per registered layer.
const pruneMin = 64

// regKey is the registry key of store layer id, or, with id "", of the
// external lower directory p.
func regKey(id, p string) string {
	if id == "" {
		return "ext:" + p
	}
	return id
}

// open returns the layer at p (store layer id, or an external lower when
// id is "") with a reference for the caller, which releases it. A layer no
// one references is opened again; if its path now holds another directory
// it gets a new layerDir (nothing cached about the old one holds).
func (r *layers) open(id, p string) (*layerDir, error) {
	key := regKey(id, p)
	r.mu.Lock()
	defer r.mu.Unlock()
	l := r.byID[key]
	if l != nil && l.refs > 0 {
		l.refs++
		return l, nil
	}
	fd, err := openLayerRoot(id, p)
	if err != nil {
		return nil, fmt.Errorf("open layer %s: %w", p, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		unix.Close(fd)
		return nil, fmt.Errorf("open layer %s: %w", p, err)
	}
	if l == nil || l.dev != st.Dev || l.ino != st.Ino {
		l = &layerDir{id: id, path: p, cache: &dirCache{}, dev: st.Dev, ino: st.Ino}
		if id == "" {
			l.cache = r.lowers.forDir(fd)
		}
		r.byID[key] = l
	}
	l.fd, l.refs = fd, 1
	return l, nil
}

// openLayerRoot opens the root of the layer at p. An external lower (id
// "") is opened as a detached, non-recursive clone of its mount
// (open_tree(2) OPEN_TREE_CLONE): lookups beneath it never cross into a
// mount below p, as overlayfs never does in a lower layer, so a base (the
// host's root, given as "/") shows no other file system mounted under it,
// and no other mount of the daemon's state dir (another daemon's bind of
// "/", a container's) that the sandbox's masks, which go by path, would
// miss. Without the privilege to clone a mount it is opened as it is.
func openLayerRoot(id, p string) (int, error) {
	if id == "" {
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
		switch {
		case err == nil:
			var st unix.Stat_t
			if err := unix.Fstat(fd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFDIR {
				unix.Close(fd)
				return -1, unix.ENOTDIR
			}
			return fd, nil
		case !errors.Is(err, unix.EPERM) && !errors.Is(err, unix.ENOSYS):
			return -1, err
		}
	}
	return unix.Open(p, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
}

// ref adds a reference to each of ls, which the caller already holds
// (directly or through the current stack, under f.mu) and which it
// releases when done.
func (r *layers) ref(ls ...*layerDir) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, l := range ls {
		l.refs++
	}
}

// release drops a reference to each of ls; a layer's descriptor is closed
// with its last reference.
func (r *layers) release(ls ...*layerDir) {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, l := range ls {
		if l.refs <= 0 {
			continue // closed by closeAll (an unmount) already
		}
		if l.refs--; l.refs == 0 {
			unix.Close(l.fd)
			l.fd = -1
		}
	}
}

// has reports whether store layer id is open (referenced).
func (r *layers) has(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	l := r.byID[id]
	return l != nil && l.refs > 0
}

// forget removes l from the registry: the mount is discarding the layer.
// Its descriptor stays open until its last reference is released. It
// reports whether l was registered.
func (r *layers) forget(l *layerDir) bool {
	r.mu.Lock()
	key := regKey(l.id, l.path)
	mine := r.byID[key] == l
	if mine {
		delete(r.byID, key)
	}
	r.mu.Unlock()
	if mine {
		l.dropCaches()
	}
	return mine
}

// prune forgets the idle layers (no references) whose directories are
// gone, once the registry has grown enough since it last looked
// (pruneMin), and returns them. Called off the critical paths (the
// background worker).
func (r *layers) prune() []*layerDir {
	r.mu.Lock()
	if len(r.byID) < max(r.pruneAt, pruneMin) {
		r.mu.Unlock()
		return nil
	}
	var idle []*layerDir
	for _, l := range r.byID {
		if l.refs == 0 {
			idle = append(idle, l)
		}
	}
	r.mu.Unlock()
	var gone []*layerDir
	for _, l := range idle {
		// A directory that cannot be looked at is forgotten too: if it
		// is still a layer, the next open registers it afresh.
		var st unix.Stat_t
		if unix.Stat(l.path, &st) != nil || st.Dev != l.dev || st.Ino != l.ino {
			gone = append(gone, l)
		}
	}
	var dropped []*layerDir
	r.mu.Lock()
	for _, l := range gone {
		if key := regKey(l.id, l.path); l.refs == 0 && r.byID[key] == l {
			delete(r.byID, key)
			dropped = append(dropped, l)
		}
	}
	r.pruneAt = 2 * len(r.byID)
	r.mu.Unlock()
	for _, l := range dropped {
		l.dropCaches()
	}
	return dropped
}

// dropCaches frees what l caches about a layer the registry forgot (the
// layerDir itself may live on as an inode key).
func (l *layerDir) dropCaches() {
	l.entsMu.Lock()
	l.ents = nil
	l.entsMu.Unlock()
	l.touchedMu.Lock()
	l.touched = nil
	l.touchedMu.Unlock()
	if c := l.cache; !c.shared {
		c.mu.Lock()
		c.idx = nil
		c.mu.Unlock()
	}
}

// closeAll closes every descriptor and empties the registry (unmount).
func (r *layers) closeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, l := range r.byID {
		if l.refs > 0 {
			unix.Close(l.fd)
			l.fd, l.refs = -1, 0
		}
		delete(r.byID, k)
	}
}

// src is one layer holding an entry, and the entry's path in that layer.
type src struct {
	l    *layerDir
	path string // relative to the layer root; "." for the root
}

// entry is the resolution of a name in a view.
type entry struct {
	srcs []src // top-down; non-directories have exactly one
	st   unix.Stat_t
}

func (e *entry) isDir() bool { return e.st.Mode&unix.S_IFMT == unix.S_IFDIR }

func join(dir, name string) string {
	if dir == "." || dir == "" {
		return name
	}
	return dir + "/" + name
}

// hasName reports whether frozen layer l may hold dir/name, using a cached
// listing of dir. It returns true when unsure.
func (l *layerDir) hasName(dir, name string) bool {
	c := l.cache
	c.mu.Lock()
	li, ok := c.idx[dir]
	c.mu.Unlock()
	if ok && (!c.shared || time.Since(li.checked) < lowerRecheck) {
		return li.names[name]
	}
	var st unix.Stat_t
	if c.shared {
		// The directory as it is now; a missing one is looked up as
		// before (the listing says so).
		if unix.Fstatat(l.fd, dir, &st, unix.AT_SYMLINK_NOFOLLOW) != nil {
			st = unix.Stat_t{}
		}
		if ok && li.ctime == st.Ctim {
			c.recheck(dir, li)
			return li.names[name]
		}
	}
	// Read without the lock: the cache may serve many mounts, and a
	// large directory takes a while.
	li = listing{names: map[string]bool{}, ctime: st.Ctim, checked: time.Now()}
	fd, err := openBeneath(l.fd, dir, unix.O_RDONLY|unix.O_DIRECTORY, 0)
	if err != nil {
		if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
			c.put(dir, li)
			return false
		}
		return true
	}
	ents, err := readDirNames(fd)
	unix.Close(fd)
	if err != nil {
		return true
	}
	for _, n := range ents {
		li.names[n] = true
	}
	c.put(dir, li)
	return li.names[name]
}

// recheck notes that listing li of dir was found current now.
func (c *dirCache) recheck(dir string, li listing) {
	li.checked = time.Now()
	c.mu.Lock()
	defer c.mu.Unlock()
	if cur, ok := c.idx[dir]; ok && cur.ctime == li.ctime {
		c.idx[dir] = li
	}
}

// put stores the listing of dir, unless the cache is shared and dir
// changed too recently to tell a later change by its ctime.
func (c *dirCache) put(dir string, li listing) {
	if c.shared && time.Since(time.Unix(li.ctime.Unix())) < racyListing {
		return
	}
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.idx == nil || len(c.idx) > 65536 {
		c.idx = map[string]listing{} // bound memory; rebuilt on demand
	}
	c.idx[dir] = li
}

// lookupEntry resolves name in the directory whose sources are psrcs (a
// resolution in stack st) and whose view path is pvpath. With skipUpper the
// upper layer is ignored (used to decide whether a whiteout is needed).
func lookupEntry(st *stack, psrcs []src, pvpath, name string, skipUpper bool) (entry, bool, error) {
	var e entry
	found := false
	redirect := ""    // absolute path (relative to the layer root) in lower layers
	relRedirect := "" // a same-directory rename: the name in lower layers
	stopNext := false
	pi := 0
	for _, l := range st.top {
		var pp string
		hasParent := pi < len(psrcs) && psrcs[pi].l == l
		if hasParent {
			pp = psrcs[pi].path
			if l == st.upper {
				pp = pvpath
			}
			pi++
		}
		if skipUpper && l == st.upper {
			continue
		}
		if stopNext {
			break
		}
		var p string
		switch {
		case redirect != "":
			p = redirect
			// Redirects and opaque directories on the way to p in this
			// layer apply to the layers below it, as in overlayfs.
			redirect, stopNext = mapAncestors(l, p, l != st.upper)
		case !hasParent:
			continue
		case relRedirect != "":
			p = join(pp, relRedirect)
		default:
			p = join(pp, name)
		}
		if l != st.upper && redirect == "" {
			dir := path.Dir(p)
			if !l.hasName(dir, path.Base(p)) {
				continue
			}
		}
		le := l.stat(p, l != st.upper)
		err := le.err
		if err == unix.ENOENT || err == unix.ENOTDIR {
			continue
		}
		if err != nil {
			return e, false, err
		}
		s := le.st
		if layer.IsWhiteout(&s) {
			break
		}
		isDir := s.Mode&unix.S_IFMT == unix.S_IFDIR
		if !found {
			found = true
			e.st = s
			e.srcs = []src{{l, p}}
			if !isDir {
				break
			}
		} else {
			if !isDir {
				break
			}
			e.srcs = append(e.srcs, src{l, p})
		}
		if l == st.top[len(st.top)-1] {
			break
		}
		if le.opaque {
			break
		}
		if r := le.redirect; r != "" {
			if strings.HasPrefix(r, "/") {
				redirect = path.Clean(strings.TrimPrefix(r, "/"))
				if redirect == "" || redirect == "." || strings.HasPrefix(redirect, "../") {
					return e, false, fmt.Errorf("bad redirect %q in layer %s: %w", r, l.path, layer.ErrCorrupt)
				}
			} else if !strings.Contains(r, "/") && r != ".." && r != "." {
				relRedirect = r
			}
		}
	}
	if found && len(e.srcs) > 1 {
		// A merged directory: its topmost layer's link count counts only
		// that layer's subdirectories (2 for an upper made by a chmod),
		// so it says 1, "unknown", as overlayfs does for one, which
		// tools take as "do not count on it" rather than as "no
		// subdirectories".
		e.st.Nlink = 1
	}
	return e, found, nil
}

// readMerged lists the merged content of a directory with sources srcs:
// names in first-seen order with their type and the key of the top entry.
type mergedEnt struct {
	name string
	mode uint32
	l    *layerDir
	ino  uint64
}

func readMerged(st *stack, srcs []src, vpath string) ([]mergedEnt, error) {
	seen := map[string]bool{}
	var out []mergedEnt
	for _, s := range srcs {
		p := s.path
		if s.l == st.upper {
			p = vpath
		}
		fd, err := openBeneath(s.l.fd, p, unix.O_RDONLY|unix.O_DIRECTORY, 0)
		if err != nil {
			if err == unix.ENOENT {
				continue
			}
			return nil, err
		}
		ents, err := readDirEnts(fd)
		if err != nil {
			unix.Close(fd)
			return nil, err
		}
		for _, d := range ents {
			if seen[d.name] {
				continue
			}
			seen[d.name] = true
			if d.typ == unix.DT_CHR {
				var cs unix.Stat_t
				if unix.Fstatat(fd, d.name, &cs, unix.AT_SYMLINK_NOFOLLOW) == nil && layer.IsWhiteout(&cs) {
					continue
				}
			}
			out = append(out, mergedEnt{name: d.name, mode: dtToMode(d.typ), l: s.l, ino: d.ino})
		}
		unix.Close(fd)
	}
	return out, nil
}

func dtToMode(t uint8) uint32 {
	switch t {
	case unix.DT_DIR:
		return unix.S_IFDIR
	case unix.DT_LNK:
		return unix.S_IFLNK
	case unix.DT_CHR:
		return unix.S_IFCHR
	case unix.DT_BLK:
		return unix.S_IFBLK
	case unix.DT_FIFO:
		return unix.S_IFIFO
	case unix.DT_SOCK:
		return unix.S_IFSOCK
	}
	return unix.S_IFREG
}

type dirent struct {
	name string
	typ  uint8
	ino  uint64
}

func readDirEnts(fd int) ([]dirent, error) {
	var out []dirent
	buf := make([]byte, 32<<10)
	for {
		n, err := unix.Getdents(fd, buf)
		if err == unix.EINTR {
			continue
		}
		if err != nil {
			return nil, err
		}
		if n <= 0 {
			return out, nil
		}
		b := buf[:n]
		for len(b) > 0 {
			reclen := int(b[16]) | int(b[17])<<8
			ino := uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
				uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
			typ := b[18]
			nb := b[19:reclen]
			end := 0
			for end < len(nb) && nb[end] != 0 {
				end++
			}
			name := string(nb[:end])
			b = b[reclen:]
			if name == "." || name == ".." {
				continue
			}
			out = append(out, dirent{name: name, typ: typ, ino: ino})
		}
	}
}

func readDirNames(fd int) ([]string, error) {
	ents, err := readDirEnts(fd)
	if err != nil {
		return nil, err
	}
	names := make([]string, len(ents))
	for i, e := range ents {
		names[i] = e.name
	}
	return names, nil
}

// openBeneath opens p beneath the layer root dirfd, never following a
// symlink or magic link and never escaping the root.
func openBeneath(dirfd int, p string, flags int, mode uint32) (int, error) {
	how := unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC | unix.O_NOFOLLOW),
		Mode:    uint64(mode),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	}
	if flags&(unix.O_CREAT|unix.O_TMPFILE) == 0 {
		how.Mode = 0
	}
	for {
		fd, err := unix.Openat2(dirfd, p, &how)
		if err == unix.EINTR || err == unix.EAGAIN {
			continue
		}
		return fd, err
	}
}

// mapAncestors returns where path p of layer l continues in the layers
// below l: a redirect on an ancestor directory of p in l rewrites the
// prefix (the deepest one wins); an opaque ancestor or a whiteout on the
// way stops the descent.
func mapAncestors(l *layerDir, p string, frozen bool) (string, bool) {
	comps := splitPath(p)
	orig, mapped := "", ""
	for i, c := range comps {
		orig, mapped = join(orig, c), join(mapped, c)
		if i == len(comps)-1 {
			break
		}
		le := l.stat(orig, frozen)
		if le.err != nil {
			// Not in this layer: deeper components are not either.
			return join(mapped, strings.Join(comps[i+1:], "/")), false
		}
		if layer.IsWhiteout(&le.st) || le.st.Mode&unix.S_IFMT != unix.S_IFDIR || le.opaque {
			return p, true
		}
		if r := le.redirect; r != "" {
			if strings.HasPrefix(r, "/") {
				mapped = path.Clean(strings.TrimPrefix(r, "/"))
			} else if !strings.Contains(r, "/") {
				mapped = join(path.Dir(mapped), r)
			}
		}
	}
	return mapped, false
}
