package probe

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"log/slog"
	"os"
	"sync"
	"time"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/link"
	"github.com/cilium/ebpf/ringbuf"
	"github.com/cilium/ebpf/rlimit"

	"github.com/rewind-sandbox/rewind/effect"
)

// ebpfProbe is the eBPF backend: raw-tracepoint programs attached once for
// the whole host, filtering in the kernel on the cgroup v2 ids of open
// windows (see doc.go).
type ebpfProbe struct {
	log   *slog.Logger
	turns *turns

	cgstats, sysclass, events *ebpf.Map
	progs                     []*ebpf.Program
	links                     []link.Link
	rd                        *ringbuf.Reader
	readerDone                chan struct{}
	sysExit                   *ebpf.Program

	attachMu    sync.Mutex
	sysExitLink link.Link // attached on the first window without an FSSource

	flushMu sync.Mutex // serialises flushes

	mu      sync.Mutex // guards the fields below
	wins    map[uint64]*ebpfWindow
	flushed chan struct{}
	closed  bool
}

// OpenEBPF loads and attaches the eBPF programs. It fails with one line
// naming what is missing when the host cannot run them.
func OpenEBPF(opts Options) (Probe, error) {
	log := opts.Logger
	if log == nil {
		log = slog.Default()
	}
	p := &ebpfProbe{log: log, turns: newTurns(), wins: map[uint64]*ebpfWindow{}}
	if err := p.load(opts); err != nil {
		p.release()
		return nil, fmt.Errorf("probe: eBPF backend: %w", err)
	}
	p.readerDone = make(chan struct{})
	go p.readLoop()
	return p, nil
}

// CheckEBPF reports whether the eBPF backend can load and attach here (nil)
// or why not, in one line.
func CheckEBPF() error {
	p, err := OpenEBPF(Options{Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return err
	}
	return p.Close()
}

func (p *ebpfProbe) load(opts Options) error {
	_ = rlimit.RemoveMemlock() // needless on kernels with memcg accounting
	var err error
	p.cgstats, err = ebpf.NewMap(&ebpf.MapSpec{
		Name: "rw_cgstats", Type: ebpf.Hash, KeySize: 8, ValueSize: nCounters * 8, MaxEntries: 4096,
	})
	if err != nil {
		return fmt.Errorf("create counters map: %w", err)
	}
	p.sysclass, err = ebpf.NewMap(&ebpf.MapSpec{
		Name: "rw_sysclass", Type: ebpf.Array, KeySize: 4, ValueSize: 4, MaxEntries: 512,
	})
	if err != nil {
		return fmt.Errorf("create syscall class map: %w", err)
	}
	for nr, c := range sysClasses {
		if err := p.sysclass.Put(uint32(nr), c); err != nil {
			return fmt.Errorf("fill syscall class map: %w", err)
		}
	}
	size := opts.RingBufferBytes
	if size == 0 {
		size = 4 << 20
	}
	p.events, err = ebpf.NewMap(&ebpf.MapSpec{Name: "rw_events", Type: ebpf.RingBuf, MaxEntries: uint32(size)})
	if err != nil {
		return fmt.Errorf("create ring buffer: %w", err)
	}
	o := loadKernelOffsets()
	raw := func(name string, insns asm.Instructions) *ebpf.ProgramSpec {
		return &ebpf.ProgramSpec{Name: name, Type: ebpf.RawTracepoint, License: "GPL", Instructions: insns}
	}
	specs := []struct {
		tracepoint string
		spec       *ebpf.ProgramSpec
		optional   bool
	}{
		{"sched_process_exec", raw("rw_exec", execProg(p.cgstats.FD(), p.events.FD(), o.binprmFilename)), false},
		{"sched_process_fork", raw("rw_fork", forkProg(p.cgstats.FD(), o)), false},
		{"signal_generate", raw("rw_signal", signalProg(p.cgstats.FD(), o)), false},
		{"inet_sock_set_state", raw("rw_sockstate", sockStateProg(p.cgstats.FD(), p.events.FD(), o)), false},
		{"sock_send_length", raw("rw_sendlen", sendLenProg(p.cgstats.FD(), o)), true}, // Linux >= 6.3
	}
	for _, s := range specs {
		prog, err := ebpf.NewProgram(s.spec)
		if err != nil {
			return fmt.Errorf("load program %s: %w", s.spec.Name, err)
		}
		p.progs = append(p.progs, prog)
		l, err := link.AttachRawTracepoint(link.RawTracepointOptions{Name: s.tracepoint, Program: prog})
		if err != nil {
			if s.optional {
				p.log.Info("probe: optional raw tracepoint unavailable", "tracepoint", s.tracepoint, "err", err)
				continue
			}
			return fmt.Errorf("attach raw tracepoint %s: %w", s.tracepoint, err)
		}
		p.links = append(p.links, l)
	}
	// The syscall program is loaded now (so that a verifier error shows at
	// Open) and attached only when a window needs it (Target.FS == nil):
	// a hook on every syscall of the host costs far more than the others.
	p.sysExit, err = ebpf.NewProgram(raw("rw_sys_exit", sysExitProg(p.cgstats.FD(), p.sysclass.FD(), p.events.FD())))
	if err != nil {
		return fmt.Errorf("load program rw_sys_exit: %w", err)
	}
	p.progs = append(p.progs, p.sysExit)
	p.rd, err = ringbuf.NewReader(p.events)
	if err != nil {
		return fmt.Errorf("open ring buffer reader: %w", err)
	}
	return nil
}

// loadKernelOffsets reads the struct offsets the programs need from the
// kernel's BTF. Unknown offsets are -1 (the programs then do without).
func loadKernelOffsets() kernelOffsets {
	o := kernelOffsets{-1, -1, -1, -1, -1, -1, -1}
	spec, err := btf.LoadKernelSpec()
	if err != nil {
		return o
	}
	field := func(typ, name string) int {
		var s *btf.Struct
		if err := spec.TypeByName(typ, &s); err != nil {
			return -1
		}
		return memberOffset(s.Members, name)
	}
	o.binprmFilename = field("linux_binprm", "filename")
	o.taskPID = field("task_struct", "pid")
	o.taskTGID = field("task_struct", "tgid")
	o.skFamily = field("sock_common", "skc_family")
	o.skDport = field("sock_common", "skc_dport")
	o.skDaddr = field("sock_common", "skc_daddr")
	o.skV6Daddr = field("sock_common", "skc_v6_daddr")
	return o
}

// memberOffset finds a member by name, looking into anonymous structs and
// unions, and returns its byte offset or -1.
func memberOffset(ms []btf.Member, name string) int {
	for _, m := range ms {
		if m.Name == name {
			return int(m.Offset.Bytes())
		}
		if m.Name != "" {
			continue
		}
		var inner []btf.Member
		switch t := btf.UnderlyingType(m.Type).(type) {
		case *btf.Struct:
			inner = t.Members
		case *btf.Union:
			inner = t.Members
		}
		if off := memberOffset(inner, name); off >= 0 {
			return int(m.Offset.Bytes()) + off
		}
	}
	return -1
}

// release frees whatever load created.
func (p *ebpfProbe) release() {
	if p.sysExitLink != nil {
		p.sysExitLink.Close()
	}
	for _, l := range p.links {
		l.Close()
	}
	for _, pr := range p.progs {
		pr.Close()
	}
	if p.rd != nil {
		p.rd.Close()
	}
	for _, m := range []*ebpf.Map{p.cgstats, p.sysclass, p.events} {
		if m != nil {
			m.Close()
		}
	}
}

func (p *ebpfProbe) Backend() string { return effect.BackendEBPF }

func (p *ebpfProbe) Close() error {
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		return nil
	}
	p.closed = true
	p.wins = map[uint64]*ebpfWindow{}
	p.mu.Unlock()
	for _, l := range p.links {
		l.Close()
	}
	p.links = nil
	p.attachMu.Lock()
	if p.sysExitLink != nil {
		p.sysExitLink.Close()
		p.sysExitLink = nil
	}
	p.attachMu.Unlock()
	p.rd.Close()
	<-p.readerDone
	p.rd = nil
	p.release()
	return nil
}

// readLoop dispatches ring-buffer samples to their windows until Close.
func (p *ebpfProbe) readLoop() {
	defer close(p.readerDone)
	var rec ringbuf.Record
	for {
		err := p.rd.ReadInto(&rec)
		switch {
		case err == nil:
			p.dispatch(rec.RawSample)
		case errors.Is(err, ringbuf.ErrFlushed):
			p.mu.Lock()
			if p.flushed != nil {
				close(p.flushed)
				p.flushed = nil
			}
			p.mu.Unlock()
		case errors.Is(err, ringbuf.ErrClosed), errors.Is(err, os.ErrClosed):
			return
		default:
			p.log.Warn("probe: ring buffer read", "err", err)
			time.Sleep(10 * time.Millisecond)
		}
	}
}

// flush returns once every sample committed before the call is dispatched.
func (p *ebpfProbe) flush() error {
	p.flushMu.Lock()
	defer p.flushMu.Unlock()
	ch := make(chan struct{})
	p.mu.Lock()
	p.flushed = ch
	p.mu.Unlock()
	if err := p.rd.Flush(); err != nil {
		return fmt.Errorf("flush ring buffer: %w", err)
	}
	select {
	case <-ch:
		return nil
	case <-time.After(5 * time.Second):
		return errors.New("flush ring buffer: reader did not answer in 5s")
	}
}

// event is a decoded ring-buffer sample.
type event struct {
	cgid uint64
	kind uint32
	pid  uint32
	aux  uint64
	comm string
	data []byte
}

func cstr(b []byte) string {
	if i := bytes.IndexByte(b, 0); i >= 0 {
		b = b[:i]
	}
	return string(b)
}

func (p *ebpfProbe) dispatch(raw []byte) {
	if len(raw) < evtSize {
		return
	}
	le := binary.LittleEndian
	ev := event{
		cgid: le.Uint64(raw[evtCgid:]),
		kind: le.Uint32(raw[evtKind:]),
		pid:  le.Uint32(raw[evtPID:]),
		aux:  le.Uint64(raw[evtAux:]),
		comm: cstr(raw[evtComm : evtComm+16]),
		data: raw[evtData : evtData+evtDataLen],
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	w := p.wins[ev.cgid]
	if w == nil {
		return
	}
	w.add(ev)
}

func (p *ebpfProbe) Begin(t Target) (Window, error) {
	return p.begin(t, nil, false)
}

// BeginKnown implements KnownBeginner.
func (p *ebpfProbe) BeginKnown(t Target, pids []int) (Window, error) {
	return p.begin(t, pids, true)
}

// begin opens a window; with known, pids are the agent's processes and the
// first snapshot reads only them.
func (p *ebpfProbe) begin(t Target, pids []int, known bool) (Window, error) {
	if t.CgroupV2Dir == "" {
		return nil, fmt.Errorf("begin %s: no cgroup v2 dir in target", t.Sandbox)
	}
	cgid := t.CgroupID
	if cgid == 0 {
		var err error
		if cgid, err = CgroupID(t.CgroupV2Dir); err != nil {
			return nil, fmt.Errorf("begin %s: %w", t.Sandbox, err)
		}
	}
	turn, err := p.turns.acquire(t.Sandbox)
	if err != nil {
		return nil, err
	}
	w := &ebpfWindow{p: p, t: t, cgid: cgid, turn: turn, began: time.Now()}
	p.mu.Lock()
	if p.closed {
		p.mu.Unlock()
		p.turns.release(t.Sandbox)
		return nil, ErrClosed
	}
	if p.wins[cgid] != nil {
		p.mu.Unlock()
		p.turns.release(t.Sandbox)
		return nil, fmt.Errorf("begin %s: cgroup %d already observed by sandbox %s", t.Sandbox, cgid, p.wins[cgid].t.Sandbox)
	}
	p.wins[cgid] = w
	p.mu.Unlock()
	fail := func(err error) (Window, error) {
		w.Abort()
		return nil, fmt.Errorf("begin %s: %w", t.Sandbox, err)
	}
	if t.FS != nil {
		t.FS.TakeFSEffects()
	} else if err := p.attachSysExit(); err != nil {
		return fail(err)
	}
	var zero [nCounters]uint64
	if err := p.cgstats.Put(cgid, zero); err != nil {
		return fail(fmt.Errorf("arm cgroup %d: %w", cgid, err))
	}
	if known {
		w.begin = snapshotOf(t.Files, pids, false)
	} else if w.begin, err = takeSnapshot(t.Files, t.CgroupV2Dir, false, t.excluder(), nil); err != nil {
		return fail(err)
	}
	return w, nil
}

// attachSysExit attaches the syscall program once; it stays attached until
// Close.
func (p *ebpfProbe) attachSysExit() error {
	p.attachMu.Lock()
	defer p.attachMu.Unlock()
	if p.sysExitLink != nil {
		return nil
	}
	l, err := link.AttachRawTracepoint(link.RawTracepointOptions{Name: "sys_exit", Program: p.sysExit})
	if err != nil {
		return fmt.Errorf("attach raw tracepoint sys_exit: %w", err)
	}
	p.sysExitLink = l
	return nil
}

// ebpfWindow is one turn observed by the eBPF backend.
type ebpfWindow struct {
	p     *ebpfProbe
	t     Target
	cgid  uint64
	turn  uint64
	began time.Time
	begin *snapshot

	// Guarded by p.mu.
	fsSamples   []effect.PathSample
	execSamples []effect.Exec
	remotes     []string

	endMu sync.Mutex
	done  bool
}

// add records a sample; p.mu is held.
func (w *ebpfWindow) add(ev event) {
	switch ev.kind {
	case evFS:
		if len(w.fsSamples) < effect.MaxSamples {
			w.fsSamples = append(w.fsSamples, effect.PathSample{Op: fsOpName(ev.aux), Path: cstr(ev.data)})
		}
	case evExec:
		if len(w.execSamples) < effect.MaxSamples {
			w.execSamples = append(w.execSamples, effect.Exec{PID: int(ev.pid), Comm: ev.comm, Argv0: cstr(ev.data)})
		}
	case evNet:
		if s, ok := sockaddrString(ev.data); ok {
			w.remotes = appendRemote(w.remotes, s)
		}
	}
}

// sockaddrString formats a raw sockaddr_in or sockaddr_in6.
func sockaddrString(b []byte) (string, bool) {
	if len(b) < 24 {
		return "", false
	}
	fam := binary.LittleEndian.Uint16(b)
	port := binary.BigEndian.Uint16(b[2:])
	switch fam {
	case 2:
		return joinHostPort(b[4:8], port), true
	case 10:
		return joinHostPort(b[8:24], port), true
	}
	return "", false
}

// detach stops counting and forgets the window.
func (w *ebpfWindow) detach() (vals [nCounters]uint64, err error) {
	err = w.p.cgstats.LookupAndDelete(w.cgid, &vals)
	w.p.mu.Lock()
	if w.p.wins[w.cgid] == w {
		delete(w.p.wins, w.cgid)
	}
	w.p.mu.Unlock()
	w.p.turns.release(w.t.Sandbox)
	return vals, err
}

func (w *ebpfWindow) Abort() {
	w.endMu.Lock()
	defer w.endMu.Unlock()
	if w.done {
		return
	}
	w.done = true
	w.detach()
	w.p.turns.giveBack(w.t.Sandbox, w.turn)
}

func (w *ebpfWindow) End() (*effect.Report, error) {
	r, _, err := w.finish(false)
	return r, err
}

func (w *ebpfWindow) Next() (*effect.Report, Window, error) {
	r, nw, err := w.finish(true)
	if err != nil {
		return nil, nil, err
	}
	return r, nw, nil
}

// samplesTaken reports whether the eBPF programs took a sample for the
// window so far (or the counters cannot be read: then it may have).
func (w *ebpfWindow) samplesTaken() bool {
	var vals [nCounters]uint64
	if err := w.p.cgstats.Lookup(w.cgid, &vals); err != nil {
		return true
	}
	return vals[cSampFS]+vals[cSampExec]+vals[cSampNet] > 0
}

// rearm reads and zeroes the window's counters and hands the cgroup over to
// a new window for the next turn.
func (w *ebpfWindow) rearm(began time.Time) (vals [nCounters]uint64, nw *ebpfWindow, err error) {
	if err := w.p.cgstats.LookupAndDelete(w.cgid, &vals); err != nil {
		w.detach()
		return vals, nil, err
	}
	var zero [nCounters]uint64
	if err := w.p.cgstats.Put(w.cgid, zero); err != nil {
		w.detach()
		return vals, nil, fmt.Errorf("re-arm cgroup %d: %w", w.cgid, err)
	}
	nw = &ebpfWindow{p: w.p, t: w.t, cgid: w.cgid, turn: w.p.turns.advance(w.t.Sandbox), began: began}
	w.p.mu.Lock()
	w.p.wins[w.cgid] = nw
	w.p.mu.Unlock()
	return vals, nw, nil
}

func (w *ebpfWindow) finish(next bool) (*effect.Report, *ebpfWindow, error) {
	w.endMu.Lock()
	defer w.endMu.Unlock()
	if w.done {
		return nil, nil, fmt.Errorf("end %s turn %d: %w", w.t.Sandbox, w.turn, ErrClosed)
	}
	w.done = true
	ended := time.Now()
	r := newReport(effect.BackendEBPF, w.t.Sandbox, w.turn, w.began, ended)
	if w.t.FS != nil {
		r.FS = boundFS(w.t.FS.TakeFSEffects())
	}
	// The samples committed so far, then the counters (which stops or
	// restarts counting), then the processes. No sample needs waiting for
	// when none was taken: every program counts its sample (cSamp*) before
	// it writes one, so a window whose sample counters read zero has none
	// committed, and the round trip to the reader is saved.
	var flushErr error
	if w.samplesTaken() {
		flushErr = w.p.flush()
	}
	var (
		c   [nCounters]uint64
		nw  *ebpfWindow
		err error
	)
	if next {
		c, nw, err = w.rearm(ended)
	} else {
		c, err = w.detach()
	}
	if err != nil {
		return nil, nil, fmt.Errorf("end %s turn %d: read counters: %w", w.t.Sandbox, w.turn, err)
	}
	fail := func(err error) (*effect.Report, *ebpfWindow, error) {
		if nw != nil {
			nw.Abort()
		}
		return nil, nil, fmt.Errorf("end %s turn %d: %w", w.t.Sandbox, w.turn, err)
	}
	if flushErr != nil {
		return fail(flushErr)
	}
	end, err := takeSnapshot(w.t.Files, w.t.CgroupV2Dir, false, w.t.excluder(), w.begin)
	if err != nil {
		return fail(err)
	}
	applySnapshots(r, w.begin, end, w.t.InitPID)
	if nw != nil {
		nw.begin = end
	}

	w.p.mu.Lock()
	fsSamples, execSamples, remotes := w.fsSamples, w.execSamples, w.remotes
	w.p.mu.Unlock()

	r.LostEvents = c[cLost]
	r.Proc.Forked = c[cForked]
	r.Proc.Execs = c[cExecs]
	r.Proc.SignalsSent = c[cSignals]
	r.Proc.ExecSamples = execSamples
	r.Mem.Mmaps = c[cMmaps]
	r.Mem.Munmaps = c[cMunmaps]
	r.Mem.Brks = c[cBrks]
	r.Net.RemoteConnects = c[cRemote]
	r.Net.Listens = c[cListens]
	r.Net.BytesSent = c[cBytesSent]
	r.Net.Remotes = remotes
	if w.t.FS == nil {
		r.FS.Created = c[cCreated]
		r.FS.Modified = c[cModified]
		r.FS.Deleted = c[cDeleted]
		r.FS.Renamed = c[cRenamed]
		r.FS.MetaChanged = c[cMeta]
		r.FS.Samples = fsSamples
	}
	return r, nw, nil
}
