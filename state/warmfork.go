package state

import (
	"context"
	"errors"
	"fmt"
	"sort"
	"strconv"
	"sync"
	"time"
)

// Warm forks: RL training forks the same checkpoint again and again, at the
// same width. After a fork of N copies of checkpoint C, the manager prepares
// up to N children of C in the background (mounted, sandbox started,
// processes restored, probe window open) so that the next fork of C only
// names them: it writes /run/rewind/{sandbox,copy} and stores the records.
// Prepared children are whole, separate sandboxes, exactly like the ones a
// fork makes on the spot; they are stored with Warm set, so a daemon that
// dies leaves nothing the next one does not clean up.

// warmIdle is how long an unused checkpoint keeps its prepared children.
const warmIdle = 10 * time.Minute

// warmParallel bounds the preparations running at once.
const warmParallel = 2

// warmMaxFailures is how many preparations of one checkpoint may fail in a
// row before the refill stops trying it (until it is forked or prepared
// again): one failure among many restores is retried, a checkpoint that
// cannot be prepared is not retried for ever.
const warmMaxFailures = 3

// warmDefer bounds how long preparations wait, after a fork, for the fork's
// children to finish their first request: they run first. Preparing a child
// (a CRIU restore, a sandbox start) competes with them for the CPU, and
// their first commands are what the caller of the fork waits for
// (rewind bench fanout -n 64: about 0.9 s of CPU for 64 first commands with
// the refill beside them, 0.8 s without).
const warmDefer = time.Second

// warmPool is the state of warm forks, guarded by Manager.mu.
type warmPool struct {
	ready  map[string][]*sbox   // checkpoint id -> prepared children
	want   map[string]int       // checkpoint id -> children to keep ready
	used   map[string]time.Time // checkpoint id -> last fork
	making map[string]int       // checkpoint id -> preparations running
	failed map[string]int       // checkpoint id -> preparations failed in a row
	forks  int                  // forks in progress: no preparation starts meanwhile
	// Children of recent forks that have not finished a first request
	// yet: no preparation starts until they have, or until deferUntil.
	awaiting   map[*sbox]struct{}
	deferUntil time.Time
	deferFor   time.Duration // warmDefer (tests change it)
	kick       chan struct{}
	stop       chan struct{}
	done       chan struct{}
}

func newWarmPool() *warmPool {
	return &warmPool{
		ready: map[string][]*sbox{}, want: map[string]int{}, used: map[string]time.Time{}, making: map[string]int{},
		failed: map[string]int{}, awaiting: map[*sbox]struct{}{}, deferFor: warmDefer,
		kick: make(chan struct{}, 1), stop: make(chan struct{}), done: make(chan struct{}),
	}
}

func (p *warmPool) total() int {
	n := 0
	for _, l := range p.ready {
		n += len(l)
	}
	for _, k := range p.making {
		n += k
	}
	return n
}

// startWarm starts the background preparation of warm forks.
func (m *Manager) startWarm() {
	m.warm = newWarmPool()
	go m.warmLoop()
}

func (m *Manager) kickWarm() {
	select {
	case m.warm.kick <- struct{}{}:
	default:
	}
}

func (m *Manager) warmLoop() {
	w := m.warm
	defer close(w.done)
	t := time.NewTicker(time.Minute)
	defer t.Stop()
	for {
		select {
		case <-w.stop:
			return
		case <-w.kick:
		case <-t.C:
		}
		m.expireWarm()
		m.refillWarm()
	}
}

// stopWarm stops preparing and tears down every prepared child.
func (m *Manager) stopWarm() {
	if m.warm == nil {
		return
	}
	close(m.warm.stop)
	<-m.warm.done
	m.mu.Lock()
	var drop []*sbox
	for id, l := range m.warm.ready {
		drop = append(drop, l...)
		delete(m.warm.ready, id)
	}
	m.mu.Unlock()
	m.discardWarm(drop)
}

// discardWarm stops prepared children and deletes their records.
func (m *Manager) discardWarm(sbs []*sbox) {
	if len(sbs) == 0 {
		return
	}
	m.stopSandboxes(sbs)
	if err := m.persist(func(b *batch) {
		for _, s := range sbs {
			b.delSandboxes = append(b.delSandboxes, s.rec.ID)
		}
	}); err != nil {
		m.log.Warn("delete prepared fork children", "err", err)
	}
}

// dropWarmFor discards the prepared children of the given checkpoints (GC
// frees them). Call without m.mu.
func (m *Manager) dropWarmFor(ids []string) {
	if m.warm == nil {
		return
	}
	m.mu.Lock()
	var drop []*sbox
	for _, id := range ids {
		drop = append(drop, m.warm.ready[id]...)
		delete(m.warm.ready, id)
		delete(m.warm.want, id)
		delete(m.warm.failed, id)
		delete(m.warm.used, id)
	}
	m.mu.Unlock()
	m.discardWarm(drop)
}

// expireWarm drops the prepared children of checkpoints not forked for
// warmIdle.
func (m *Manager) expireWarm() {
	m.mu.Lock()
	var ids []string
	for id, t := range m.warm.used {
		if time.Since(t) > warmIdle {
			ids = append(ids, id)
		}
	}
	m.mu.Unlock()
	m.dropWarmFor(ids)
}

// beginForkWarm marks a fork in progress (preparations pause) and takes up
// to n prepared children of checkpoint id that fit base.
func (m *Manager) beginForkWarm(id string, base *Sandbox, n int) []*sbox {
	if m.warm == nil {
		return nil
	}
	m.mu.Lock()
	m.warm.forks++
	l := m.warm.ready[id]
	var took, misfit []*sbox
	for len(l) > 0 && len(took) < n {
		s := l[0]
		l = l[1:]
		if !sameBases(s.rec.Bases, base.Bases) || s.rec.FSKind != base.FSKind || s.rec.Policy != base.Policy {
			misfit = append(misfit, s)
			continue
		}
		took = append(took, s)
	}
	if len(l) == 0 {
		delete(m.warm.ready, id)
	} else {
		m.warm.ready[id] = l
	}
	m.mu.Unlock()
	m.discardWarm(misfit)
	return took
}

// endForkWarm ends a fork of n children of checkpoint id: the pool now
// keeps n children of id ready (bounded by Config.WarmForks), prepared
// once kids, the fork's children, have each finished a first request (or
// after warmDefer).
func (m *Manager) endForkWarm(id string, n int, ok bool, kids []*sbox) {
	if m.warm == nil {
		return
	}
	m.mu.Lock()
	m.warm.forks--
	if ok {
		m.warm.want[id] = min(n, m.cfg.WarmForks)
		delete(m.warm.failed, id)
		m.warm.used[id] = time.Now()
		for _, k := range kids {
			m.warm.awaiting[k] = struct{}{}
		}
		if len(kids) > 0 {
			m.warm.deferUntil = time.Now().Add(m.warm.deferFor)
			time.AfterFunc(m.warm.deferFor, m.kickWarm)
		}
	}
	m.mu.Unlock()
	m.kickWarm()
}

// servedWarm notes that sandbox s finished a request: a fork child no
// longer holds back the preparation of more children. Call without m.mu.
func (m *Manager) servedWarm(s *sbox) {
	if m.warm == nil {
		return
	}
	m.mu.Lock()
	_, ok := m.warm.awaiting[s]
	if ok {
		delete(m.warm.awaiting, s)
	}
	last := ok && len(m.warm.awaiting) == 0
	m.mu.Unlock()
	if last {
		m.kickWarm()
	}
}

func sameBases(a, b []string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// nextWarm picks the checkpoint that most recently forked and still lacks
// prepared children, and counts one preparation for it. Room is made by
// discarding the children of the least recently forked other checkpoint.
func (m *Manager) nextWarm() (string, bool) {
	m.mu.Lock()
	w := m.warm
	if m.closed || w.forks > 0 {
		m.mu.Unlock()
		return "", false
	}
	if len(w.awaiting) > 0 {
		if time.Now().Before(w.deferUntil) {
			m.mu.Unlock()
			return "", false // kicked by the last child, or at deferUntil
		}
		clear(w.awaiting)
	}
	select {
	case <-w.stop:
		m.mu.Unlock()
		return "", false
	default:
	}
	var ids []string
	for id, n := range w.want {
		if len(w.ready[id])+w.making[id] < n {
			ids = append(ids, id)
		}
	}
	if len(ids) == 0 {
		m.mu.Unlock()
		return "", false
	}
	sort.Slice(ids, func(i, j int) bool { return w.used[ids[i]].After(w.used[ids[j]]) })
	id := ids[0]
	var drop []*sbox
	if w.total() >= m.cfg.WarmForks {
		victim := ""
		for v, l := range w.ready {
			if v != id && len(l) > 0 && (victim == "" || w.used[v].Before(w.used[victim])) {
				victim = v
			}
		}
		if victim == "" {
			m.mu.Unlock()
			return "", false
		}
		drop = w.ready[victim]
		delete(w.ready, victim)
		delete(w.want, victim)
		delete(w.failed, victim)
	}
	w.making[id]++
	m.mu.Unlock()
	m.discardWarm(drop)
	return id, true
}

// refillWarm prepares children until every wanted checkpoint has its count,
// a fork starts, or the manager closes.
func (m *Manager) refillWarm() {
	sem := make(chan struct{}, warmParallel)
	var wg sync.WaitGroup
	defer wg.Wait()
	for {
		id, ok := m.nextWarm()
		if !ok {
			return
		}
		sem <- struct{}{}
		wg.Add(1)
		go func() {
			defer wg.Done()
			defer func() { <-sem }()
			// Made and added under gcMu: GC, which drops the prepared
			// children of the checkpoints it frees, never runs between.
			m.gcMu.RLock()
			s, err := m.prepareWarm(id)
			m.mu.Lock()
			w := m.warm
			w.making[id]--
			if w.making[id] == 0 {
				delete(w.making, id)
			}
			keep := err == nil && !m.closed && m.ckpts[id] != nil && len(w.ready[id]) < w.want[id]
			if keep {
				w.ready[id] = append(w.ready[id], s)
			}
			retry := false
			if err == nil {
				delete(w.failed, id)
			} else if w.failed[id]++; w.failed[id] >= warmMaxFailures {
				// Do not retry a checkpoint that cannot be prepared
				// until it is forked again.
				delete(w.want, id)
				delete(w.failed, id)
			} else {
				retry = true
			}
			m.mu.Unlock()
			m.gcMu.RUnlock()
			if retry {
				// This refill may have handed out its last preparation
				// already: have the loop run again once it returns.
				m.kickWarm()
			}
			if err != nil {
				m.log.Warn("prepare fork child", "checkpoint", id, "err", err)
			} else if !keep {
				m.discardWarm([]*sbox{s})
			}
		}()
	}
}

// prepareWarm makes one child of checkpoint id as Fork would, without a
// name or copy number yet. Call with gcMu read-locked.
func (m *Manager) prepareWarm(id string) (_ *sbox, err error) {
	m.mu.Lock()
	c := m.ckpts[id]
	if c == nil || c.rec.Status != CkptReady {
		m.mu.Unlock()
		return nil, errors.New("checkpoint gone")
	}
	var base Sandbox
	if src := m.byID[c.rec.Sandbox]; src != nil {
		base = *cloneSandbox(&src.rec)
	} else {
		base = Sandbox{Name: c.rec.ID, FSKind: "auto"}
	}
	part, err := m.procPartFor(c)
	m.mu.Unlock()
	if err != nil {
		return nil, err
	}
	sid := newID("sb-")
	rec := Sandbox{
		ID: sid, Name: sid, Bases: base.Bases, FSKind: base.FSKind, Policy: base.Policy,
		Status: StatusRunning, Epoch: 1, Head: c.rec.ID, Created: time.Now().UTC(), Origin: c.rec.ID, Warm: true,
	}
	// Stored first, so a daemon dying meanwhile leaves a record that the
	// next one cleans up.
	if err := m.persist(func(b *batch) { b.putSandboxes = append(b.putSandboxes, cloneSandbox(&rec)) }); err != nil {
		return nil, err
	}
	s := &sbox{rec: rec, q: newQueue()}
	defer func() {
		if err != nil {
			_ = m.persist(func(b *batch) { b.delSandboxes = append(b.delSandboxes, sid) })
		}
	}()
	ctx := context.Background()
	mount, err := m.cfg.FS.MountFrom(ctx, rec.ID, m.spec(&rec), c.rec.FS)
	if err != nil {
		return nil, fmt.Errorf("mount: %w", err)
	}
	p := *part
	if err := m.startLive(ctx, s, mount, &p, nil); err != nil {
		return nil, err
	}
	m.warmUp(ctx, s)
	return s, nil
}

// warmUpArgv is the warm-up command of a prepared child: the shell; a libc
// program (env) that loads the locale of the default environment
// (LANG=C.UTF-8: with no locale archive, about 15 files), as nearly every
// first command does; and the two programs agents' first commands run
// most (a listing and a file read: ls, which also loads the SELinux and
// PCRE2 libraries most file-handling coreutils link, and cat). None of
// them writes anything. A program missing from the base is skipped by the
// shell.
var warmUpArgv = []string{"/bin/sh", "-c", "env >/dev/null; ls / >/dev/null; cat /dev/null"}

// warmUp runs warmUpArgv in a prepared child, so that the child's first
// command finds the shell, the dynamic loader, libc, the locale files and
// the common programs already looked up and read through its own (new,
// cold) file-system mount: on FUSE, each child's mount has its own dentry
// and page cache. It runs twice: FUSE marks a file's atime stale after
// each READ from the daemon, so the first command's fstat of every file
// the first run read would be a GETATTR round trip; the second run, all
// cached, refreshes them. (The first command sh -c 'cat …; ls …' in a
// mount warmed with env alone: 59 FUSE requests, 30 of them lookups and
// 10 reads; warmed with ls and cat as well: 13, the listed directory's
// own and the kernel's per-exec security.capability read. A repeated
// fork of 64 until each child ran bench fanout's first command, on a quiet
// machine: 364-460 ms before, 212-263 ms after; the daemon's CPU time for
// the 64 first commands 195-280 ms before, 87-125 ms after.) Before
// that, the back end reads what the child's own processes map (a
// MappedPrefetcher): the restored shell's program and libraries, whose
// pages its first command would otherwise fault in through the mount,
// one READ of up to a megabyte each. (A repeated fork of 64 whose first
// command is the shell builtin true: 215-224 ms without, 92-110 with.)
// The probe window restarts after it: the warm-up is not an effect of
// the agent's first turn.
func (m *Manager) warmUp(ctx context.Context, s *sbox) {
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	if pf, ok := s.proc.(MappedPrefetcher); ok {
		if err := pf.PrefetchMapped(ctx); err != nil {
			m.log.Debug("prefetch of a prepared fork child's mapped files", "sandbox", s.rec.ID, "err", err)
		}
	}
	for range 2 {
		if _, err := s.proc.Exec(ctx, ExecRequest{Argv: warmUpArgv}); err != nil {
			m.log.Debug("warm-up of a prepared fork child", "sandbox", s.rec.ID, "err", err)
			break
		}
	}
	m.endWindow(ctx, s)
	m.beginWindow(ctx, s)
}

// handOut names a prepared child: it becomes fork child copyN.
func (m *Manager) handOut(s *sbox, name string, copyN int, pol Policy) error {
	m.mu.Lock()
	s.rec.Name, s.rec.Copy, s.rec.Warm, s.rec.Created = name, copyN, false, time.Now().UTC()
	s.policy = pol
	proc := s.proc
	m.mu.Unlock()
	if proc == nil {
		return errors.New("prepared child has no processes")
	}
	for f, data := range runFiles(&s.rec) {
		if err := proc.WriteRunFile(f, []byte(data)); err != nil {
			return fmt.Errorf("write /run/rewind/%s: %w", f, err)
		}
	}
	return nil
}

// WarmForks returns how many prepared fork children are ready, by
// checkpoint id.
func (m *Manager) WarmForks() map[string]int {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := map[string]int{}
	if m.warm == nil {
		return out
	}
	for id, l := range m.warm.ready {
		out[id] = len(l)
	}
	return out
}

// PrepareFork asks for count children of checkpoint id to be prepared in
// the background (bounded by Config.WarmForks), as a fork of that width
// would leave them, so that even the first fork of id only names them. It
// returns how many will be kept ready.
func (m *Manager) PrepareFork(ctx context.Context, id string, count int) (int, error) {
	if count < 1 || count > 1024 {
		return 0, errf(CodeBadRequest, "fork --prepare: --count must be 1..1024", nil)
	}
	if m.warm == nil {
		return 0, errf(CodeBadRequest, "fork --prepare: the daemon prepares no fork children (--warm-forks 0)", nil)
	}
	m.mu.Lock()
	c := m.ckpts[id]
	m.mu.Unlock()
	if c == nil || c.rec.Status == CkptFailed {
		return 0, errf(CodeNotFound, "no checkpoint "+strconv.Quote(id), nil)
	}
	select {
	case <-c.ready:
	case <-ctx.Done():
		return 0, ctx.Err()
	}
	m.mu.Lock()
	failed := c.rec.Status != CkptReady
	m.mu.Unlock()
	if failed {
		return 0, errf(CodeNotReady, "checkpoint "+id+" failed", nil)
	}
	if err := m.awaitImage(ctx, c, false); err != nil {
		return 0, err
	}
	m.mu.Lock()
	n := min(count, m.cfg.WarmForks)
	m.warm.want[id] = max(m.warm.want[id], n)
	delete(m.warm.failed, id)
	m.warm.used[id] = time.Now()
	m.mu.Unlock()
	m.kickWarm()
	return n, nil
}
