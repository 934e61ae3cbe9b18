package kernelpath

import (
	"encoding/binary"
	"errors"
	"fmt"
	"os"
	"strconv"
	"strings"
	"unsafe"

	"golang.org/x/sys/unix"
)

// Change tracking of the live upper. A stock-kernel checkpoint must find the
// entries of the upper changed since the previous checkpoint; walking the
// whole upper costs 31-37 ms at 10k files. Instead a fanotify group watches
// every directory of the upper (an inode mark with FAN_EVENT_ON_CHILD: the
// marks cover this upper only, not the state dir's other layers or other
// sandboxes' uppers, which a FAN_MARK_FILESYSTEM mark would report too).
// overlayfs performs every change of the view on the upper's inodes with
// the ordinary VFS calls, so creates, deletes, renames (copy-up and
// whiteouts arrive as renames from the work dir), writes, truncates,
// attribute and xattr changes and opens of the upper's files raise events
// there. Events report the parent directory's file handle and the name
// (FAN_REPORT_DFID_NAME); the tracker maps the handles of the marked
// directories to their paths. A checkpoint then visits only the names
// named by events (and the directories on their paths), with the same
// per-entry rules as the walk (freeze_inc_linux.go), so the delta is the
// one the walk would write. The per-turn effect report (TakeFSEffects,
// effects_linux.go) keeps its own set of names, since its own baseline,
// the same way.
//
// The tracked freeze falls back to the full walk for one checkpoint, never
// to a guess, when the events may not name every change:
//
//   - the queue overflowed (FAN_Q_OVERFLOW) or could not be read;
//   - an event names a directory handle the tracker does not know;
//   - a directory was renamed (its whole subtree moves: every path below
//     changes), or a known directory shows up at another path;
//   - an entry with more than one link (other than overlayfs's shared
//     whiteouts) was touched or found in a new directory: its other names
//     change too and raise no event; and any event for a file ever seen
//     with other names, or whose removed name left it alive: overlayfs
//     (index=off) reports changes through a surviving name under the
//     first name looked up, even once that name is gone;
//   - a directory could not be marked (the walk marks it again).
//
// A hard link made and then removed again in a directory created since the
// last checkpoint (not watched yet) changes only the ctime of the file's
// other name, which no frozen layer keeps (a copy has its own ctime): the
// walk copies that file again, the tracker does not.
//
// Writes through a shared writable mapping raise no event. The walk sees
// them only through the mtime that a write fault sets, and so does the
// tracker, provided it looks at the file: every file opened since the last
// checkpoint is visited, and every regular file visited is tested for
// writers (a read lease fails while anyone holds the file open for write,
// which a writable mapping does until it is unmapped); files still open
// for write are visited again at every checkpoint until they are closed.
type tracker struct {
	fan      int
	root     int    // the upper's root directory (open_by_handle_at's mount fd)
	rootPath string // its path as /proc/self/fd shows it
	pid      int32

	dirs  map[string]trackedDir // handle key -> marked directory
	byIno map[uint64]string     // directory inode -> handle key

	// From the events drained since the last checkpoint.
	dirty  map[string]map[string]uint8 // directory path -> names -> flags (nameOpened)
	broken string                      // why the next checkpoint must walk ("" = it need not)
	// allLeases: after an overflow the opens are unknown; the walk tests
	// every regular file for writers.
	allLeases bool

	// opened are the regular files (and others) opened since the last
	// checkpoint, by handle: a walk after directory renames finds them
	// whatever their path now.
	opened map[string]unix.FileHandle
	// created are the non-directories created since the last checkpoint,
	// by handle: a hard link made and removed again changes the other
	// name's ctime and nothing else raises an event there, so the
	// checkpoint visits every created inode still in the upper wherever
	// it is (usually at the name created).
	created map[string]unix.FileHandle
	// writers are the files open for write at the last checkpoint.
	writers map[string]unix.FileHandle
	// linked are the files seen with other names since the upper was
	// mounted (by handle key). overlayfs (index=off) keeps one upper
	// dentry per inode, the first name looked up: once that name is
	// removed, changes through the other names raise events under the
	// removed one. Every event for such a file makes the checkpoint walk.
	linked map[string]struct{}

	// The same since the last effect report (TakeFSEffects), whose
	// baseline is its own: names, created files, why it must walk.
	eff        map[string]map[string]uint8
	effCreated map[string]unix.FileHandle
	effBroken  string

	// pendingCreate is a regular file's CREATE event not (yet) followed by
	// the OPEN of the same open(2); linkSuspects are the files created
	// otherwise (link(2), mknod): see findLinks.
	pendingCreate string
	pendingHandle unix.FileHandle
	linkSuspects  map[string]unix.FileHandle

	buf []byte
	// failMark makes watching the directory at this path fail (tests).
	failMark string
}

type trackedDir struct {
	path string
	ino  uint64
}

// nameOpened flags a name opened since the last checkpoint.
const nameOpened = 1

const trackMask = unix.FAN_CREATE | unix.FAN_DELETE | unix.FAN_MOVED_FROM | unix.FAN_MOVED_TO |
	unix.FAN_MODIFY | unix.FAN_ATTRIB | unix.FAN_CLOSE_WRITE | unix.FAN_OPEN |
	unix.FAN_ONDIR | unix.FAN_EVENT_ON_CHILD

// errNeedWalk aborts a tracked freeze: the events do not describe every
// change, the full walk must run.
var errNeedWalk = errors.New("tracked freeze needs the full walk")

// newTracker starts watching the upper at upperPath; its directories are
// marked by the first freeze (a walk), so until then the tracker asks for
// one.
func newTracker(upperPath string) (*tracker, error) {
	flags := uint(unix.FAN_CLASS_NOTIF | unix.FAN_REPORT_DFID_NAME | unix.FAN_REPORT_FID | unix.FAN_REPORT_TARGET_FID | unix.FAN_NONBLOCK | unix.FAN_CLOEXEC)
	fan, err := unix.FanotifyInit(flags|unix.FAN_UNLIMITED_MARKS, unix.O_RDONLY|unix.O_CLOEXEC)
	if errors.Is(err, unix.EPERM) {
		fan, err = unix.FanotifyInit(flags, unix.O_RDONLY|unix.O_CLOEXEC)
	}
	if err != nil {
		return nil, fmt.Errorf("fanotify_init: %w", err)
	}
	root, err := unix.Open(upperPath, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(fan)
		return nil, fmt.Errorf("open upper: %w", err)
	}
	rootPath, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(root))
	if err != nil {
		unix.Close(fan)
		unix.Close(root)
		return nil, fmt.Errorf("upper path: %w", err)
	}
	t := &tracker{fan: fan, root: root, rootPath: rootPath, pid: int32(os.Getpid()),
		dirs: map[string]trackedDir{}, byIno: map[uint64]string{}, dirty: map[string]map[string]uint8{},
		eff: map[string]map[string]uint8{}, effCreated: map[string]unix.FileHandle{},
		linked: map[string]struct{}{}, linkSuspects: map[string]unix.FileHandle{}, opened: map[string]unix.FileHandle{}, created: map[string]unix.FileHandle{}, writers: map[string]unix.FileHandle{}, broken: "no walk yet", buf: make([]byte, 64<<10)}
	// Mark the root now: opens and changes before the first checkpoint
	// are then seen (the first freeze walks anyway).
	var st unix.Stat_t
	if err := unix.Fstat(root, &st); err != nil {
		t.close()
		return nil, fmt.Errorf("stat upper: %w", err)
	}
	if _, err := t.enter(root, "", st.Ino); err != nil {
		t.close()
		return nil, err
	}
	return t, nil
}

func (t *tracker) close() {
	unix.Close(t.fan)
	unix.Close(t.root)
}

func handleKey(typ int32, b []byte) string {
	k := make([]byte, 8+len(b))
	binary.LittleEndian.PutUint32(k, uint32(len(b)))
	binary.LittleEndian.PutUint32(k[4:], uint32(typ))
	copy(k[8:], b)
	return string(k)
}

// enter marks the directory fd at path p (before the caller reads it, so
// that no change after the read goes unseen) and records its handle. It
// reports whether the directory was new to the tracker: opens of its files
// before now were not seen.
func (t *tracker) enter(fd int, p string, ino uint64) (fresh bool, err error) {
	if ino == 0 {
		var st unix.Stat_t
		if err := unix.Fstat(fd, &st); err != nil {
			return true, fmt.Errorf("watch /%s: %w", p, err)
		}
		ino = st.Ino
	}
	h, _, err := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH)
	if err != nil {
		return true, fmt.Errorf("watch /%s: name_to_handle_at: %w", p, err)
	}
	k := handleKey(h.Type(), h.Bytes())
	if d, ok := t.dirs[k]; ok {
		if d.path != p {
			t.dirs[k] = trackedDir{p, ino}
		}
		return false, nil
	}
	if p == t.failMark && p != "" {
		return true, fmt.Errorf("watch /%s: %w", p, unix.ENOSPC)
	}
	if err := unix.FanotifyMark(t.fan, unix.FAN_MARK_ADD, trackMask, fd, ""); err != nil {
		return true, fmt.Errorf("watch /%s: fanotify_mark: %w", p, err)
	}
	t.dirs[k] = trackedDir{p, ino}
	t.byIno[ino] = k
	return true, nil
}

// noteLinked records the file name in directory dirfd, seen with other
// names.
func (t *tracker) noteLinked(dirfd int, name string) {
	h, _, err := unix.NameToHandleAt(dirfd, name, 0)
	if err != nil {
		t.breakf("hard-linked file: name_to_handle_at: %v", err)
		return
	}
	t.linked[handleKey(h.Type(), h.Bytes())] = struct{}{}
}

// forget drops a directory removed from the upper.
func (t *tracker) forget(p string, ino uint64) {
	if k, ok := t.byIno[ino]; ok && t.dirs[k].path == p {
		delete(t.dirs, k)
		delete(t.byIno, ino)
	}
}

func (t *tracker) touch(dir, name string, flags uint8) {
	for _, set := range []map[string]map[string]uint8{t.dirty, t.eff} {
		m := set[dir]
		if m == nil {
			m = map[string]uint8{}
			set[dir] = m
		}
		m[name] |= flags
	}
}

func (t *tracker) breakf(format string, args ...any) {
	if t.broken == "" {
		t.broken = fmt.Sprintf(format, args...)
	}
	if t.effBroken == "" {
		t.effBroken = t.broken
	}
}

// drain reads every queued event.
func (t *tracker) drain() { t.read(false) }

// drainOwn reads every queued event and drops the plain opens by this
// process: they are the freeze's own reads and writer tests (the sandbox
// is frozen during a checkpoint). Checkpoint calls it last.
func (t *tracker) drainOwn() { t.read(true) }

func (t *tracker) read(dropOwn bool) {
	for {
		n, err := unix.Read(t.fan, t.buf)
		if errors.Is(err, unix.EAGAIN) {
			t.endCreate()
			return
		}
		if errors.Is(err, unix.EINTR) {
			continue
		}
		if err != nil || n <= 0 {
			t.breakf("reading events: %v", err)
			return
		}
		t.parse(t.buf[:n], dropOwn)
	}
}

func (t *tracker) parse(b []byte, dropOwn bool) {
	const metaLen = int(unsafe.Sizeof(unix.FanotifyEventMetadata{}))
	for len(b) >= metaLen {
		m := (*unix.FanotifyEventMetadata)(unsafe.Pointer(&b[0]))
		evLen := int(m.Event_len)
		if evLen < metaLen || evLen > len(b) {
			t.breakf("malformed event")
			return
		}
		t.event(m.Mask, m.Pid == t.pid && dropOwn, b[m.Metadata_len:evLen])
		b = b[evLen:]
	}
}

func (t *tracker) event(mask uint64, own bool, info []byte) {
	if mask&unix.FAN_Q_OVERFLOW != 0 {
		t.breakf("event queue overflow")
		t.allLeases = true
		return
	}
	if mask&^(unix.FAN_OPEN|unix.FAN_ONDIR) == 0 && (mask&unix.FAN_ONDIR != 0 || own) {
		// A directory opened (for reading: nothing changes), or our own
		// read of a file (a freeze, a writer test).
		return
	}
	var dir, name string
	var child []byte
	haveDir, unknown := false, false
	for len(info) >= 4 {
		typ, l := info[0], int(binary.LittleEndian.Uint16(info[2:]))
		if l < 20 || l > len(info) {
			t.breakf("malformed event record")
			return
		}
		hb := int(binary.LittleEndian.Uint32(info[12:]))
		if 20+hb > l {
			t.breakf("malformed file handle")
			return
		}
		key := info[12 : 20+hb]
		switch typ {
		case unix.FAN_EVENT_INFO_TYPE_DFID_NAME:
			d, ok := t.dirs[string(key)]
			if !ok && nameIn(info[20+hb:l]) == "." {
				// An event on a directory itself, reported through its
				// marked parent: a directory the tracker does not know is
				// new since the last checkpoint (every directory the last
				// checkpoint froze was watched) and is copied whole.
				return
			}
			if !ok {
				t.breakf("event for an unknown directory (mask %#x name %q)%s", mask, nameIn(info[20+hb:l]), t.debugHandle(info[12:20+hb]))
				unknown = true
				break
			}
			rest := info[20+hb : l]
			if i := indexNUL(rest); i >= 0 {
				rest = rest[:i]
			}
			dir, name, haveDir = d.path, string(rest), true
		case unix.FAN_EVENT_INFO_TYPE_FID:
			child = info[12 : 20+hb]
		}
		info = info[l:]
	}
	if unknown {
		// The walk this asks for still tests an opened file for writers.
		if len(child) >= 8 && mask&unix.FAN_OPEN != 0 && mask&unix.FAN_ONDIR == 0 {
			t.opened[string(child)] = unix.NewFileHandle(int32(binary.LittleEndian.Uint32(child[4:])), child[8:])
		}
		return
	}
	if !haveDir {
		t.breakf("event without a directory (mask %#x)", mask)
		return
	}
	if name == "." || name == "" {
		// An event on a marked directory itself: its entry in its parent.
		if dir != "" {
			t.touch(parentOf(dir), baseOf(dir), 0)
		}
		return
	}
	if strings.Contains(name, "/") {
		t.breakf("malformed name")
		return
	}
	if mask&unix.FAN_ONDIR != 0 && mask&unix.FAN_MOVED_FROM != 0 {
		// A directory moved away: out of the upper (overlayfs removes a
		// directory that covers a lower one by exchanging it with a
		// whiteout and deleting it in its work dir) is a delete; within
		// the upper its whole subtree changes paths: walk.
		if len(child) < 8 {
			t.breakf("directory /%s moved (no handle)", join(dir, name))
			return
		}
		_, inUpper, err := t.pathOf(unix.NewFileHandle(int32(binary.LittleEndian.Uint32(child[4:])), child[8:]))
		if err != nil || inUpper {
			t.breakf("directory /%s renamed", join(dir, name))
			return
		}
	}
	var flags uint8
	if mask&unix.FAN_OPEN != 0 && mask&unix.FAN_ONDIR == 0 {
		flags = nameOpened
	}
	if len(child) >= 8 && mask&unix.FAN_ONDIR == 0 {
		k := string(child)
		if t.pendingCreate != "" && !(k == t.pendingCreate && mask&unix.FAN_OPEN != 0) {
			t.endCreate()
		}
		if t.pendingCreate == k {
			t.pendingCreate = "" // open(O_CREAT)
		} else if mask&unix.FAN_CREATE != 0 && mask&unix.FAN_OPEN == 0 {
			t.pendingCreate, t.pendingHandle = k, unix.NewFileHandle(int32(binary.LittleEndian.Uint32(child[4:])), child[8:])
		}
		// (Recorded below all the same: a walk still tests the file for
		// writers.)
		if _, ok := t.linked[string(child)]; ok {
			t.breakf("event for /%s, a file that had other names", join(dir, name))
		}
		h := unix.NewFileHandle(int32(binary.LittleEndian.Uint32(child[4:])), child[8:])
		if flags != 0 {
			t.opened[string(child)] = h
		}
		if mask&unix.FAN_CREATE != 0 {
			t.created[string(child)] = h
			t.effCreated[string(child)] = h
		}
		if mask&unix.FAN_DELETE != 0 {
			// A name removed from a file that lives on: it had another.
			// (overlayfs's whiteouts all share one inode: not links.)
			if alive, err := t.aliveFile(h); err != nil || alive {
				t.linked[string(child)] = struct{}{}
				t.breakf("/%s removed, its file has other names", join(dir, name))
			}
		}
	}
	t.touch(dir, name, flags)
}

func indexNUL(b []byte) int {
	for i, c := range b {
		if c == 0 {
			return i
		}
	}
	return -1
}

func baseOf(p string) string {
	if i := strings.LastIndexByte(p, '/'); i >= 0 {
		return p[i+1:]
	}
	return p
}

// plan drains the events and returns the names to visit: each directory
// path maps to the names below it to look at (with their flags), the
// directories on the way included. It adds the files open for write at the
// last checkpoint. errNeedWalk (wrapped with the reason) when the events do
// not suffice.
func (t *tracker) plan() (map[string]map[string]uint8, error) {
	t.drain()
	t.findLinks()
	t.resolve(t.created)
	if t.broken != "" {
		return nil, fmt.Errorf("%w: %s", errNeedWalk, t.broken)
	}
	return closure(t.dirty), nil
}

// planEff is plan for the effect report (its own names since the last
// report); the checkpoint's names are left for the checkpoint.
func (t *tracker) planEff() (map[string]map[string]uint8, error) {
	t.drain()
	t.resolve(t.effCreated)
	if t.effBroken != "" {
		return nil, fmt.Errorf("%w: %s", errNeedWalk, t.effBroken)
	}
	return closure(t.eff), nil
}

// resolve names the writers of the last checkpoint and the files created
// wherever they are now.
func (t *tracker) resolve(created map[string]unix.FileHandle) {
	for k, h := range t.writers {
		p, ok, err := t.pathOf(h)
		switch {
		case err != nil:
			t.breakf("writer: %v", err)
		case !ok:
			delete(t.writers, k) // gone from the upper
		default:
			t.touch(parentOf(p), baseOf(p), nameOpened)
		}
	}
	for _, h := range created {
		p, ok, err := t.pathOf(h)
		switch {
		case err != nil:
			t.breakf("created file: %v", err)
		case ok:
			t.touch(parentOf(p), baseOf(p), 0)
		}
	}
}

// endCreate ends a pending CREATE: no OPEN of the same file followed.
func (t *tracker) endCreate() {
	if t.pendingCreate != "" {
		t.linkSuspects[t.pendingCreate] = t.pendingHandle
		t.pendingCreate = ""
	}
}

// findLinks finds the regular files created since the last checkpoint
// without being opened by the same call (a CREATE event not followed by
// that file's OPEN) and not copied up: made by link(2) (or mknod), so they
// have, or had, another name. (A link to a file copied up before is not
// told from a copy-up unless both names still exist.) If that name is then replaced (a rename over it) nothing
// else tells, and overlayfs reports changes through the new name under
// the replaced one; they are remembered as linked, and the checkpoint
// walks.
func (t *tracker) findLinks() {
	for k, h := range t.linkSuspects {
		delete(t.linkSuspects, k)
		if _, ok := t.linked[k]; ok {
			continue
		}
		fd, err := unix.OpenByHandleAt(t.root, h, unix.O_PATH|unix.O_CLOEXEC)
		if err != nil {
			continue // gone
		}
		var st unix.Stat_t
		err = unix.Fstat(fd, &st)
		// overlayfs copies a file up by linking an O_TMPFILE into the
		// upper (a CREATE without OPEN too, when a chmod, utimes or
		// truncate asked for the copy): those carry the origin xattr.
		_, oerr := unix.Getxattr("/proc/self/fd/"+strconv.Itoa(fd), "trusted.overlay.origin", nil)
		unix.Close(fd)
		if err == nil && st.Mode&unix.S_IFMT == unix.S_IFREG && st.Nlink > 0 && (oerr != nil || st.Nlink > 1) {
			t.linked[k] = struct{}{}
			t.breakf("a file created by link(2) (or mknod)")
		}
	}
}

// closure adds to the names of each directory those of the directories on
// the way to it.
func closure(names map[string]map[string]uint8) map[string]map[string]uint8 {
	todo := make(map[string]map[string]uint8, len(names))
	add := func(dir, name string, fl uint8) {
		m := todo[dir]
		if m == nil {
			m = map[string]uint8{}
			todo[dir] = m
		}
		m[name] |= fl
	}
	for dir, ns := range names {
		for name, fl := range ns {
			add(dir, name, fl)
		}
		for a := dir; a != ""; a = parentOf(a) {
			p, b := parentOf(a), baseOf(a)
			if _, ok := todo[p][b]; ok {
				break
			}
			add(p, b, 0)
		}
	}
	return todo
}

// effCommitted ends an effect report: its names are accounted for.
func (t *tracker) effCommitted() {
	t.eff = map[string]map[string]uint8{}
	t.effCreated = map[string]unix.FileHandle{}
	t.effBroken = ""
}

// pathOf finds the path of a file of the upper by its handle: ok false if
// it is no longer in the upper.
func (t *tracker) pathOf(h unix.FileHandle) (string, bool, error) {
	fd, err := unix.OpenByHandleAt(t.root, h, unix.O_PATH|unix.O_CLOEXEC)
	if errors.Is(err, unix.ESTALE) || errors.Is(err, unix.ENOENT) {
		return "", false, nil
	}
	if err != nil {
		return "", false, fmt.Errorf("open_by_handle_at: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return "", false, err
	}
	if st.Nlink == 0 {
		return "", false, nil
	}
	p, err := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	if err != nil {
		return "", false, err
	}
	rel, ok := strings.CutPrefix(p, t.rootPath+"/")
	if !ok {
		return "", false, nil // moved out of the upper (into overlayfs's work dir)
	}
	return rel, true, nil
}

// aliveFile reports whether the file h still has a name (whiteouts
// excepted).
func (t *tracker) aliveFile(h unix.FileHandle) (bool, error) {
	fd, err := unix.OpenByHandleAt(t.root, h, unix.O_PATH|unix.O_CLOEXEC)
	if errors.Is(err, unix.ESTALE) || errors.Is(err, unix.ENOENT) {
		return false, nil
	}
	if err != nil {
		return false, fmt.Errorf("open_by_handle_at: %w", err)
	}
	defer unix.Close(fd)
	var st unix.Stat_t
	if err := unix.Fstat(fd, &st); err != nil {
		return false, err
	}
	return st.Nlink > 0 && !fpOf(&st).isWhiteout(), nil
}

// leaseBusy reports whether the regular file name in directory dirfd is
// open for write by anyone (a read lease fails then). It opens the file
// read-only and non-blocking: that breaks no lease of the sandbox's.
func leaseBusy(dirfd int, name string) (busy bool, fd int, err error) {
	flags := unix.O_RDONLY | unix.O_NONBLOCK | unix.O_CLOEXEC | unix.O_NOCTTY
	if dirfd != unix.AT_FDCWD {
		flags |= unix.O_NOFOLLOW // (a /proc/self/fd link is followed on purpose)
	}
	fd, err = unix.Openat(dirfd, name, flags, 0)
	if err != nil {
		return true, -1, err
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_RDLCK); err != nil {
		return true, fd, nil
	}
	_, _ = unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_UNLCK)
	return false, fd, nil
}

// leases collects, during one freeze, the files found open for write.
type leases struct {
	t       *tracker
	writers map[string]unix.FileHandle
	err     error
}

// check tests the regular file name (path p) in directory dirfd.
func (l *leases) check(dirfd int, name, p string) {
	busy, fd, err := leaseBusy(dirfd, name)
	if fd >= 0 {
		defer unix.Close(fd)
	}
	if errors.Is(err, unix.ENOENT) {
		return
	}
	if !busy {
		return
	}
	if fd < 0 {
		if l.err == nil {
			l.err = fmt.Errorf("writer test /%s: %w", p, err)
		}
		return
	}
	l.busy(fd, p)
}

// checkFD tests the open regular file fd (path p) for writers. The lease
// it takes is left for the close of fd to release (one system call less
// per file): the caller closes fd inside the freeze window, before any
// process of the sandbox can open the file and wait for the lease's break.
func (l *leases) checkFD(fd int, p string) {
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_SETLEASE, unix.F_RDLCK); err == nil {
		return
	}
	l.busy(fd, p)
}

// busy records the file fd (path p) as open for write.
func (l *leases) busy(fd int, p string) {
	h, _, herr := unix.NameToHandleAt(fd, "", unix.AT_EMPTY_PATH)
	if herr != nil {
		if l.err == nil {
			l.err = fmt.Errorf("writer /%s: name_to_handle_at: %w", p, herr)
		}
		return
	}
	l.writers[handleKey(h.Type(), h.Bytes())] = h
}

// checkHandle tests the file h (opened since the last checkpoint or a
// writer then) after a walk, wherever it is now. Only regular files are
// opened for the test (an O_PATH descriptor first tells the type: a device
// node is never opened).
func (l *leases) checkHandle(h unix.FileHandle) {
	pfd, err := unix.OpenByHandleAt(l.t.root, h, unix.O_PATH|unix.O_CLOEXEC)
	if err != nil {
		if !errors.Is(err, unix.ESTALE) && !errors.Is(err, unix.ENOENT) && l.err == nil {
			l.err = fmt.Errorf("writer test: open_by_handle_at: %w", err)
		}
		return
	}
	defer unix.Close(pfd)
	var st unix.Stat_t
	if err := unix.Fstat(pfd, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink == 0 {
		return
	}
	l.check(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(pfd), "(by handle)")
}

// committed ends a checkpoint: the events drained are accounted for.
// broken is why the next checkpoint must walk ("" = it need not).
func (t *tracker) committed(l *leases, broken string) {
	t.dirty = map[string]map[string]uint8{}
	t.opened = map[string]unix.FileHandle{}
	t.created = map[string]unix.FileHandle{}
	t.broken, t.allLeases = broken, false
	if l != nil {
		t.writers = l.writers
		if l.err != nil && t.broken == "" {
			t.broken = l.err.Error()
		}
	}
}

func nameIn(b []byte) string {
	if i := indexNUL(b); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

func (t *tracker) debugHandle(k []byte) string {
	h := unix.NewFileHandle(int32(binary.LittleEndian.Uint32(k[4:])), k[8:])
	fd, err := unix.OpenByHandleAt(t.root, h, unix.O_PATH)
	if err != nil {
		return " " + err.Error()
	}
	defer unix.Close(fd)
	p, _ := os.Readlink("/proc/self/fd/" + strconv.Itoa(fd))
	return " at " + p
}
