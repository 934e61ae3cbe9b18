package sandbox

import (
	"context"
	"fmt"
	"log/slog"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Spares keeps sandbox inits started ahead of time: processes already in
// their new namespaces, with their runtime initialized, waiting for a
// setup. Spares.Start uses one and so skips process creation, the larger
// part of a sandbox's start: the path for fork fan-out. Idle spares are in
// no sandbox cgroup and run nothing; they cost a few MiB each.
type Spares struct {
	n        int
	initPath string
	log      *slog.Logger

	mu     sync.Mutex
	ready  []*initProc
	closed bool
	wake   chan struct{}
	done   chan struct{}
}

// NewSpares keeps n spare inits of the binary initPath ("" means
// /proc/self/exe, as Config.InitPath) with their own network namespace.
func NewSpares(n int, initPath string, log *slog.Logger) *Spares {
	if initPath == "" {
		initPath = "/proc/self/exe"
	}
	if log == nil {
		log = slog.Default()
	}
	p := &Spares{n: n, initPath: initPath, log: log, wake: make(chan struct{}, 1), done: make(chan struct{})}
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
			ip, err := spawnInit(p.initPath, false, p.log)
			if err == nil {
				if err = ip.waitHello(30 * time.Second); err != nil {
					ip.kill()
				}
			}
			if err != nil {
				p.log.Warn("spare sandbox init", "err", err)
				time.Sleep(100 * time.Millisecond)
				continue
			}
			p.mu.Lock()
			if p.closed {
				p.mu.Unlock()
				ip.kill()
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
// cfg fits (own network namespace, same init binary), and starts a
// replacement spare in the background.
func (p *Spares) Start(ctx context.Context, cfg Config) (*Sandbox, error) {
	if cfg.HostNet || (cfg.InitPath != "" && cfg.InitPath != p.initPath) {
		return Start(ctx, cfg)
	}
	ip := p.take()
	p.kick()
	if ip == nil {
		return Start(ctx, cfg)
	}
	return start(ctx, cfg, ip)
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
	}
}

// waitHello waits until the init's runtime is up and it waits for a setup.
func (ip *initProc) waitHello(timeout time.Duration) error {
	_ = ip.conn.c.SetReadDeadline(time.Now().Add(timeout))
	defer func() { _ = ip.conn.c.SetReadDeadline(time.Time{}) }()
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
