package kernelpath

import (
	"errors"
	"fmt"
	"runtime"
	"strings"
	"sync"
	"sync/atomic"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// Deferred finishing of a freeze. A stock-kernel checkpoint runs inside
// the sandbox's freeze window, and most of its cost is writing the new
// layer: creating each copy's inode, its data, owner, mode, xattrs and
// times, and its name in the layer (an XFS directory insert and log commit
// per file). None of that needs the sandbox frozen, only the reading of the
// upper does. So by default (Options.SyncCheckpoint unset) the freeze reads
// inside the window everything the layer will hold, and queues the writes:
//
//   - a regular file up to smallFileXFS bytes: its data is read into memory
//     (at most maxDeferredBytes per checkpoint; beyond that the data is
//     copied into the layer file inside the window); a larger one is cloned
//     (or copied) into a pooled unnamed file, or a file created in the
//     layer, inside the window;
//   - the xattrs of every file and directory copied are read inside the
//     window;
//   - what is queued: creating or taking the layer file, writing the data,
//     owner, mode, xattrs, times and the name, the metadata of directories
//     (after their children: their times come last), hard links, and the
//     layer root's attributes.
//
// Checkpoint returns once the window's part is done; a goroutine runs the
// queue, then writes the checkpoint's record. Until then the store
// (layer.Store.BeginCheckpoint) makes readers of that checkpoint in this
// process wait, and every method of the FS that uses the frozen layers
// waits first (settle). If the queue fails the checkpoint is dropped: its
// record is never written, its readers get the error, the layer is left
// to GC, and the next checkpoint walks the upper (the tracker's names were
// consumed). A crash of the process before the record is written loses
// that checkpoint (the record is what makes a checkpoint exist), as it
// loses a template not yet dumped by CRIU; Options.SyncCheckpoint writes
// everything, and syncs, before Checkpoint returns.

// maxDeferredBytes bounds the file data one checkpoint holds in memory
// for its queue.
const maxDeferredBytes = 64 << 20

// finishQueue is the writes of one freeze into its new layer, in the
// order the freeze made them.
type finishQueue struct {
	// files are the regular files' copies (independent of each other);
	// ops the rest (directories' metadata, hard links), in the order
	// made, all after the files.
	files []func(b *copyBufs) error
	ops   []func(b *copyBufs) error
	fds   []int // fds the ops use, closed after them
	bytes int64 // file data held
}

func (q *finishQueue) add(op func(*copyBufs) error) { q.ops = append(q.ops, op) }

func (q *finishQueue) addFile(op func(*copyBufs) error) { q.files = append(q.files, op) }

// keep hands fd to the queue: it is closed once the ops have run.
func (q *finishQueue) keep(fd int) { q.fds = append(q.fds, fd) }

// take reserves n bytes of file data to hold (false: over the bound).
func (q *finishQueue) take(n int64) bool {
	if q.bytes+n > maxDeferredBytes {
		return false
	}
	q.bytes += n
	return true
}

// run writes the files' copies (on up to finishWorkers goroutines), then
// the other ops in order; the first error stops it. It closes the fds. A
// nil queue has nothing to do.
func (q *finishQueue) run() error {
	if q == nil {
		return nil
	}
	defer q.close()
	if err := runParallel(q.files, min(runtime.GOMAXPROCS(0), finishWorkers, 1+len(q.files)/16)); err != nil {
		return err
	}
	q.files = nil
	var b copyBufs
	for i, op := range q.ops {
		if err := op(&b); err != nil {
			return err
		}
		q.ops[i] = nil // its data can go
	}
	return nil
}

// finishWorkers bounds the goroutines writing one checkpoint's files.
const finishWorkers = 4

// runParallel runs ops on n goroutines and returns the first error (the
// others stop taking ops then).
func runParallel(ops []func(*copyBufs) error, n int) error {
	var next atomic.Int64
	var first atomic.Pointer[error]
	var wg sync.WaitGroup
	for range max(n, 1) {
		wg.Add(1)
		go func() {
			defer wg.Done()
			var b copyBufs
			for first.Load() == nil {
				i := int(next.Add(1)) - 1
				if i >= len(ops) {
					return
				}
				if err := ops[i](&b); err != nil {
					first.CompareAndSwap(nil, &err)
					return
				}
				ops[i] = nil // its data can go
			}
		}()
	}
	wg.Wait()
	if p := first.Load(); p != nil {
		return *p
	}
	return nil
}

// close closes the fds without running the ops (a failed freeze).
func (q *finishQueue) close() {
	if q == nil {
		return
	}
	for _, fd := range q.fds {
		unix.Close(fd)
	}
	q.files, q.ops, q.fds = nil, nil, nil
}

// xattr is one extended attribute read from the upper.
type xattr struct {
	name  string
	value []byte
}

// readXattrs reads the xattrs a copy keeps (keepXattr; none of
// overlayfs's with noOvl).
func (c *treeCopier) readXattrs(b *copyBufs, list func([]byte) (int, error), get func(string, []byte) (int, error)) ([]xattr, error) {
	if b.buf == nil {
		b.buf = make([]byte, 4096)
	}
	n, err := list(b.buf)
	if errors.Is(err, unix.ERANGE) {
		if n, err = list(nil); err == nil {
			b.buf = make([]byte, n*2)
			n, err = list(b.buf)
		}
	}
	if err != nil {
		if errors.Is(err, unix.ENOTSUP) {
			return nil, nil
		}
		return nil, fmt.Errorf("listxattr: %w", err)
	}
	if n == 0 {
		return nil, nil
	}
	var out []xattr
	for _, name := range strings.Split(strings.TrimRight(string(b.buf[:n]), "\x00"), "\x00") {
		if name == "" || !keepXattr(name) || c.noOvl && strings.HasPrefix(name, layer.XattrPrefixOverlay) {
			continue
		}
		val := make([]byte, 256)
		vn, err := get(name, val)
		if errors.Is(err, unix.ERANGE) {
			if vn, err = get(name, nil); err == nil {
				val = make([]byte, vn)
				vn, err = get(name, val)
			}
		}
		if errors.Is(err, unix.ENODATA) {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("getxattr %s: %w", name, err)
		}
		out = append(out, xattr{name, val[:vn]})
	}
	return out, nil
}

func setXattrs(xs []xattr, set func(string, []byte) error) error {
	for _, x := range xs {
		if err := set(x.name, x.value); err != nil {
			return fmt.Errorf("setxattr %s: %w", x.name, err)
		}
	}
	return nil
}

// captureFile is the window's part of the copy of regular file j in a
// deferred freeze: it queues the copy's writing, and reads the file's data
// (or clones it into its layer file) and xattrs and closes the source.
// (Reading the sources on a helper goroutine, as the XFS copies without
// deferral do, was measured slower: the hand-over costs more than the
// four system calls it moves.)
func (c *treeCopier) captureFile(j fileJob) error {
	lf := &lateFile{dir: j.dir, name: j.name, st: j.st, fd: -1}
	c.later.addFile(func(b *copyBufs) error {
		if err := c.finishLate(lf); err != nil {
			return fmt.Errorf("/%s: %w", j.rel, err)
		}
		return nil
	})
	return c.readSource(j, lf, &c.bufs)
}

// readSource fills lf from the source file j.sfd and closes it.
func (c *treeCopier) readSource(j fileJob, lf *lateFile, b *copyBufs) error {
	defer unix.Close(j.sfd)
	st := &lf.st
	xs, err := c.readXattrs(b,
		func(b []byte) (int, error) { return unix.Flistxattr(j.sfd, b) },
		func(n string, b []byte) (int, error) { return unix.Fgetxattr(j.sfd, n, b) })
	if err != nil {
		return err
	}
	lf.xattrs = xs
	q := c.later
	if st.Size <= smallFileXFS && q.take(st.Size) {
		data := make([]byte, st.Size)
		n := 0
		for n < len(data) {
			k, err := unix.Pread(j.sfd, data[n:], int64(n))
			if err != nil {
				return fmt.Errorf("read: %w", err)
			}
			if k == 0 {
				break // the source shrank (it cannot while frozen)
			}
			n += k
		}
		lf.data = data[:n]
		return nil
	}
	if err := c.openCopy(lf); err != nil {
		return err
	}
	q.keep(lf.fd)
	if st.Size > 0 {
		return c.copyData(j.sfd, lf.fd, st.Size, b)
	}
	return nil
}

// lateFile is a regular file's copy whose writing is queued.
type lateFile struct {
	dir    int
	name   string
	st     unix.Stat_t
	xattrs []xattr
	data   []byte // the data, when read into memory
	fd     int    // the layer file, when made inside the window (-1: not yet)
	pooled bool   // fd is a pooled unnamed file, named by finishLate
	chown  bool
	chmod  bool
}

// openCopy gives lf its layer file: a pooled unnamed file, or one created
// in its directory.
func (c *treeCopier) openCopy(lf *lateFile) error {
	st := &lf.st
	if t, ok := c.pool.get(); ok {
		lf.fd, lf.pooled = t.fd, true
		lf.chown = st.Uid != t.uid || st.Gid != t.gid
		lf.chmod = lf.chown || st.Mode&0o7777 != poolMode
		return nil
	}
	perm := st.Mode & 0o777
	fd, err := unix.Openat(lf.dir, lf.name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, perm)
	if err != nil {
		return err
	}
	lf.fd = fd
	lf.chown = st.Uid != c.uid || st.Gid != c.gid || c.parentSetgid(lf.dir)
	lf.chmod = lf.chown || st.Mode&0o7777 != perm&^c.umask
	return nil
}

// finishLate writes the queued part of lf's copy.
func (c *treeCopier) finishLate(lf *lateFile) error {
	if lf.fd < 0 {
		if err := c.openCopy(lf); err != nil {
			return err
		}
		defer unix.Close(lf.fd)
		for off := 0; off < len(lf.data); {
			n, err := unix.Pwrite(lf.fd, lf.data[off:], int64(off))
			if err != nil {
				return fmt.Errorf("write: %w", err)
			}
			off += n
		}
		lf.data = nil
	}
	st := &lf.st
	if lf.chown {
		if err := unix.Fchown(lf.fd, int(st.Uid), int(st.Gid)); err != nil {
			return fmt.Errorf("chown: %w", err)
		}
	}
	if lf.chmod {
		if err := unix.Fchmod(lf.fd, st.Mode&0o7777); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
	}
	fd := lf.fd
	if err := setXattrs(lf.xattrs, func(n string, b []byte) error { return unix.Fsetxattr(fd, n, b, 0) }); err != nil {
		return err
	}
	if err := futimens(lf.fd, st); err != nil {
		return err
	}
	if lf.pooled {
		return linkTmp(lf.fd, lf.dir, lf.name)
	}
	return nil
}

// deferMeta is copyMeta in a deferred freeze: the xattrs of sfd are read
// now, and the owner, mode, xattrs and times of dfd (which the queue keeps
// open) are written by the queue.
func (c *treeCopier) deferMeta(sfd, dfd int, st *unix.Stat_t) error {
	xs, err := c.readXattrs(&c.bufs,
		func(b []byte) (int, error) { return unix.Flistxattr(sfd, b) },
		func(n string, b []byte) (int, error) { return unix.Fgetxattr(sfd, n, b) })
	if err != nil {
		return err
	}
	s := *st
	c.later.add(func(*copyBufs) error {
		if err := unix.Fchown(dfd, int(s.Uid), int(s.Gid)); err != nil {
			return fmt.Errorf("chown: %w", err)
		}
		if err := unix.Fchmod(dfd, s.Mode&0o7777); err != nil {
			return fmt.Errorf("chmod: %w", err)
		}
		if err := setXattrs(xs, func(n string, b []byte) error { return unix.Fsetxattr(dfd, n, b, 0) }); err != nil {
			return err
		}
		return futimens(dfd, &s)
	})
	return nil
}

// closeDir closes a directory fd of the new layer, or hands it to the
// queue of a deferred freeze (its ops may use it).
func (c *treeCopier) closeDir(fd int) {
	if c.later != nil {
		c.later.keep(fd)
		return
	}
	unix.Close(fd)
}
