package sandbox

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Spares keeps sandbox inits started ahead of time: processes already in
// their new namespaces and in their own cgroups (named by a sandbox id the
// spare reserves), with their runtime initialized, waiting for a setup.
// Spares.Start uses one and so skips process creation and, when the caller
// takes the spare's id (Config.ID empty), every cgroup migration: the path
// for fork fan-out. Idle spares run nothing; they cost a few MiB each.
type Spares struct {
	n        int
	initPath string
	prefix   string
	log      *slog.Logger

	mu     sync.Mutex
	ready  []*initProc
	closed bool
	wake   chan struct{}
	done   chan struct{}
}

// NewSpares keeps n spare inits of the binary initPath ("" means
// /proc/self/exe, as Config.InitPath) with their own network namespace.
// Spare ids are idPrefix followed by 12 random hex digits.
func NewSpares(n int, initPath, idPrefix string, log *slog.Logger) *Spares {
	if initPath == "" {
		initPath = "/proc/self/exe"
	}
	if log == nil {
		log = slog.Default()
	}
	if idPrefix == "" {
		idPrefix = "sb-"
	}
	p := &Spares{n: n, initPath: initPath, prefix: idPrefix, log: log, wake: make(chan struct{}, 1), done: make(chan struct{})}
	go p.refill()
	p.kick()
	return p
}

func (p *Spares) kick() {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return
	}
	select {
	case p.wake <- struct{}{}:
	default:
	}
}

func (p *Spares) refill() {
	defer close(p.done)
	for range p.wake {
		for {
			p.mu.Lock()
			if p.closed || len(p.ready) >= p.n {
				closed := p.closed
				p.mu.Unlock()
				if closed {
					return
				}
				break
			}
			p.mu.Unlock()
			ip, err := p.spawn()
			if err != nil {
				p.log.Warn("spare sandbox init", "err", err)
				time.Sleep(100 * time.Millisecond)
				continue
			}
			p.mu.Lock()
			if p.closed {
				// Closed while this spare was made: Close did not see it.
				p.mu.Unlock()
				ip.kill()
				ip.removeCgroups()
				return
			}
			p.ready = append(p.ready, ip)
			p.mu.Unlock()
		}
	}
}

// take returns a live spare, or nil.
func (p *Spares) take() *initProc {
	p.mu.Lock()
	defer p.mu.Unlock()
	for len(p.ready) > 0 {
		ip := p.ready[0]
		p.ready = p.ready[1:]
		select {
		case <-ip.done:
			continue // died while waiting
		default:
		}
		return ip
	}
	return nil
}

// Ready returns how many spares are waiting.
func (p *Spares) Ready() int {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.ready)
}

// Start starts a sandbox like Start, on a spare init when one is ready and
// cfg fits (own network namespace, no KeepCaps, same init binary, default cgroup
// parents, fewer than maxSetupFDs binds), and starts a replacement spare in the
// background. A waiting spare holds none of the host's mounts: the root and
// the binds' sources are cloned here, at the start, and handed to it. With an
// empty cfg.ID the sandbox takes the spare's id (see Sandbox.ID): the
// fastest path. Without a spare, an empty cfg.ID gets a fresh id.
func (p *Spares) Start(ctx context.Context, cfg Config) (*Sandbox, error) {
	fits := !cfg.HostNet && !cfg.KeepCaps && (cfg.InitPath == "" || cfg.InitPath == p.initPath) &&
		(cfg.FreezerParent == "" || cfg.FreezerParent == DefaultFreezerParent) &&
		(cfg.CgroupV2Parent == "" || cfg.CgroupV2Parent == DefaultCgroupV2Parent) &&
		1+len(cfg.Binds) <= maxSetupFDs
	if !fits {
		if cfg.ID == "" {
			cfg.ID = p.prefix + randomHex(6)
		}
		return Start(ctx, cfg)
	}
	ip := p.take()
	p.kick()
	if ip == nil {
		if cfg.ID == "" {
			cfg.ID = p.prefix + randomHex(6)
		}
		return Start(ctx, cfg)
	}
	return start(ctx, cfg, ip)
}

// spawn starts one spare: cgroups named by a new id, the init cloned
// straight into the v2 one and moved into the v1 ones while nobody waits.
func (p *Spares) spawn() (_ *initProc, err error) {
	id := p.prefix + randomHex(6)
	dirs := []string{filepath.Join(DefaultFreezerParent, id), filepath.Join(DefaultCgroupV2Parent, id)}
	if _, err := os.Stat(filepath.Dir(DefaultPidsParent)); err == nil {
		dirs = append(dirs, filepath.Join(DefaultPidsParent, id))
	}
	ip := &initProc{id: id}
	defer func() {
		if err != nil {
			if ip.cmd != nil {
				ip.kill()
			}
			ip.removeCgroups()
		}
	}()
	for _, dir := range dirs {
		if err := makeCgroup(dir); err != nil {
			return nil, err
		}
		ip.dirs = append(ip.dirs, dir)
	}
	if len(dirs) > 2 {
		if err := os.WriteFile(filepath.Join(dirs[2], "pids.max"), []byte(strconv.Itoa(DefaultPidsMax+initThreadAllowance)), 0); err != nil {
			return nil, err
		}
	}
	v2, err := unix.Open(dirs[1], unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, err
	}
	spawned, err := spawnInit(p.initPath, false, false, true, v2, p.log)
	unix.Close(v2)
	if err != nil {
		return nil, err
	}
	spawned.id, spawned.dirs = ip.id, ip.dirs
	ip = spawned
	for _, dir := range []string{dirs[0], dirs[len(dirs)-1]} {
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(strconv.Itoa(ip.cmd.Process.Pid)), 0); err != nil {
			return nil, fmt.Errorf("join %s: %w", dir, err)
		}
	}
	if err := ip.waitHello(30 * time.Second); err != nil {
		return nil, err
	}
	return ip, nil
}

// removeCgroups removes a spare's cgroups that were not handed over.
func (ip *initProc) removeCgroups() {
	for _, dir := range ip.dirs {
		for i := 0; i < 1000; i++ {
			if err := unix.Rmdir(dir); err == nil || errors.Is(err, unix.ENOENT) {
				break
			}
			time.Sleep(time.Millisecond)
		}
	}
	ip.dirs = nil
}

// takeSpareCgroups gives the spare's cgroups to s: v1 ones are renamed to
// s's id (no task moves); the v2 one is kept when the ids match, else a new
// one is made and joined later. joined gets the dirs the init is in.
func (s *Sandbox) takeSpareCgroups(ip *initProc, joined map[string]bool) error {
	for _, src := range ip.dirs {
		var dst string
		switch filepath.Dir(src) {
		case DefaultFreezerParent:
			dst = s.freezerDir
		case DefaultCgroupV2Parent:
			dst = s.v2Dir
		case DefaultPidsParent:
			dst = filepath.Join(DefaultPidsParent, s.cfg.ID)
		default:
			continue
		}
		switch {
		case src == dst:
		case filepath.Dir(src) == DefaultCgroupV2Parent:
			// cgroup v2 directories cannot be renamed.
			if err := makeCgroup(dst); err != nil {
				return err
			}
			s.spareV2 = src
			continue
		default:
			_ = unix.Rmdir(dst) // an empty leftover of a crash
			if err := unix.Rename(src, dst); err != nil {
				return fmt.Errorf("rename cgroup %s: %w", src, err)
			}
		}
		joined[dst] = true
	}
	ip.dirs = nil // s owns them now
	return nil
}

func randomHex(n int) string {
	b := make([]byte, n)
	_, _ = rand.Read(b)
	return hex.EncodeToString(b)
}

// Close kills the waiting spares.
func (p *Spares) Close() {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return
	}
	p.closed = true
	ready := p.ready
	p.ready = nil
	p.mu.Unlock()
	close(p.wake)
	<-p.done
	for _, ip := range ready {
		ip.kill()
		ip.removeCgroups()
	}
}

// waitHello waits until the init's runtime is up and it waits for a setup.
func (ip *initProc) waitHello(timeout time.Duration) error {
	_ = ip.conn.setReadDeadline(time.Now().Add(timeout))
	defer func() { _ = ip.conn.setReadDeadline(time.Time{}) }()
	buf := make([]byte, 4096)
	oob := make([]byte, unix.CmsgSpace(4*4))
	m, fds, err := ip.conn.recv(buf, oob)
	closeFDs(fds)
	if err != nil {
		return fmt.Errorf("spare init: %w", err)
	}
	if m.Op != opHello {
		return fmt.Errorf("spare init: unexpected %q", m.Op)
	}
	return nil
}

// RemoveStaleSpares removes the empty cgroups of spares with ids idPrefix
// followed by 12 hex digits (NewSpares) that are older than minAge: a
// daemon killed while it had spares leaves theirs behind (the inits die
// with the daemon, their cgroups stay). Non-empty ones (a running spare of
// another daemon) cannot be removed and are left, as are younger ones (a
// spare another daemon is making now, its init not in yet). It returns how
// many it removed.
func RemoveStaleSpares(idPrefix string, minAge time.Duration) int {
	n := 0
	for _, parent := range []string{DefaultFreezerParent, DefaultCgroupV2Parent, DefaultPidsParent} {
		ents, err := os.ReadDir(parent)
		if err != nil {
			continue
		}
		for _, e := range ents {
			rest, ok := strings.CutPrefix(e.Name(), idPrefix)
			if !ok || !e.IsDir() || len(rest) != 12 || strings.Trim(rest, "0123456789abcdef") != "" {
				continue
			}
			dir := filepath.Join(parent, e.Name())
			var st unix.Stat_t
			if unix.Stat(dir, &st) != nil || time.Since(time.Unix(st.Ctim.Unix())) < minAge {
				continue
			}
			if unix.Rmdir(dir) == nil {
				n++
			}
		}
	}
	return n
}
