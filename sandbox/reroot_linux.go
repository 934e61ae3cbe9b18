package sandbox

import (
	"bufio"
	"bytes"
	"errors"
	"fmt"
	"github.com/rewind-sandbox/rewind/internal/mountinfo"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ReplaceRoot makes the detached mount mfd (a clone of the sandbox's new
// root, e.g. a native overlay mounted over another layer stack) the root
// of the sandbox's mount namespace, with every mount the old root carried
// (/proc, /dev, /run/rewind, binds, tmpfs and hide mounts) moved onto it
// at the same place, and lazily detaches the old root.
//
// pivot_root moves the root and working directory of every process whose
// root or working directory is the old root's top directory (the init,
// templates, copies being prepared) to the new root. Working directories
// below the top and open files stay on the old, detached view: processes
// that must see the new view are re-created after a ReplaceRoot (cr's
// RestoreOptions.Reroot re-enters a copy's working directory and reopens
// its files by path). mfd stays open; the caller closes it.
func (s *Sandbox) ReplaceRoot(mfd int) error {
	s.mu.Lock()
	closed := s.closed
	s.mu.Unlock()
	if closed {
		return ErrClosed
	}
	ns, err := unix.Open(s.NSPath("mnt"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("replace root of %s: %w", s.cfg.ID, err)
	}
	defer unix.Close(ns)
	// The mount table as the init sees it (paths inside the sandbox): once
	// in the sandbox's namespace, /proc is the sandbox's, without the
	// daemon's threads.
	mi, err := os.ReadFile(fmt.Sprintf("/proc/%d/mountinfo", s.initPID))
	if err != nil {
		return fmt.Errorf("replace root of %s: %w", s.cfg.ID, err)
	}
	done := make(chan error, 1)
	go func() {
		// This thread joins the sandbox's mount namespace and is never
		// given back to the runtime: it ends with the goroutine.
		runtime.LockOSThread()
		done <- replaceRootInNS(ns, mfd, mi)
	}()
	if err := <-done; err != nil {
		return fmt.Errorf("replace root of %s: %w", s.cfg.ID, err)
	}
	return nil
}

// replaceRootInNS runs on a locked thread that it moves into mount
// namespace ns.
func replaceRootInNS(ns, mfd int, mountinfo []byte) error {
	if err := unix.Unshare(unix.CLONE_FS); err != nil {
		return fmt.Errorf("unshare fs: %w", err)
	}
	if err := unix.Setns(ns, unix.CLONE_NEWNS); err != nil {
		return fmt.Errorf("setns: %w", err)
	}
	var stx unix.Statx_t
	if err := unix.Statx(unix.AT_FDCWD, "/", unix.AT_SYMLINK_NOFOLLOW, unix.STATX_MNT_ID, &stx); err != nil {
		return fmt.Errorf("statx /: %w", err)
	}
	rootID := stx.Mnt_id
	subs, err := childMounts(mountinfo, rootID)
	if err != nil {
		return err
	}
	// The mounts the old root carries (with theirs: /proc's masks and
	// read-only binds, /dev/pts, /dev/shm) move onto the new root, the
	// same mounts: what processes hold on them (a template's executable on
	// a read-only bind of /usr, /dev/null as stdio) stays in the namespace.
	subFDs := make([]int, 0, len(subs))
	defer func() {
		for _, fd := range subFDs {
			unix.Close(fd)
		}
	}()
	for _, p := range subs {
		fd, err := unix.OpenTree(unix.AT_FDCWD, p, unix.OPEN_TREE_CLOEXEC|unix.AT_SYMLINK_NOFOLLOW)
		if err != nil {
			return fmt.Errorf("open mount %s: %w", p, err)
		}
		subFDs = append(subFDs, fd)
	}
	// The new root goes on top of the old root's top directory, so that it
	// is a mount point in this namespace, reachable from the root.
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, "/", unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("attach new root: %w", err)
	}
	if err := unix.Fchdir(mfd); err != nil {
		return fmt.Errorf("chdir new root: %w", err)
	}
	// Until the pivot, a failure moves the mounts back (paths from this
	// thread's root, the old root: the new one is stacked on its top
	// directory, which a walk from the root does not cross) and takes the
	// new root away again: the namespace stays as it was.
	moved := 0
	undo := func(err error) error {
		for i := moved - 1; i >= 0; i-- {
			if merr := unix.MoveMount(subFDs[i], "", unix.AT_FDCWD, subs[i], unix.MOVE_MOUNT_F_EMPTY_PATH); merr != nil {
				err = fmt.Errorf("%w (and moving %s back failed: %v)", err, subs[i], merr)
			}
		}
		if uerr := unix.Unmount(".", unix.MNT_DETACH); uerr != nil {
			return fmt.Errorf("%w (and detaching the new root failed: %v)", err, uerr)
		}
		return err
	}
	for i, p := range subs {
		t, err := mountTarget(mfd, p, subFDs[i])
		if err != nil {
			return undo(err)
		}
		err = unix.MoveMount(subFDs[i], "", t, "", unix.MOVE_MOUNT_F_EMPTY_PATH|unix.MOVE_MOUNT_T_EMPTY_PATH)
		unix.Close(t)
		if err != nil {
			return undo(fmt.Errorf("move %s onto the new root: %w", p, err))
		}
		moved++
	}
	if err := unix.PivotRoot(".", "."); err != nil {
		return undo(fmt.Errorf("pivot_root: %w", err))
	}
	if err := unix.Unmount(".", unix.MNT_DETACH); err != nil {
		return fmt.Errorf("detach old root: %w", err)
	}
	return nil
}

// childMounts returns the mount points of the mounts whose parent is mount
// id in mountinfo (/proc/PID/mountinfo), each place once, in mount order.
func childMounts(info []byte, id uint64) ([]string, error) {
	var out []string
	seen := map[string]bool{}
	sc := bufio.NewScanner(bytes.NewReader(info))
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for sc.Scan() {
		fl := strings.Fields(sc.Text())
		if len(fl) < 5 {
			continue
		}
		parent, err := strconv.ParseUint(fl[1], 10, 64)
		if err != nil || parent != id {
			continue
		}
		own, _ := strconv.ParseUint(fl[0], 10, 64)
		if own == id {
			continue
		}
		p := mountinfo.Unescape(fl[4])
		if p == "/" || seen[p] {
			continue
		}
		seen[p] = true
		out = append(out, p)
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("mountinfo: %w", err)
	}
	return out, nil
}

// mountTarget opens (creating it if missing: a directory, or an empty file
// when the mount is of a file) the place of mount point p beneath the new
// root mfd. Paths resolve inside the new root: a symlink of the sandbox
// never leads out of it.
func mountTarget(mfd int, p string, sub int) (int, error) {
	rel := strings.TrimPrefix(filepath.Clean(p), "/")
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
	fd, err := unix.Openat2(mfd, rel, how)
	if err == nil {
		return fd, nil
	}
	if !errors.Is(err, unix.ENOENT) {
		return -1, fmt.Errorf("mount point %s: %w", p, err)
	}
	var st unix.Stat_t
	if err := unix.Fstat(sub, &st); err != nil {
		return -1, fmt.Errorf("mount %s: %w", p, err)
	}
	parent, err := mkdirBeneath(mfd, filepath.Dir(rel))
	if err != nil {
		return -1, fmt.Errorf("mount point %s: %w", p, err)
	}
	defer unix.Close(parent)
	name := filepath.Base(rel)
	if st.Mode&unix.S_IFMT == unix.S_IFDIR {
		err = unix.Mkdirat(parent, name, 0o755)
	} else {
		var nfd int
		nfd, err = unix.Openat(parent, name, unix.O_CREAT|unix.O_EXCL|unix.O_WRONLY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0o644)
		if err == nil {
			unix.Close(nfd)
		}
	}
	if err != nil && !errors.Is(err, unix.EEXIST) {
		return -1, fmt.Errorf("mount point %s: %w", p, err)
	}
	fd, err = unix.Openat2(mfd, rel, how)
	if err != nil {
		return -1, fmt.Errorf("mount point %s: %w", p, err)
	}
	return fd, nil
}

// mkdirBeneath creates directory rel (and its parents) beneath root and
// returns it opened, resolving inside root.
func mkdirBeneath(root int, rel string) (int, error) {
	how := &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC, Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS | unix.RESOLVE_NO_XDEV}
	cur, err := unix.Openat2(root, ".", how)
	if err != nil {
		return -1, err
	}
	if rel == "." || rel == "" {
		return cur, nil
	}
	for _, c := range strings.Split(rel, "/") {
		if c == "" || c == "." {
			continue
		}
		if err := unix.Mkdirat(cur, c, 0o755); err != nil && !errors.Is(err, unix.EEXIST) {
			unix.Close(cur)
			return -1, err
		}
		next, err := unix.Openat2(cur, c, &unix.OpenHow{Flags: unix.O_PATH | unix.O_DIRECTORY | unix.O_CLOEXEC | unix.O_NOFOLLOW, Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_XDEV})
		unix.Close(cur)
		if err != nil {
			return -1, err
		}
		cur = next
	}
	return cur, nil
}
