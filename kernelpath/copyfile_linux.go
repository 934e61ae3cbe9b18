package kernelpath

import (
	"errors"
	"fmt"
	"runtime"
	"strconv"
	"sync"

	"golang.org/x/sys/unix"
)

// The copy of a regular file into a frozen layer, the bulk of a stock-kernel
// checkpoint's cost. Measured on a loop XFS (100 files of 31 bytes into a
// new directory, one goroutine): the create of the copy alone (inode
// allocation, directory entry, log commit) costs 2.0-2.5 ms, the whole
// copy 3.9-4.5 ms. Two things take it down:
//
//   - the copies are made from a pool of unnamed files (O_TMPFILE) made
//     ahead, outside the sandbox's freeze window, in the store's work dir:
//     in the window a copy is data, metadata and one linkat(2) into the
//     layer (3.3-3.5 ms for the 100, the pool's inodes already allocated);
//   - the finishing of each copy (data, metadata, name) runs on helper
//     goroutines while the freeze goes on finding and opening the next
//     entries: 2.0-2.3 ms with two.
//
// In the kernel-path benchmarks (load 5-30 from other suites) a 100-entry
// checkpoint went from 5.2-5.5 to 3.3-4.0 ms p50 on XFS. Both are used on
// XFS only: on btrfs (every file cloned) they made it slower, 6.0 ms
// inline against 7.3 ms with the pool and 11-13 ms with a helper (btrfs's
// tree locks serialize the copies into one directory).
//
// The source is opened O_NOATIME: reading a file written since its last
// access otherwise updates its atime (relatime), one more log transaction
// on the upper per copy.

// copyBufs are one goroutine's buffers for file data and xattr lists.
type copyBufs struct {
	buf  []byte
	data []byte
}

// fileJob is a regular file whose source is open: what is left is its copy
// into the layer directory dir (which stays open until the copier's wait
// returns) under name.
type fileJob struct {
	sfd  int // owned by the job
	dir  int
	name string
	rel  string // for errors
	st   unix.Stat_t
}

// openSource opens the regular file name of the upper directory dir for a
// copy, without following a symlink and without touching its atime.
func openSource(dir int, name string) (int, error) {
	const flags = unix.O_RDONLY | unix.O_NOFOLLOW | unix.O_CLOEXEC
	fd, err := unix.Openat(dir, name, flags|unix.O_NOATIME, 0)
	if errors.Is(err, unix.EPERM) {
		// O_NOATIME needs ownership or CAP_FOWNER.
		fd, err = unix.Openat(dir, name, flags, 0)
	}
	return fd, err
}

// fileCopier finishes file copies, on helper goroutines when there are
// spare CPUs, with pooled unnamed files when the mount has a pool. A nil
// *fileCopier finishes every copy inline and creates its files.
type fileCopier struct {
	pool    *tmpPool
	helpers int
	jobs    chan fileJob
	started bool
	wg      sync.WaitGroup // jobs handed to helpers, not finished
	hwg     sync.WaitGroup // helper goroutines
	mu      sync.Mutex
	err     error // the first error of a helper's copy
}

// newFileCopier returns the copier of one freeze (pool may be nil).
func newFileCopier(pool *tmpPool) *fileCopier {
	return &fileCopier{pool: pool, helpers: min(runtime.GOMAXPROCS(0)-1, 3)}
}

// copy finishes j: on an idle helper if there is one, else inline (the
// freeze never waits for a helper to take a job).
func (f *fileCopier) copy(c *treeCopier, j fileJob) error {
	if f == nil {
		return c.finishFile(j, nil, &c.bufs)
	}
	if err := f.firstErr(); err != nil {
		unix.Close(j.sfd)
		return err
	}
	if f.helpers > 0 {
		if !f.started {
			f.start(c)
		}
		f.wg.Add(1)
		select {
		case f.jobs <- j:
			return nil
		default:
			f.wg.Done()
		}
	}
	return c.finishFile(j, f.pool, &c.bufs)
}

func (f *fileCopier) start(c *treeCopier) {
	f.started = true
	f.jobs = make(chan fileJob)
	for range f.helpers {
		f.hwg.Add(1)
		go func() {
			defer f.hwg.Done()
			var b copyBufs
			for j := range f.jobs {
				if err := c.finishFile(j, f.pool, &b); err != nil {
					f.mu.Lock()
					if f.err == nil {
						f.err = fmt.Errorf("/%s: %w", j.rel, err)
					}
					f.mu.Unlock()
				}
				f.wg.Done()
			}
		}()
	}
}

func (f *fileCopier) firstErr() error {
	f.mu.Lock()
	defer f.mu.Unlock()
	return f.err
}

// wait returns once every copy handed out is finished (and named in its
// directory), with the first error of one.
func (f *fileCopier) wait() error {
	if f == nil {
		return nil
	}
	f.wg.Wait()
	return f.firstErr()
}

// close waits for the copies and stops the helpers. The freeze calls it
// before it closes any directory fd a copy may use.
func (f *fileCopier) close() error {
	if f == nil {
		return nil
	}
	err := f.wait()
	if f.started {
		close(f.jobs)
		f.hwg.Wait()
		f.started = false
	}
	return err
}

// finishFile writes the copy of j: a pooled unnamed file (or a file created
// in j.dir) gets the data, owner, mode, xattrs and times of the source, then
// its name.
func (c *treeCopier) finishFile(j fileJob, pool *tmpPool, b *copyBufs) error {
	defer unix.Close(j.sfd)
	st := &j.st
	perm := st.Mode & 0o777
	var chown, chmod bool
	t, pooled := pool.get()
	dfd := t.fd
	if pooled {
		chown = st.Uid != t.uid || st.Gid != t.gid
		chmod = chown || st.Mode&0o7777 != poolMode
	} else {
		var err error
		dfd, err = unix.Openat(j.dir, j.name, unix.O_WRONLY|unix.O_CREAT|unix.O_EXCL|unix.O_NOFOLLOW|unix.O_CLOEXEC, perm)
		if err != nil {
			return err
		}
		// The file was created with our ids and perm &^ umask; fix only
		// what differs (setgid parents, special bits, other owners).
		chown = st.Uid != c.uid || st.Gid != c.gid || c.parentSetgid(j.dir)
		chmod = chown || st.Mode&0o7777 != perm&^c.umask
	}
	defer unix.Close(dfd)
	if st.Size > 0 {
		if err := c.copyData(j.sfd, dfd, st.Size, b); err != nil {
			return err
		}
	}
	if err := c.copyMetaOpt(j.sfd, dfd, st, chown, chmod, b); err != nil {
		return err
	}
	if pooled {
		return linkTmp(dfd, j.dir, j.name)
	}
	return nil
}

// linkTmp gives the unnamed file fd the name name in directory dir.
// linkat(2) keeps the file's mtime (only its ctime changes).
func linkTmp(fd, dir int, name string) error {
	err := unix.Linkat(fd, "", dir, name, unix.AT_EMPTY_PATH)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.EPERM) {
		// AT_EMPTY_PATH needs CAP_DAC_READ_SEARCH; the /proc link works
		// for the owner of the fd.
		err = unix.Linkat(unix.AT_FDCWD, "/proc/self/fd/"+strconv.Itoa(fd), dir, name, unix.AT_SYMLINK_FOLLOW)
	}
	if err != nil {
		return fmt.Errorf("link copy: %w", err)
	}
	return nil
}

// poolMode is the mode of pooled files (a copy with another mode is
// chmod'ed).
const poolMode = 0o644

// Pool sizes: the pool is refilled after every checkpoint to twice the
// regular files the checkpoint copied, within these bounds (each pooled
// file holds one fd and one allocated inode).
const (
	poolMin = 32
	poolMax = 128
)

// tmpPool holds unnamed files (O_TMPFILE) on the store's file system, made
// outside the freeze window, that file copies take instead of creating
// their files. Safe for concurrent use; a nil *tmpPool is empty.
type tmpPool struct {
	dir string // where the files are made (the store's work dir)

	mu       sync.Mutex
	files    []tmpFile
	taken    int  // files taken since the last refill
	want     int  // the size the refill makes
	off      bool // O_TMPFILE failed here, or closed
	running  bool
	refilled sync.WaitGroup
}

type tmpFile struct {
	fd       int
	uid, gid uint32
}

func newTmpPool(dir string) *tmpPool { return &tmpPool{dir: dir, want: poolMin} }

// get takes a pooled file.
func (p *tmpPool) get() (tmpFile, bool) {
	if p == nil {
		return tmpFile{fd: -1}, false
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.taken++
	if len(p.files) == 0 {
		return tmpFile{fd: -1}, false
	}
	t := p.files[len(p.files)-1]
	p.files = p.files[:len(p.files)-1]
	return t, true
}

// refill tops the pool up in the background (one refill at a time), sized
// by the files taken since the last refill.
func (p *tmpPool) refill() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.off || p.running {
		return
	}
	p.want = min(max(2*p.taken, poolMin, p.want/2), poolMax)
	p.taken = 0
	if len(p.files) >= p.want {
		return
	}
	p.running = true
	p.refilled.Add(1)
	go p.fill()
}

func (p *tmpPool) fill() {
	defer p.refilled.Done()
	for {
		p.mu.Lock()
		if p.off || len(p.files) >= p.want {
			p.running = false
			p.mu.Unlock()
			return
		}
		p.mu.Unlock()
		t, err := makeTmp(p.dir)
		p.mu.Lock()
		if err != nil || p.off {
			if err == nil {
				unix.Close(t.fd)
			}
			p.off = p.off || err != nil
			p.running = false
			p.mu.Unlock()
			return
		}
		p.files = append(p.files, t)
		p.mu.Unlock()
	}
}

// makeTmp makes one unnamed file of mode poolMode in dir.
func makeTmp(dir string) (tmpFile, error) {
	fd, err := unix.Open(dir, unix.O_TMPFILE|unix.O_RDWR|unix.O_CLOEXEC, 0o600)
	if err != nil {
		return tmpFile{}, fmt.Errorf("O_TMPFILE in %s: %w", dir, err)
	}
	var st unix.Stat_t
	err = unix.Fchmod(fd, poolMode)
	if err == nil {
		err = unix.Fstat(fd, &st)
	}
	if err != nil {
		unix.Close(fd)
		return tmpFile{}, err
	}
	return tmpFile{fd: fd, uid: st.Uid, gid: st.Gid}, nil
}

// close waits for a refill and closes the pooled files (their inodes are
// freed with the last fd).
func (p *tmpPool) close() {
	if p == nil {
		return
	}
	p.mu.Lock()
	p.off = true
	p.mu.Unlock()
	p.refilled.Wait()
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, t := range p.files {
		unix.Close(t.fd)
	}
	p.files = nil
}
