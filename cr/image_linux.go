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
	"github.com/rewind-sandbox/rewind/cr/inject"
	"golang.org/x/sys/unix"
)

// image is the CRIU image of one process (ModeTemplate: of its template) or
// one process tree (ModeCRIU: rooted at a child of init).
type image struct {
	orig Proc
	dir  string
	// stdio are CRIU's keys ("pipe:[ino]") of the root's fds 0-2 at dump
	// time (ModeCRIU), so a restore can hand in fresh ends.
	stdio [3]string
	// stopped is true when the root was already stopped before the dump.
	stopped bool
	// undumpable: as template.undumpable (ModeTemplate).
	undumpable bool
}

func (e *Engine) criuRunner() (*criu.Runner, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.runner != nil {
		return e.runner, nil
	}
	r, err := criu.NewRunner(e.cfg.CRIUPath, e.cfg.CRIURunDir)
	if err != nil {
		return nil, err
	}
	e.runner = r
	// CRIU's kernel-feature cache (about a second to make) is ready before
	// most runs need it; a run that comes first waits for it.
	if !e.closing {
		e.bg.Add(1)
		go func() {
			defer e.bg.Done()
			if _, err := r.Kdat(context.Background()); err != nil {
				e.log.Info("no criu kernel-feature cache: every criu run probes the kernel", "err", err)
			}
		}()
	}
	return r, nil
}

func (e *Engine) imageDir(c *ckpt, i int) string {
	return filepath.Join(e.cfg.ImagesDir, safeName(c.rec.Sandbox), safeName(c.rec.ID), strconv.Itoa(i))
}

func safeName(s string) string {
	return strings.Map(func(r rune) rune {
		if r == '/' || r == 0 {
			return '_'
		}
		return r
	}, s)
}

// dumpTemplates writes a CRIU image of every template of c in the
// background: a stopped copy of each template is forked and dumped (the
// template itself stays attached and usable meanwhile; the agent is never
// stopped).
func (e *Engine) dumpTemplates(c *ckpt, t Target) {
	err := e.doDumpTemplates(c, t)
	e.mu.Lock()
	if err != nil {
		c.image.ImageErr = err
		if errors.Is(err, errDropped) || e.life.Err() != nil {
			e.log.Debug("checkpoint dropped, or the engine closed, before its image was written", "checkpoint", c.rec.ID, "err", err)
		} else {
			e.log.Warn("checkpoint image failed; templates only", "checkpoint", c.rec.ID, "err", err)
		}
	} else {
		c.image.Image = true
		c.image.ImageDir = filepath.Dir(e.imageDir(c, 0))
		if err := writeMeta(c); err != nil {
			e.log.Warn("write checkpoint metadata", "checkpoint", c.rec.ID, "err", err)
		}
	}
	close(c.imageDone)
	remove := c.removeWhenDone
	e.mu.Unlock()
	if remove {
		e.removeImage(c)
		return
	}
	if err == nil {
		e.enforceBounds()
	}
}

func (e *Engine) doDumpTemplates(c *ckpt, t Target) error {
	if e.beforeDump != nil {
		e.beforeDump()
	}
	r, err := e.criuRunner()
	if err != nil {
		return err
	}
	var imgs []image
	for i, tm := range e.tmpls(c) {
		if err := checkNoTerminal(tm.proc.Pid(), tm.orig.PID); err != nil {
			return err
		}
		cp, err := e.dumpCopy(tm, t.InitPID())
		if err != nil {
			if cp > 0 {
				_ = unix.Kill(cp, unix.SIGKILL)
				e.forgetAux(tm, cp)
			}
			e.mu.Lock()
			dropped := tm.dropped
			e.mu.Unlock()
			if dropped {
				// Dropped while being forked (Drop kills templates
				// without the sandbox lock): not a failure.
				return fmt.Errorf("%w: %v", errDropped, err)
			}
			return err
		}
		p, err := readProc(cp)
		if err == nil && p.NSPID == 0 {
			err = errors.New("no NSpid")
		}
		if err != nil {
			_ = unix.Kill(cp, unix.SIGKILL)
			e.forgetAux(tm, cp)
			return fmt.Errorf("dump copy %d: %w", cp, err)
		}
		dir := e.imageDir(c, i)
		// The namespace's root stays in place while criu reads it (nsMu).
		ns := e.nsLock(t.ID())
		ns.RLock()
		// The template may hold files of a root mount replaced since it
		// was taken (RestoreOptions.Reroot): dumped as externals.
		ext, err := criu.Externals(t.InitPID(), []int{cp})
		if err != nil {
			ns.RUnlock()
			_ = unix.Kill(cp, unix.SIGKILL)
			e.forgetAux(tm, cp)
			return err
		}
		dctx, cancel := context.WithTimeout(e.life, dumpTimeout)
		derr := r.Dump(dctx, criu.DumpOptions{NSInit: t.InitPID(), Pid: p.NSPID, Dir: dir, External: ext})
		cancel()
		ns.RUnlock()
		if derr != nil {
			_ = unix.Kill(cp, unix.SIGKILL)
		}
		e.forgetAux(tm, cp)
		if derr != nil {
			return derr
		}
		imgs = append(imgs, image{orig: tm.orig, dir: dir, stopped: true, undumpable: tm.undumpable})
	}
	e.mu.Lock()
	c.images = imgs
	e.mu.Unlock()
	return nil
}

var errDropped = errors.New("template dropped")

// dumpTimeout bounds one background dump: nothing may wait on criu forever.
const dumpTimeout = 5 * time.Minute

// dumpCopy forks a copy of tm and leaves it in a SIGSTOP stop, detached, for
// criu to seize. The pid is registered so restores never mistake it for a
// live process.
func (e *Engine) dumpCopy(tm *template, init int) (int, error) {
	// CRIU restores the copy's exact pid. A pid from the upper half of
	// the range keeps it clear of the low pids every sandbox's init and
	// first processes take, so the image also restores into other
	// sandboxes (fan-out, re-created sandboxes). The counter only grows,
	// so it is raised before the sandbox's lock is taken: the fork below
	// gets a pid above it all the same, and restores do not wait for the
	// process it takes to read (and maybe write) it. Raises are serialised
	// among themselves: two that both read a low counter would each write
	// one, and the second could move it back below pids handed out since.
	e.lastPIDMu.Lock()
	err := criu.RaiseLastPID(init)
	e.lastPIDMu.Unlock()
	if err != nil {
		e.log.Debug("ns_last_pid", "err", err)
	}
	cp, err := e.forkDumpCopy(tm)
	if err != nil {
		return 0, err
	}
	// Stopped, detached and a helper (aux): the lock is not needed for
	// the wait.
	if !waitUntil(context.Background(), 10*time.Second, func() bool { st, _ := procState(cp); return st == 'T' }) {
		return cp, fmt.Errorf("dump copy %d did not stop", cp)
	}
	return cp, nil
}

// forkDumpCopy is dumpCopy's part under the sandbox's lock: the fork of the
// copy and its set-up, until it is detached in a SIGSTOP stop.
func (e *Engine) forkDumpCopy(tm *template) (int, error) {
	l := e.sandboxLock(tm.sandbox)
	l.Lock()
	defer l.Unlock()
	e.mu.Lock()
	dropped := tm.dropped
	e.mu.Unlock()
	if dropped {
		return 0, errDropped
	}
	cp, err := tm.proc.Fork(true)
	if err != nil {
		return 0, err
	}
	e.mu.Lock()
	e.aux[cp.Pid()] = tm.sandbox
	e.mu.Unlock()
	// The copy shares its file descriptions with the template and the
	// original, which may have moved their offsets since the checkpoint:
	// the image must hold the checkpoint's (as every forked copy does).
	e.ownFiles(tm, cp, filesAll)
	// A session leader: the image then holds its whole session, and the
	// process restored from it has its session inside the sandbox's PID
	// namespace (CRIU's shell-job mode would otherwise put it into criu's
	// own session, outside, and refuse to dump it or its copies again).
	if err := cp.Setsid(); err != nil {
		_ = cp.Kill()
		e.forgetAux(tm, cp.Pid())
		return 0, err
	}
	if err := cp.DetachStopped(); err != nil {
		_ = cp.Kill()
		e.forgetAux(tm, cp.Pid())
		return 0, err
	}
	return cp.Pid(), nil
}

func (e *Engine) forgetAux(tm *template, pid int) {
	e.mu.Lock()
	defer e.mu.Unlock()
	delete(e.aux, pid)
}

// WaitImage blocks until checkpoint id's image is written or failed. A
// CRIU-mode checkpoint is an image from the start; an empty one needs none.
func (e *Engine) WaitImage(ctx context.Context, id string) error {
	e.mu.Lock()
	c, ok := e.ckpts[id]
	e.mu.Unlock()
	if !ok {
		return fmt.Errorf("checkpoint %s: %w", id, ErrUnknown)
	}
	if c.imageDone == nil {
		switch c.rec.Mode {
		case ModeCRIU, ModeEmpty:
			// Imaged during the checkpoint itself, or nothing to image.
			return nil
		}
		return fmt.Errorf("checkpoint %s: no image configured", id)
	}
	select {
	case <-c.imageDone:
	case <-ctx.Done():
		return ctx.Err()
	}
	e.mu.Lock()
	defer e.mu.Unlock()
	return c.image.ImageErr
}

// restoreTemplatesFromImage recreates c's templates from its images (inside
// the sandbox's namespaces) and attaches them. Caller holds the sandbox lock.
func (e *Engine) restoreTemplatesFromImage(ctx context.Context, c *ckpt, t Target) error {
	tmpls, err := e.templatesFromImage(ctx, c, t, nil)
	if err != nil {
		return err
	}
	e.mu.Lock()
	c.templates = tmpls
	e.mu.Unlock()
	return nil
}

// templatesFromImage restores c's template images into t and attaches them.
func (e *Engine) templatesFromImage(ctx context.Context, c *ckpt, t Target, ph *phases) ([]*template, error) {
	r, err := e.criuRunner()
	if err != nil {
		return nil, err
	}
	e.mu.Lock()
	imgs := c.images
	e.mu.Unlock()
	var tmpls []*template
	fail := func(err error) ([]*template, error) {
		for _, tm := range tmpls {
			_ = tm.proc.Kill()
		}
		return nil, err
	}
	for _, im := range imgs {
		nspid, err := e.restoreImage(ctx, r, t, criu.RestoreOptions{NSInit: t.InitPID(), Dir: im.dir, Lazy: e.cfg.LazyPages})
		if err != nil {
			return fail(err)
		}
		ph.mark("criu")
		pid, err := hostPID(t.InitPID(), nspid)
		if err != nil {
			return fail(err)
		}
		if !waitUntil(ctx, 10*time.Second, func() bool { st, _ := procState(pid); return st == 'T' }) {
			_ = unix.Kill(pid, unix.SIGKILL)
			return fail(fmt.Errorf("restored template %d did not stop", pid))
		}
		ph.mark("stopped")
		ip, err := e.tracer.Attach(pid)
		if err != nil {
			_ = unix.Kill(pid, unix.SIGKILL)
			return fail(err)
		}
		// Images written before dump copies led their own session
		// restore into criu's session: give the template its own.
		if err := ip.Setsid(); err != nil {
			_ = ip.Kill()
			return fail(err)
		}
		tm := &template{sandbox: t.ID(), orig: im.orig, proc: ip, undumpable: im.undumpable}
		// Restored from the image, its offsets are the checkpoint's.
		tm.files = captureFiles(ip.Pid())
		tm.cwd = checkpointCwd(ip.Pid())
		tmpls = append(tmpls, tm)
		// The image is of an undumpable copy; older images may not be.
		if err := guard(tm, false); err != nil {
			return fail(err)
		}
		ph.mark("attach")
	}
	return tmpls, nil
}

// restoreForeign restores checkpoint c, taken in another sandbox, into t
// from its image: the templates are restored into t's namespaces, forked
// once each, and dropped (t keeps no templates of a foreign checkpoint).
// This is how a checkpoint fans out into fresh sandboxes.
func (e *Engine) restoreForeign(ctx context.Context, c *ckpt, t Target, opts RestoreOptions, ph *phases) ([]Restored, []int, error) {
	if c.rec.Mode == ModeCRIU {
		return e.restoreTrees(ctx, c, t, opts)
	}
	tmpls, err := e.templatesFromImage(ctx, c, t, ph)
	if err != nil {
		return nil, nil, err
	}
	tmp := &ckpt{rec: c.rec, templates: tmpls}
	defer func() {
		for _, tm := range tmpls {
			pid := tm.proc.Pid()
			_ = tm.proc.Kill()
			// Kill stops waiting for the exit after a moment (see
			// inject.Proc.Kill); under load a template could then still
			// be in t when Restore returns. Wait (briefly) until it is
			// reaped, so t holds only the restored processes.
			waitUntil(ctx, time.Second, func() bool {
				_, err := os.Stat("/proc/" + strconv.Itoa(pid))
				return err != nil
			})
		}
	}()
	procs, err := e.spawn(tmp, opts, false)
	ph.mark("fork")
	if err != nil {
		return nil, nil, err
	}
	return procs, pidsOf(procs), nil
}

// hostPID finds the host pid of the child of init whose pid in the
// sandbox's namespace is nspid: one ioctl on the namespace
// (NS_GET_PID_FROM_PIDNS, Linux 6.10), a walk of init's descendants on
// older kernels.
func hostPID(init, nspid int) (int, error) {
	ns := openPIDNS(init)
	defer ns.close()
	var found int
	waitUntil(context.Background(), 5*time.Second, func() bool {
		if pid, ok := ns.host(nspid); ok {
			found = pid
			return pid > 0
		}
		ps, err := descendants(init, nil)
		if err != nil {
			return false
		}
		for _, p := range ps {
			if p.NSPID == nspid {
				found = p.PID
				return true
			}
		}
		return false
	})
	if found == 0 {
		return 0, fmt.Errorf("restored pid %d not found under init %d", nspid, init)
	}
	return found, nil
}

// removeImage deletes the image directory of c, if any.
func (e *Engine) removeImage(c *ckpt) {
	e.mu.Lock()
	if c.imageDone != nil {
		select {
		case <-c.imageDone:
		default:
			// A dump is still running: it removes the image when done
			// (never block the caller on criu).
			c.removeWhenDone = true
			e.mu.Unlock()
			return
		}
	}
	dir := c.image.ImageDir
	if dir == "" && e.cfg.ImagesDir != "" {
		dir = filepath.Join(e.cfg.ImagesDir, safeName(c.rec.Sandbox), safeName(c.rec.ID))
	}
	c.image = Parts{}
	c.images = nil
	e.mu.Unlock()
	if dir != "" {
		if err := os.RemoveAll(dir); err != nil {
			e.log.Warn("remove image", "dir", dir, "err", err)
		}
	}
}

var _ = inject.ErrMultiThreaded
