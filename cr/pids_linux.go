package cr

import (
	"context"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/cr/criu"
	"github.com/rewind-sandbox/rewind/internal/procfs"
)

// pstreeMagic is the magic of CRIU's pstree image (criu/include/magic.h).
const pstreeMagic = 0x50273030

// imagePids returns every pid and thread id (as seen in the sandbox's PID
// namespace) that a CRIU restore of the image in dir recreates exactly.
func imagePids(dir string) ([]int, error) {
	b, err := os.ReadFile(filepath.Join(dir, "pstree.img"))
	if err != nil {
		return nil, fmt.Errorf("read process tree of image: %w", err)
	}
	bad := func(why string) ([]int, error) {
		return nil, fmt.Errorf("process tree of image %s: %s", dir, why)
	}
	ents, err := criu.ImageEntries(b, pstreeMagic)
	if err != nil {
		return bad(err.Error())
	}
	seen := map[int]bool{}
	for _, raw := range ents {
		pid, threads, err := criu.PstreeIDs(raw)
		if err != nil {
			return bad(err.Error())
		}
		seen[int(pid)] = true
		for _, t := range threads {
			seen[int(t)] = true
		}
	}
	out := make([]int, 0, len(seen))
	for p := range seen {
		out = append(out, p)
	}
	sort.Ints(out)
	return out, nil
}

// nsIDs are a process's ids in the sandbox's PID namespace.
type nsIDs struct {
	host           int
	pid, pgid, sid int
	tids           []int
	zombie         bool
}

// nsProcesses lists every process below init, zombies and the engine's
// helpers included, with the ids it holds in init's PID namespace: its pid,
// its threads' ids, and the group and session ids that keep those pids
// allocated while it lives.
func nsProcesses(init int) ([]nsIDs, error) {
	ns := openPIDNS(init)
	defer ns.close()
	return ns.processes(init)
}

func (ns pidNS) processes(init int) ([]nsIDs, error) {
	var out []nsIDs
	err := visitDescendants(init, nil, func(c int) {
		if ids, err := ns.read(c); err == nil { // else gone meanwhile: it holds nothing any more
			out = append(out, ids)
		}
	})
	if err != nil {
		return nil, err
	}
	return out, nil
}

// pidNS translates host thread ids into ids of one PID namespace, a
// sandbox's, with the nsfs ioctl NS_GET_PID_IN_PIDNS (Linux 6.10) on the
// namespace's descriptor (procfs.PIDInNS): one system call per thread,
// where reading the thread's /proc status took tens of microseconds (a
// sandbox's init has some twenty threads, and a fork child's restore
// looked at them twice: 2-3 ms of a fork child's CPU, more under a
// fan-out's load). Without the ioctl (an older kernel: ENOTTY) each
// thread's status is read, as readNSIDs does.
type pidNS struct {
	fd int // -1: read statuses
}

// openPIDNS opens the PID namespace of init (-1 when it cannot: then the
// statuses are read).
func openPIDNS(init int) pidNS {
	fd, err := unix.Open(procfs.PIDPath(init, "ns/pid"), unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return pidNS{fd: -1}
	}
	return pidNS{fd: fd}
}

func (ns pidNS) close() {
	if ns.fd >= 0 {
		unix.Close(ns.fd)
	}
}

// tid returns the id of host thread id host in the namespace; ok is false
// when the kernel cannot say (no ioctl, or another error than the thread
// being gone: then err is nil and the caller reads the status).
func (ns pidNS) tid(host int) (id int, ok bool, err error) {
	if ns.fd < 0 {
		return 0, false, nil
	}
	id, err = procfs.PIDInNS(ns.fd, host)
	switch err {
	case nil:
		return id, true, nil
	case unix.ESRCH:
		return 0, true, err // gone, or not in the namespace
	}
	return 0, false, nil
}

// host returns the host pid of the task whose id in the namespace is id;
// ok is false when the kernel cannot say (no ioctl, or an error other than
// no such task: then the caller walks the processes), pid is 0 when no
// task has that id there (yet).
func (ns pidNS) host(id int) (pid int, ok bool) {
	if ns.fd < 0 {
		return 0, false
	}
	pid, err := procfs.PIDFromNS(ns.fd, id)
	switch err {
	case nil:
		return pid, true
	case unix.ESRCH:
		return 0, true
	}
	return 0, false
}

// readNSIDs reads pid's innermost-namespace ids from /proc/<pid>/status and
// its threads' ids from /proc/<pid>/task/*/status.
func readNSIDs(pid int) (nsIDs, error) { return pidNS{fd: -1}.read(pid) }

// read is readNSIDs with the threads' ids translated in ns where it can.
func (ns pidNS) read(pid int) (nsIDs, error) {
	ids := nsIDs{host: pid}
	b, err := procfs.ReadFile(procfs.PIDPath(pid, "status"))
	if err != nil {
		return ids, err
	}
	for _, l := range strings.Split(string(b), "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		f := strings.Fields(v)
		if len(f) == 0 {
			continue
		}
		last, _ := strconv.Atoi(f[len(f)-1])
		switch k {
		case "State":
			ids.zombie = f[0] == "Z" || f[0] == "X"
		case "NSpid":
			ids.pid = last
		case "NSpgid":
			ids.pgid = last
		case "NSsid":
			ids.sid = last
		}
	}
	tasks, err := os.ReadDir("/proc/" + strconv.Itoa(pid) + "/task")
	if err != nil {
		return ids, nil
	}
	for _, t := range tasks {
		if t.Name() == strconv.Itoa(pid) {
			continue
		}
		if host, err := strconv.Atoi(t.Name()); err == nil {
			if tid, ok, err := ns.tid(host); ok {
				if err == nil {
					ids.tids = append(ids.tids, tid)
				}
				continue
			}
		}
		tb, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/task/" + t.Name() + "/status")
		if err != nil {
			continue
		}
		for _, l := range strings.Split(string(tb), "\n") {
			if v, ok := strings.CutPrefix(l, "NSpid:"); ok {
				if f := strings.Fields(v); len(f) > 0 {
					if tid, err := strconv.Atoi(f[len(f)-1]); err == nil {
						ids.tids = append(ids.tids, tid)
					}
				}
			}
		}
	}
	return ids, nil
}

// nsTopID returns the highest id (pid or thread id) that init, its threads
// and the processes below it hold in init's PID namespace.
func nsTopID(init int) (int, error) {
	ns := openPIDNS(init)
	defer ns.close()
	procs, err := ns.processes(init)
	if err != nil {
		return 0, err
	}
	self, err := ns.read(init)
	if err != nil {
		return 0, err
	}
	top := 0
	for _, p := range append(procs, self) {
		top = max(top, p.pid)
		for _, t := range p.tids {
			top = max(top, t)
		}
	}
	return top, nil
}

// pidHolder says why a pid of init's namespace is still taken.
type pidHolder struct {
	nspid  int
	host   int
	how    string // "pid", "thread", "group" or "session"
	helper string // what the engine holds the process for ("" if nothing)
	zombie bool
	init   bool // a thread of the sandbox's init: it never frees
}

func (h pidHolder) String() string {
	who := "process"
	switch {
	case h.init:
		who = "the sandbox's init"
	case h.helper != "":
		who = "cr helper (" + h.helper + ")"
	case h.zombie:
		who = "zombie"
	}
	return fmt.Sprintf("pid %d is the %s of %s %d", h.nspid, h.how, who, h.host)
}

// pidHolders returns, for the pids in need, the processes below init that
// still hold them (as their pid, a thread id, or their group or session id).
func pidHolders(init int, need []int, helpers map[int]string) ([]pidHolder, error) {
	want := map[int]bool{}
	for _, p := range need {
		want[p] = true
	}
	ns := openPIDNS(init)
	defer ns.close()
	procs, err := ns.processes(init)
	if err != nil {
		return nil, err
	}
	var out []pidHolder
	// The init's own threads hold ids of the namespace too (sandbox
	// processes get pids above them, see package sandbox's pid floor; an
	// init without it, or a thread it made late, may not).
	if ids, err := ns.read(init); err == nil {
		for _, t := range ids.tids {
			if want[t] {
				out = append(out, pidHolder{nspid: t, host: init, how: "thread", init: true})
			}
		}
	}
	for _, p := range procs {
		add := func(id int, how string) {
			if id > 0 && want[id] {
				out = append(out, pidHolder{nspid: id, host: p.host, how: how, helper: helpers[p.host], zombie: p.zombie})
			}
		}
		add(p.pid, "pid")
		for _, t := range p.tids {
			add(t, "thread")
		}
		if p.pgid != p.pid {
			add(p.pgid, "group")
		}
		if p.sid != p.pid && p.sid != p.pgid {
			add(p.sid, "session")
		}
	}
	return out, nil
}

// waitPidsFree waits until no process of init's PID namespace holds any
// pid of need any more (killed processes being reaped, their children
// reparented to init and reaped in turn). CRIU restores exact pids, and a
// pid stays allocated while it is any process's pid, thread id, group id or
// session id. A pid held by one of the engine's helpers or by a thread of
// the sandbox's init never frees by itself: that fails at once. The error
// names every holder.
func waitPidsFree(ctx context.Context, init int, need []int, helpers map[int]string) error {
	deadline := time.Now().Add(10 * time.Second)
	for {
		hs, err := pidHolders(init, need, helpers)
		if err != nil {
			return err
		}
		if len(hs) == 0 {
			return nil
		}
		stuck := false
		for _, h := range hs {
			if h.helper != "" || h.init {
				stuck = true
			}
		}
		if stuck || time.Now().After(deadline) || ctx.Err() != nil {
			var s []string
			for _, h := range hs {
				s = append(s, h.String())
			}
			return fmt.Errorf("pids the image needs are taken: %s", strings.Join(s, "; "))
		}
		time.Sleep(200 * time.Microsecond)
	}
}

// liveHelperPids are the engine's helpers in sandbox sb that keep their
// pids until the engine lets them go, each with what it is held for:
// templates, spares, spares being warmed, parked processes. Helpers
// already killed or being dumped (e.aux but for parked processes) are not:
// their pids free by themselves, once they are gone. A killed template may
// still look alive for a while under load (SIGKILL takes effect when it is
// next scheduled).
func (e *Engine) liveHelperPids(sb string) map[int]string {
	e.mu.Lock()
	defer e.mu.Unlock()
	m := map[int]string{}
	for _, c := range e.ckpts {
		if c.rec.Sandbox != sb {
			continue
		}
		var state string
		switch {
		case c.busy > 0:
			state = "in use"
		case c.image.Image:
			state = "image written"
		case c.imageDone == nil:
			state = "no image"
		case c.image.ImageErr != nil:
			state = "image failed"
		default:
			state = "image being written"
		}
		for _, t := range c.templates {
			m[t.proc.Pid()] = fmt.Sprintf("template of %s, %s", c.rec.ID, state)
			if t.spare != nil {
				m[t.spare.Pid()] = "spare of " + c.rec.ID
			}
			if t.warming != nil {
				m[t.warming.Pid()] = "spare being warmed of " + c.rec.ID
			}
		}
		for _, t := range c.parked {
			m[t.proc.Pid()] = "parked process of " + c.rec.ID
		}
	}
	return m
}

// restoreImage restores the image in o.Dir into t once every pid it
// recreates is free there (waitPidsFree), and again while CRIU still finds
// one of them taken (criu.PidTaken): the kernel frees a reaped task's pid a
// moment after the task has left /proc and its parent's children, so the
// check can pass just before the pid is free; and a process of t's
// namespace outside init's tree (one entered with setns) holds pids the
// check cannot see. A failed attempt's log is kept as restore.log.N.
func (e *Engine) restoreImage(ctx context.Context, r *criu.Runner, t Target, o criu.RestoreOptions) (int, error) {
	deadline := time.Now().Add(10 * time.Second)
	need, err := imagePids(o.Dir)
	if err != nil {
		return 0, err
	}
	// In a sandbox just started (a fork child, a sandbox started again
	// after a restart) the counter is below the image's pids, and criu
	// itself, which runs in the namespace, would take the first of them:
	// move it past them (criu.RaiseLastPIDTo), once. Done first when no id
	// of the namespace is as high as the image's highest pid, else after a
	// failed attempt.
	raised := false
	raise := func() {
		raised = true
		if len(need) == 0 {
			return
		}
		if err := criu.RaiseLastPIDTo(t.InitPID(), need[len(need)-1]); err != nil {
			e.log.Debug("raise ns_last_pid", "err", err)
		}
	}
	if pc, ok := t.(PIDCounterTaker); ok && len(need) > 0 && pc.TakePIDCounterMin() >= need[len(need)-1] {
		// A sandbox started for this restore: its init moved the
		// counter past the image's pids already (ImageTopPID).
		raised = true
	} else if top, err := nsTopID(t.InitPID()); err == nil && len(need) > 0 && top < need[len(need)-1] {
		raise()
	}
	for attempt := 1; ; attempt++ {
		err := waitPidsFree(ctx, t.InitPID(), need, e.liveHelperPids(t.ID()))
		if err != nil && e.freeHelperPids(t, need) {
			err = waitPidsFree(ctx, t.InitPID(), need, e.liveHelperPids(t.ID()))
		}
		if err != nil {
			return 0, err
		}
		nspid, err := r.Restore(ctx, o)
		if err == nil {
			e.checkStrays(t)
		}
		if path, ok := criu.MissingFile(err); ok {
			return 0, &MissingFileError{Path: path, Err: err}
		}
		if err == nil || !criu.PidTaken(err) {
			return nspid, err
		}
		if time.Now().After(deadline) || ctx.Err() != nil {
			return 0, fmt.Errorf("%w (a pid of the image stayed taken after %d attempts)", err, attempt)
		}
		msg := err.Error() // names the log's first error line: read it before the rename
		var ce *criu.Error
		if errors.As(err, &ce) {
			_ = os.Rename(ce.Log, fmt.Sprintf("%s.%d", filepath.Join(o.Dir, criu.RestoreLog), attempt))
		}
		e.log.Info("restore retry: a pid of the image was taken", "dir", o.Dir, "attempt", attempt, "err", msg)
		if !raised {
			raise()
		}
		time.Sleep(time.Duration(attempt) * time.Millisecond)
	}
}

// freeHelperPids makes the engine's helpers in t give up the pids of need
// they hold, where nothing is lost by it, and reports whether it took any
// away: a warm spare is killed (a restore of its checkpoint forks the
// template instead), and the templates of a checkpoint whose image is
// written are dropped (its restores take the image, as after an eviction).
// The killed helpers are no longer live helpers (liveHelperPids), so
// waitPidsFree then waits for their pids to free.
//
// Images' pids come from the upper half of the pid range (dumpCopy), which
// a long run goes round: after a restart, the templates restored from one
// checkpoint's image, and their spares, can hold pids another image needs.
// The templates of a checkpoint in use (a fork from it), or whose image is
// not written yet, stay: the restore then fails, naming them.
func (e *Engine) freeHelperPids(t Target, need []int) bool {
	hs, err := pidHolders(t.InitPID(), need, e.liveHelperPids(t.ID()))
	if err != nil {
		return false
	}
	held := map[int]bool{}
	for _, h := range hs {
		if h.helper != "" {
			held[h.host] = true
		}
	}
	if len(held) == 0 {
		return false
	}
	var drop []*ckpt
	var spares retired
	e.mu.Lock()
	for _, c := range e.ckpts {
		if c.rec.Sandbox != t.ID() || c.busy > 0 {
			continue
		}
		holds := false
		for _, tm := range c.templates {
			holds = holds || held[tm.proc.Pid()]
		}
		if holds {
			if c.image.Image {
				drop = append(drop, c)
			}
			continue
		}
		for _, tm := range c.templates {
			if tm.spare != nil && held[tm.spare.Pid()] {
				e.retireSpareLocked(tm, &spares)
				tm.measured = false
			}
		}
	}
	e.mu.Unlock()
	for _, sp := range spares.spares {
		e.log.Info("kill a spare holding a pid an image needs", "sandbox", t.ID(), "pid", sp.Pid())
	}
	e.kill(spares)
	for _, c := range drop {
		e.log.Info("drop templates holding pids an image needs (the checkpoint keeps its image)", "sandbox", t.ID(), "checkpoint", c.rec.ID)
		e.dropTemplates(c)
	}
	return len(drop) > 0 || len(spares.spares) > 0
}

// ImagePidsFree reports whether a restore of checkpoint id from its image
// into t would find every pid it recreates free now: no process below t's
// init holds one (as its pid, a thread id, or its group or session id),
// counting the live processes, templates, spares and parked processes. So
// when it is true, the live processes can be parked (CheckpointOptions.Park)
// as a restore's undo point instead of being dumped, and the restore's
// CRIU step still gets its exact pids. False when id has no image or its
// pids cannot be read (the caller takes the safe way).
func (e *Engine) ImagePidsFree(t Target, id string) bool {
	need, err := e.imagePidsOf(id, t.ID())
	if err != nil || len(need) == 0 {
		return false
	}
	hs, err := pidHolders(t.InitPID(), need, nil)
	return err == nil && len(hs) == 0
}

// imagePidsOf returns the pids a restore of checkpoint id from its image
// recreates, sorted; none when it has no image, or when sb is not empty
// and id was taken in another sandbox than sb.
func (e *Engine) imagePidsOf(id, sb string) ([]int, error) {
	e.mu.Lock()
	c, ok := e.ckpts[id]
	var dirs []string
	if ok && c.image.Image && (sb == "" || c.rec.Sandbox == sb) {
		for _, im := range c.images {
			dirs = append(dirs, im.dir)
		}
	}
	e.mu.Unlock()
	var need []int
	for _, d := range dirs {
		p, err := imagePids(d)
		if err != nil {
			return nil, err
		}
		need = append(need, p...)
	}
	slices.Sort(need)
	return need, nil
}

// PIDCounterTaker is a Target whose PID namespace's pid counter was moved
// to at least some value when it was set up (sandbox.Config.PIDCounterMin),
// which it reports once: a restore from an image whose pids are all at
// most that value then skips moving the counter past them itself (a
// process started in the namespace, some 1.5 ms of CPU; a fan-out to new
// sandboxes makes one per child).
type PIDCounterTaker interface {
	TakePIDCounterMin() int
}

// ImageTopPID returns the highest pid or thread id checkpoint id's image
// recreates (0 when it has no image yet): a sandbox made to restore it
// gets its pid counter there at its setup (PIDCounterTaker).
func (e *Engine) ImageTopPID(id string) (int, error) {
	need, err := e.imagePidsOf(id, "")
	if err != nil || len(need) == 0 {
		return 0, err
	}
	return need[len(need)-1], nil
}

// RestoresFromImage reports whether a restore of checkpoint id into t
// would go through its CRIU image, which recreates the processes with
// their exact pids: it has an image, and no templates of t to fork.
func (e *Engine) RestoresFromImage(t Target, id string) bool {
	e.mu.Lock()
	defer e.mu.Unlock()
	c, ok := e.ckpts[id]
	if !ok || (len(c.templates) > 0 && c.rec.Sandbox == t.ID()) {
		return false
	}
	return c.image.Image
}

// MakeRoomForImage moves t's pid counter past the pids checkpoint id's
// image recreates, when it is below the highest of them (a process started
// in the sandbox's PID namespace reads and writes it), so that the
// processes forked before that restore (the templates of the restore's
// undo point, which hold their pids until the restore is done) do not
// take one: a restore would fail on them. After a restart a sandbox's
// counter sits just past the pids of the last image restored, and the
// next image's pids are often above it (images take their pids from the
// upper half of the range, which a long run goes round). Nothing to do
// for a checkpoint without an image, or one of t whose restore forks its
// templates. The checkpoint may be another
// sandbox's (an image restores into any sandbox, and after a restart the
// sandbox is a new one).
func (e *Engine) MakeRoomForImage(t Target, id string) error {
	if !e.RestoresFromImage(t, id) {
		return nil
	}
	need, err := e.imagePidsOf(id, "")
	if err != nil || len(need) == 0 {
		return err
	}
	// The counter itself, not the highest pid held (nsTopID): a counter
	// gone round the range sits below pids still held above it.
	e.lastPIDMu.Lock()
	defer e.lastPIDMu.Unlock()
	return criu.RaiseLastPIDTo(t.InitPID(), need[len(need)-1])
}
