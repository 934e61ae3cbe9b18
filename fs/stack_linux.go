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
	fd   int // O_PATH directory fd of the layer root

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

// layers is the registry of open layer directories of one FS, so that the
// same layer in two stacks is the same *layerDir (inode keys stay stable).
type layers struct {
	mu   sync.Mutex
	byID map[string]*layerDir
	// lowers, if set, holds the caches of external lowers.
	lowers *LowerCache
}

func (r *layers) open(id, p string) (*layerDir, error) {
	key := id
	if key == "" {
		key = "ext:" + p
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	if l := r.byID[key]; l != nil {
		return l, nil
	}
	fd, err := unix.Open(p, unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open layer %s: %w", p, err)
	}
	l := &layerDir{id: id, path: p, fd: fd, cache: &dirCache{}}
	if id == "" {
		l.cache = r.lowers.forDir(fd)
	}
	r.byID[key] = l
	return l, nil
}

func (r *layers) has(id string) bool {
	r.mu.Lock()
	defer r.mu.Unlock()
	return r.byID[id] != nil
}

func (r *layers) drop(l *layerDir) {
	r.mu.Lock()
	defer r.mu.Unlock()
	key := l.id
	if key == "" {
		key = "ext:" + l.path
	}
	if r.byID[key] == l {
		delete(r.byID, key)
		unix.Close(l.fd)
	}
}

func (r *layers) closeAll() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for k, l := range r.byID {
		unix.Close(l.fd)
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
