package cr

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/procfs"
	"golang.org/x/sys/unix"
)

// checkpointTrees is the CRIU path of Checkpoint, for process trees and
// multi-threaded processes: every process is stopped with SIGSTOP, the
// barrier runs, each tree (rooted at a child of init) is dumped with
// --leave-running, and the processes are continued. The sandbox is stopped
// for the whole dump.
func (e *Engine) checkpointTrees(ctx context.Context, c *ckpt, t Target, procs []Proc, barrier func() error) error {
	if e.cfg.ImagesDir == "" {
		return errors.New("CRIU path needs Config.ImagesDir")
	}
	r, err := e.criuRunner()
	if err != nil {
		return err
	}
	for _, p := range procs {
		if err := checkNoTerminal(p.PID, p.PID); err != nil {
			return err
		}
	}
	start := time.Now()
	var stopped []int
	wasStopped := map[int]bool{}
	defer func() {
		for _, pid := range stopped {
			_ = unix.Kill(pid, unix.SIGCONT)
		}
	}()
	for _, p := range procs {
		if st, _ := procState(p.PID); st == 'T' {
			wasStopped[p.NSPID] = true
			continue
		}
		if err := unix.Kill(p.PID, unix.SIGSTOP); err == nil {
			stopped = append(stopped, p.PID)
		}
	}
	for _, pid := range stopped {
		// Every thread, not only the main one: criu must not seize a
		// process whose group stop is still under way (see groupStopped).
		if !waitUntil(ctx, 10*time.Second, func() bool { return groupStopped(pid) }) {
			return fmt.Errorf("process %d did not stop", pid)
		}
	}
	// A process that exited before it was stopped (a short-lived command,
	// a job ending) is not part of the checkpoint: everything else is
	// stopped now, so the checkpoint is the state right after its exit.
	// Dumping a tree whose root is gone would fail the whole checkpoint.
	var kept []Proc
	for _, p := range procs {
		if st, err := procState(p.PID); err == nil && st != 'Z' && st != 'X' {
			kept = append(kept, p)
		}
	}
	procs = kept
	c.rec.Procs = kept
	if len(procs) == 0 {
		return errors.New("every process exited during the checkpoint")
	}
	if barrier != nil {
		if err := barrier(); err != nil {
			return fmt.Errorf("barrier: %w", err)
		}
	}
	// Files the processes keep on a root mount that was replaced under
	// them (RestoreOptions.Reroot) are dumped as externals.
	hostPIDs := make([]int, 0, len(procs))
	for _, p := range procs {
		hostPIDs = append(hostPIDs, p.PID)
	}
	ext, err := criu.Externals(t.InitPID(), hostPIDs)
	if err != nil {
		return err
	}
	var imgs []image
	for _, p := range procs {
		if p.PPID != t.InitPID() {
			continue
		}
		im := image{orig: p, dir: e.imageDir(c, len(imgs)), stopped: wasStopped[p.NSPID]}
		for fd := 0; fd < 3; fd++ {
			if l, err := os.Readlink(fmt.Sprintf("/proc/%d/fd/%d", p.PID, fd)); err == nil && (strings.HasPrefix(l, "pipe:") || strings.HasPrefix(l, "socket:")) {
				im.stdio[fd] = l
			}
		}
		if err := r.Dump(ctx, criu.DumpOptions{NSInit: t.InitPID(), Pid: p.NSPID, Dir: im.dir, LeaveRunning: true, External: ext}); err != nil {
			return err
		}
		imgs = append(imgs, im)
	}
	c.images = imgs
	c.stoppedNS = wasStopped
	c.image = Parts{Image: true, ImageDir: filepath.Dir(e.imageDir(c, 0))}
	c.rec.Frozen = time.Since(start)
	if err := writeMeta(c); err != nil {
		e.log.Warn("write checkpoint metadata", "checkpoint", c.rec.ID, "err", err)
	}
	return nil
}

// restoreTrees restores every tree of a CRIU-mode checkpoint with exact
// pids, handing in fresh stdio ends for the dumped pipes. It returns the
// trees' roots and the host pids of all their processes as restored.
func (e *Engine) restoreTrees(ctx context.Context, c *ckpt, t Target, opts RestoreOptions) (out []Restored, live []int, err error) {
	r, err := e.criuRunner()
	if err != nil {
		return nil, nil, err
	}
	live = []int{}
	for _, im := range c.images {
		inherit := map[string]*os.File{}
		var opened []*os.File
		var st *Stdio
		if opts.Stdio != nil {
			if st, err = opts.Stdio(im.orig); err != nil {
				return out, live, fmt.Errorf("stdio for %d: %w", im.orig.PID, err)
			}
		}
		if st != nil {
			paths := [3]string{st.Stdin, st.Stdout, st.Stderr}
			for fd := 0; fd < 3; fd++ {
				key := im.stdio[fd]
				if key == "" || inherit[key] != nil {
					continue
				}
				f := st.Files[fd]
				if f == nil && paths[fd] != "" {
					flags := unix.O_WRONLY
					if fd == 0 {
						flags = unix.O_RDONLY
					}
					f, err = openInSandbox(t.InitPID(), paths[fd], flags)
					if err != nil {
						return out, live, fmt.Errorf("stdio for %d: %w", im.orig.PID, err)
					}
					opened = append(opened, f)
				}
				if f != nil {
					inherit[key] = f
				}
			}
		}
		nspid, err := e.restoreImage(ctx, r, t, criu.RestoreOptions{NSInit: t.InitPID(), Dir: im.dir, Inherit: inherit})
		for _, f := range opened {
			f.Close()
		}
		if err != nil {
			return out, live, err
		}
		pid, err := hostPID(t.InitPID(), nspid)
		if err != nil {
			return out, live, err
		}
		// Continue every restored process that was not stopped before the
		// checkpoint (they were dumped stopped by our SIGSTOP).
		tree := append([]Proc{{PID: pid, NSPID: nspid}}, subtree(pid)...)
		for _, p := range tree {
			live = append(live, p.PID)
			if !c.stoppedNS[p.NSPID] {
				_ = unix.Kill(p.PID, unix.SIGCONT)
			}
		}
		out = append(out, Restored{Orig: im.orig, PID: pid})
		if st != nil && st.Started != nil {
			if err := st.Started(pid); err != nil {
				return out, live, fmt.Errorf("started hook for %d: %w", pid, err)
			}
		}
	}
	return out, live, nil
}

// subtree lists the descendants of pid.
func subtree(pid int) []Proc {
	ps, _ := descendants(pid, nil)
	return ps
}

// openInSandbox opens path, a file inside the sandbox of init, from the
// host side without following any of the sandbox's symlinks out of it:
// "/proc/1/fd/N" (a descriptor the sandbox init holds, see Stdio) is the
// init's own descriptor; any other path is resolved beneath the sandbox's
// root, its symlinks read as rooted there. (Through /proc/<init>/root an
// absolute symlink of the sandbox would name a host file.)
func openInSandbox(init int, path string, flags int) (*os.File, error) {
	if rest, ok := strings.CutPrefix(path, "/proc/1/fd/"); ok {
		if n, err := strconv.Atoi(rest); err == nil && n >= 0 && strconv.Itoa(n) == rest {
			return os.OpenFile(fmt.Sprintf("/proc/%d/fd/%d", init, n), flags|unix.O_CLOEXEC, 0)
		}
	}
	root, err := unix.Open(fmt.Sprintf("/proc/%d/root", init), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open sandbox root: %w", err)
	}
	defer unix.Close(root)
	fd, err := unix.Openat2(root, path, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_CLOEXEC | unix.O_NOCTTY),
		Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_MAGICLINKS,
	})
	if err != nil {
		return nil, fmt.Errorf("open %s in the sandbox: %w", path, err)
	}
	return os.NewFile(uintptr(fd), path), nil
}

// groupStopped reports whether every thread of process pid has entered
// the group stop a SIGSTOP started (or exited; a process gone counts as
// stopped). The main thread stops first while another thread may still be
// in a system call that waits for a FUSE answer (a write to the sandbox's
// own mount); criu seizing the process then sees that thread's stop arrive
// as its seize trap, resumes it once to skip the stop (compel's
// skip_sigstop), and the thread runs on and restarts its write instead of
// trapping: criu waits for it until its timeout (ten seconds, "Timeout
// reached") and the dump fails.
func groupStopped(pid int) bool {
	ents, err := os.ReadDir(procfs.PIDPath(pid, "task"))
	if err != nil {
		return true // gone
	}
	for _, e := range ents {
		tid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		st, err := procState(tid) // a thread's own /proc/TID/stat
		if err != nil {
			continue // the thread exited
		}
		if st != 'T' && st != 'Z' && st != 'X' {
			return false
		}
	}
	return true
}
