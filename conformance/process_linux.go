package conformance

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/conformance/tree"
	"github.com/rewind-sandbox/rewind/cr"
	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/layer"
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
	"github.com/rewind-sandbox/rewind/probe"
	"github.com/rewind-sandbox/rewind/sandbox"
)

// Process and probe path names.
var (
	ProcPaths  = []string{"template", "criu", "kernel-proc"}
	ProbePaths = []string{"ebpf", "userspace"}
)

// ProcOptions configures RunProcess.
type ProcOptions struct {
	// Paths lists the process paths ("template", "criu", "kernel-proc")
	// and probe paths ("ebpf", "userspace") to run.
	Paths []string
	// WorkDir is a scratch directory (layer store, FUSE mount, images).
	WorkDir string
	// CRIUPath is the criu binary ("" = cr's default search).
	CRIUPath string
	// Logger receives the back ends' logs (default: discarded).
	Logger *slog.Logger
	// Keep leaves each run's work directory (CRIU logs, layers) in place.
	Keep bool
}

// procTimeout bounds one session exchange.
const procTimeout = 60 * time.Second

// turnSig is what the built-in policies read from a turn's EffectReport,
// reduced to what both probe backends promise to report identically (see
// probe's field table): the decision of every built-in policy and the
// facts they decide on. Counts that only eBPF sees (Forked, Execs) and
// estimates (the number of pages written) are left out.
type turnSig struct {
	Decisions     map[string]string `json:"decisions"`
	FSChanged     bool              `json:"fs_changed"`
	NewLongLived  uint64            `json:"new_long_lived"`
	PreExited     uint64            `json:"preexisting_exited"`
	MemWritten    bool              `json:"mem_written"`
	CwdChanges    uint64            `json:"cwd_changes"`
	NetEffect     bool              `json:"net_effect"`
	LostEvents    bool              `json:"lost_events"`
	EffectsReason string            `json:"-"`
}

func (s turnSig) String() string {
	names := make([]string, 0, len(s.Decisions))
	for n := range s.Decisions {
		names = append(names, n)
	}
	sort.Strings(names)
	var b strings.Builder
	for _, n := range names {
		fmt.Fprintf(&b, "%s=%s ", n, s.Decisions[n])
	}
	fmt.Fprintf(&b, "fs=%t newLongLived=%d preExited=%d mem=%t cwd=%d net=%t lost=%t",
		s.FSChanged, s.NewLongLived, s.PreExited, s.MemWritten, s.CwdChanges, s.NetEffect, s.LostEvents)
	return b.String()
}

func decisionName(d guest.Decision) string {
	switch d {
	case guest.Skip:
		return "skip"
	case guest.FS:
		return "fs"
	case guest.Full:
		return "full"
	}
	return "error"
}

func signature(r *effect.Report) turnSig {
	s := turnSig{Decisions: map[string]string{}}
	for _, n := range rules.Names() {
		fn, _ := rules.ByName(n)
		d, reason := fn(r)
		s.Decisions[n] = decisionName(d)
		if n == rules.NameEffects {
			s.EffectsReason = reason
		}
	}
	s.FSChanged = r.FSChanged()
	s.NewLongLived = r.Proc.NewLongLived
	s.PreExited = rules.PreexistingExited(r)
	s.MemWritten = r.Mem.PagesWritten > 0
	s.CwdChanges = r.Proc.CwdChanges
	s.NetEffect = r.Net.RemoteConnects+r.Net.Listens > 0
	s.LostEvents = r.LostEvents > 0
	return s
}

// procRun is one execution of a process workload with one process path
// and one probe backend.
type procRun struct {
	w        *Workload
	procPath string // "template" | "criu" | "kernel-proc" | ""
	probeBk  string // "ebpf" | "userspace" | ""
	log      *slog.Logger

	fsys layer.FS
	// reroot: the root is a native overlay on a stock kernel (path
	// kernel-proc), whose switch replaces the sandbox's root mount.
	reroot bool
	sb     *sandbox.Sandbox
	eng    *cr.Engine
	prb    probe.Probe
	win    probe.Window
	ops    *opState
	sess   map[string]Step // session name -> its session step
	recs   map[string]procRecord
	ckIDs  map[string]string
	fsIDs  map[string]string
	// ckSess maps, per label, the host pid of each session process at
	// checkpoint time to its session, to give restored copies their
	// session's stdio back.
	ckSess map[string]map[int]string
	nck    int
	turns  []turnSig

	procFail, probeFail *PathResult
}

// procRecord is the state recorded at a checkpoint: the reference a restore
// must reproduce.
type procRecord struct {
	states map[string]string // session -> state digest output
	shape  string
	tree   tree.Snapshot
	mode   cr.Mode // how the engine took the checkpoint
}

// RunProcess executes a process workload (one with session steps) on the
// process paths and probe paths in opts.Paths. Each run starts a real
// sandbox (package sandbox) whose root is a FUSE view (package fs), drives
// its sessions, checkpoints with cr.Engine (the fs checkpoint in the
// freeze barrier) and restores through the template pool ("template") or,
// with the templates evicted, through the CRIU image ("criu"); on
// "kernel-proc" the root is a native overlay (package kernelpath) and, on
// a stock kernel, each restore's switch replaces the sandbox's root mount
// as the daemon's does (the template copies move onto it, see
// cr.RestoreOptions.Reroot). At every
// checkpoint it records each session's state digest, the process tree
// shape and the tree; after every restore they must be identical. At every
// turn the probe's report is reduced to what the built-in policies read
// (turnSig); turns with an expect must decide it, and the eBPF and
// userspace backends must agree turn by turn.
func RunProcess(ctx context.Context, w *Workload, opts ProcOptions) (*Result, error) {
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	res := &Result{Workload: w.Name, Steps: len(w.Steps), Paths: make([]PathResult, 0, len(opts.Paths))}
	if !w.Process() {
		for _, p := range opts.Paths {
			res.Paths = append(res.Paths, PathResult{Path: p, Status: "skip", Detail: "file-system workload (Run)"})
		}
		return res, nil
	}
	var procs []string
	for _, p := range opts.Paths {
		switch {
		case slices.Contains(ProcPaths, p):
			procs = append(procs, p)
		case slices.Contains(ProbePaths, p):
			// Probe paths run alongside every process run; nothing to collect.
		default:
			return nil, fmt.Errorf("conformance: %q is not a process or probe path", p)
		}
		res.Paths = append(res.Paths, PathResult{Path: p, Status: "pass"})
	}
	byName := func(p string) *PathResult {
		for i := range res.Paths {
			if res.Paths[i].Path == p {
				return &res.Paths[i]
			}
		}
		return nil
	}
	// One run per path: a process path runs without a probe, a probe path
	// with the engine's default restore (templates), so a failure is
	// attributed to exactly one path.
	var sigs [][]turnSig
	var sigPaths []string
	for _, p := range opts.Paths {
		r := &procRun{w: w, log: log}
		if slices.Contains(procs, p) {
			r.procPath, r.procFail = p, byName(p)
		} else {
			r.probeBk, r.probeFail = p, byName(p)
		}
		dir, err := os.MkdirTemp(opts.WorkDir, "proc-")
		if err != nil {
			return nil, fmt.Errorf("conformance: %w", err)
		}
		err = r.run(ctx, dir, opts.CRIUPath)
		if !opts.Keep {
			os.RemoveAll(dir)
		}
		if err != nil {
			pr := byName(p)
			if pr.Status == "pass" {
				pr.Status, pr.Step, pr.Detail = "fail", -1, err.Error()
			}
			continue
		}
		if r.probeBk != "" && r.probeFail.Status == "pass" && len(r.turns) == 0 {
			r.probeFail.Status, r.probeFail.Detail = "skip", "the workload has no turn"
		}
		if r.probeBk != "" && r.probeFail.Status == "pass" {
			sigs = append(sigs, r.turns)
			sigPaths = append(sigPaths, r.probeBk)
		}
	}
	// The probe backends must agree turn by turn.
	if len(sigs) == 2 {
		a, b := sigs[0], sigs[1]
		for t := 0; t < min(len(a), len(b)); t++ {
			if a[t].String() != b[t].String() {
				detail := fmt.Sprintf("turn %d: %s reports %s; %s reports %s", t+1, sigPaths[0], a[t], sigPaths[1], b[t])
				for _, p := range sigPaths {
					pr := byName(p)
					pr.Status, pr.Step, pr.Op, pr.Detail = "fail", turnStep(w, t), "turn", detail
				}
				break
			}
		}
	}
	return res, nil
}

// turnStep returns the step index of the t-th turn (0-based).
func turnStep(w *Workload, t int) int {
	for i, s := range w.Steps {
		if s.Op == "turn" {
			if t == 0 {
				return i
			}
			t--
		}
	}
	return -1
}

func (r *procRun) fail(pr *PathResult, i int, s Step, format string, args ...any) {
	if pr == nil || pr.Status != "pass" {
		return
	}
	pr.Status, pr.Step, pr.Op, pr.Detail = "fail", i, s.Op, fmt.Sprintf(format, args...)
}

// criuBinary returns the criu binary cr uses: path, $REWIND_CRIU,
// /opt/rewind/criu/sbin/criu, then PATH.
func criuBinary(path string) string {
	if path == "" {
		path = os.Getenv("REWIND_CRIU")
	}
	if path == "" {
		path = "/opt/rewind/criu/sbin/criu"
		if _, err := os.Stat(path); err != nil {
			if p, err := exec.LookPath("criu"); err == nil {
				path = p
			}
		}
	}
	return path
}

// CheckCRIU reports whether the criu binary cr would use exists and runs.
func CheckCRIU(path string) error {
	bin := criuBinary(path)
	if out, err := exec.Command(bin, "--version").CombinedOutput(); err != nil {
		return fmt.Errorf("criu %s: %v: %s", bin, err, strings.TrimSpace(string(out)))
	}
	return nil
}

// criuRoot returns the directory to bind into the sandbox so that the criu
// binary and its files are visible inside it (.../criu/sbin/criu -> .../criu).
func criuRoot(path string) string {
	return filepath.Dir(filepath.Dir(criuBinary(path)))
}

func (r *procRun) run(ctx context.Context, dir, criuPath string) error {
	st, err := layer.OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		return err
	}
	mp := filepath.Join(dir, "root")
	if err := os.Mkdir(mp, 0o755); err != nil {
		return err
	}
	id := "conf-" + layer.NewID()
	if r.procPath == "kernel-proc" {
		kf, err := kernelpath.Mount(st, mp, kernelpath.Options{MountID: id, Logger: r.log})
		if err != nil {
			return fmt.Errorf("kernel mount: %w", err)
		}
		r.fsys, r.reroot = kf, kf.FreezeMode() != kernelpath.FreezeIoctl
	} else if r.fsys, err = fs.Mount(st, mp, fs.Options{MountID: id, Logger: r.log}); err != nil {
		return fmt.Errorf("fuse mount: %w", err)
	}
	defer r.fsys.Unmount()
	binds, err := sandbox.MinimalRoot(mp)
	if err != nil {
		return err
	}
	// Images on every path, as in the daemon: a checkpoint of a process
	// tree needs CRIU whatever the path.
	cfg := cr.Config{CRIUPath: criuPath, ImagesDir: filepath.Join(dir, "images"), Logger: r.log}
	if cr := criuRoot(criuPath); cr != "/" && cr != "/usr" {
		if err := os.MkdirAll(filepath.Join(mp, cr), 0o755); err != nil {
			return err
		}
		binds = append(binds, sandbox.Bind{Source: cr, Target: cr, ReadOnly: true})
	}
	r.sb, err = sandbox.Start(ctx, sandbox.Config{ID: id, Root: mp, Binds: binds, Logger: r.log})
	if err != nil {
		return fmt.Errorf("sandbox: %w", err)
	}
	r.eng, err = cr.New(cfg)
	if err != nil {
		r.sb.Close()
		return fmt.Errorf("cr engine: %w", err)
	}
	r.sb.OnClose(func() { r.eng.DropSandbox(id) })
	defer func() {
		r.sb.Close()
		r.eng.Close()
	}()
	if r.probeBk != "" {
		r.prb, err = probe.Open(probe.Options{Backend: r.probeBk, Logger: r.log})
		if err != nil {
			return fmt.Errorf("probe %s: %w", r.probeBk, err)
		}
		defer r.prb.Close()
	}
	r.ops = &opState{root: mp, fds: map[string]*heldFD{}}
	defer r.ops.closeFDs()
	r.sess, r.recs, r.ckIDs, r.fsIDs = map[string]Step{}, map[string]procRecord{}, map[string]string{}, map[string]string{}
	r.ckSess = map[string]map[int]string{}
	if err := r.begin(); err != nil {
		return err
	}
	for i, s := range r.w.Steps {
		if err := ctx.Err(); err != nil {
			return err
		}
		if err := r.step(ctx, i, s); err != nil {
			return fmt.Errorf("step %d (%s): %w", i, describe(s), err)
		}
		if (r.procFail != nil && r.procFail.Status != "pass") || (r.probeFail != nil && r.probeFail.Status != "pass") {
			break
		}
	}
	if r.win != nil {
		r.win.Abort()
	}
	return nil
}

// quiesce waits until every live sandbox process has stopped running (its
// scheduler run time unchanged over 20 ms and not runnable), so that the
// tail of a session's last answer (a prompt, the return to read(2)) is not
// attributed to the next turn. It gives up silently after 10 s.
func (r *procRun) quiesce() {
	ps, err := r.eng.Processes(r.sb)
	if err != nil || len(ps) == 0 {
		return
	}
	sample := func() string {
		var b strings.Builder
		for _, p := range ps {
			st, _ := os.ReadFile(fmt.Sprintf("/proc/%d/schedstat", p.PID))
			stat, _ := os.ReadFile(fmt.Sprintf("/proc/%d/stat", p.PID))
			state := ""
			if i := strings.LastIndexByte(string(stat), ')'); i > 0 && i+2 < len(stat) {
				state = string(stat[i+2 : i+3])
			}
			if state == "R" {
				return "" // running: never equal
			}
			fmt.Fprintf(&b, "%d:%s:%s;", p.PID, strings.Fields(string(st) + " x")[0], state)
		}
		return b.String()
	}
	start := time.Now()
	defer func() { r.log.Debug("quiesce", "took", time.Since(start), "procs", len(ps)) }()
	deadline := time.Now().Add(10 * time.Second)
	prev := sample()
	for time.Now().Before(deadline) {
		time.Sleep(20 * time.Millisecond)
		cur := sample()
		if cur != "" && cur == prev {
			return
		}
		prev = cur
	}
}

// begin opens a probe window; checkpoint templates (processes of the
// cgroup that are not live sandbox processes) are excluded.
func (r *procRun) begin() error {
	if r.prb == nil {
		return nil
	}
	r.quiesce()
	live := map[int]bool{r.sb.InitPID(): true}
	ps, err := r.eng.Processes(r.sb)
	if err != nil {
		return err
	}
	for _, p := range ps {
		live[p.PID] = true
	}
	all, err := r.sb.Processes()
	if err != nil {
		return err
	}
	excl := map[int]bool{}
	for _, p := range all {
		if !live[p.PID] {
			excl[p.PID] = true
		}
	}
	var mu sync.Mutex
	r.win, err = r.prb.Begin(probe.Target{
		Sandbox: r.sb.ID(), CgroupV2Dir: r.sb.CgroupV2Dir(), InitPID: r.sb.InitPID(), FS: r.fsys,
		Exclude: func(pid int) bool { mu.Lock(); defer mu.Unlock(); return excl[pid] },
	})
	return err
}

func (r *procRun) abort() {
	if r.win != nil {
		r.win.Abort()
		r.win = nil
	}
}

// send writes text to a session followed by its marker and returns what it
// printed before the marker.
func (r *procRun) send(ctx context.Context, name, text string) (string, error) {
	ss := r.sb.Session(name)
	s, ok := r.sess[name]
	if ss == nil || !ok {
		return "", fmt.Errorf("no session %q", name)
	}
	r.nck++
	m := fmt.Sprintf("__rewind_conformance_%d__", r.nck)
	ctx, cancel := context.WithTimeout(ctx, procTimeout)
	defer cancel()
	out, err := ss.Send(ctx, text+"\n"+strings.ReplaceAll(s.Marker, "{m}", m), sandbox.SendOptions{Until: regexp.MustCompile(regexp.QuoteMeta(m) + `\r?\n`)})
	if err != nil {
		return out, fmt.Errorf("session %s: %w (output %q)", name, err, trunc(out))
	}
	before, _, found := strings.Cut(out, m)
	if !found {
		return out, fmt.Errorf("session %s: no marker in %q", name, trunc(out))
	}
	return before, nil
}

// shape is the canonical process tree shape: each live process as its
// depth below init and its command name, sorted.
func (r *procRun) shape() (string, error) {
	ps, err := r.eng.Processes(r.sb)
	if err != nil {
		return "", err
	}
	parent := map[int]int{}
	comm := map[int]string{}
	for _, p := range ps {
		parent[p.PID], comm[p.PID] = p.PPID, p.Comm
	}
	var lines []string
	for _, p := range ps {
		d, q := 0, p.PID
		for q != r.sb.InitPID() && q > 1 && d < 64 {
			q = parent[q]
			d++
			if _, ok := parent[q]; !ok && q != r.sb.InitPID() {
				break
			}
		}
		lines = append(lines, fmt.Sprintf("%d:%s", d, comm[p.PID]))
	}
	sort.Strings(lines)
	return strings.Join(lines, ","), nil
}

// criuKdat are the files CRIU writes into the sandbox's own /run (its
// kernel-feature cache) whenever it runs inside the sandbox; they are not
// the agent's state. Reported to the cr
// area; excluded from the file-tree comparison of the process paths.
var criuKdat = []string{"run/criu.kdat", "run/criu.kdat.tmp"}

// treeExclude: CRIU runs on every path (images are written for every
// checkpoint), so its cache files are excluded on every process path.
func (r *procRun) treeExclude() []string { return criuKdat }

func (r *procRun) record(ctx context.Context) (procRecord, error) {
	rec := procRecord{states: map[string]string{}}
	for name, s := range r.sess {
		out, err := r.send(ctx, name, s.State)
		if err != nil {
			return rec, err
		}
		rec.states[name] = out
	}
	var err error
	if rec.shape, err = r.shape(); err != nil {
		return rec, err
	}
	rec.tree, err = tree.Take(r.ops.root, tree.Options{IgnoreRoot: true, Exclude: r.treeExclude()})
	return rec, err
}

func (r *procRun) step(ctx context.Context, i int, s Step) error {
	switch s.Op {
	case "session":
		r.sess[s.Session] = s
		_, err := r.sb.StartSession(ctx, sandbox.SessionConfig{ID: s.Session, Argv: s.Argv, Dir: "/"})
		return err
	case "send":
		out, err := r.send(ctx, s.Session, s.Data)
		if err != nil {
			return err
		}
		if s.Expect != nil && out != *s.Expect {
			r.fail(r.procFail, i, s, "session %s printed %q, want %q", s.Session, trunc(out), trunc(*s.Expect))
		}
		return nil
	case "sh":
		var out strings.Builder
		cctx, cancel := context.WithTimeout(ctx, shTimeout)
		defer cancel()
		code, err := r.sb.Exec(cctx, sandbox.ExecRequest{Argv: []string{"sh", "-c", s.Cmd}, Dir: "/", Stdout: &out, Stderr: &out})
		if err != nil {
			return err
		}
		if code != 0 && s.Error == "" {
			return fmt.Errorf("exit status %d: %s", code, trunc(out.String()))
		}
		if s.Expect != nil && out.String() != *s.Expect {
			return fmt.Errorf("printed %q, the workload expects %q", trunc(out.String()), trunc(*s.Expect))
		}
		return nil
	case "turn":
		if r.win == nil {
			return nil
		}
		r.quiesce()
		rep, err := r.win.End()
		r.win = nil
		if err != nil {
			return fmt.Errorf("probe end: %w", err)
		}
		sig := signature(rep)
		r.turns = append(r.turns, sig)
		if r.probeFail != nil {
			r.probeFail.Compares++
		}
		if s.Expect != nil && sig.Decisions[rules.NameEffects] != *s.Expect {
			r.fail(r.probeFail, i, s, "turn %d: effects policy decided %s (%s), the workload expects %s; report: %s",
				len(r.turns), sig.Decisions[rules.NameEffects], sig.EffectsReason, *s.Expect, sig)
		}
		return r.begin()
	case "checkpoint":
		r.abort()
		rec, err := r.record(ctx)
		if err != nil {
			return err
		}
		sessOf := map[int]string{}
		for _, ss := range r.sb.Sessions() {
			if pid := ss.PID(); pid > 0 {
				sessOf[pid] = ss.ID()
			}
		}
		r.nck++
		ckID := fmt.Sprintf("ck-%d", r.nck)
		var fsID string
		ck, err := r.eng.Checkpoint(ctx, r.sb, cr.CheckpointOptions{ID: ckID, Barrier: func() error {
			var err error
			fsID, err = r.fsys.Checkpoint()
			return err
		}})
		if err != nil {
			return fmt.Errorf("checkpoint: %w", err)
		}
		if ck.Mode == cr.ModeTemplate {
			// The image of a template checkpoint is written in the
			// background: wait for it on every path, so no dump copy runs
			// inside a probe window. (A CRIU-mode checkpoint is an image
			// already.)
			wctx, cancel := context.WithTimeout(ctx, 2*time.Minute)
			err := r.eng.WaitImage(wctx, ckID)
			cancel()
			switch {
			case err != nil && r.procPath == "criu":
				r.fail(r.procFail, i, s, "CRIU image of %s: %v", s.Label, err)
			case err != nil:
				return fmt.Errorf("CRIU image of %s: %w", s.Label, err)
			case r.procPath == "criu":
				if err := r.eng.Evict(ckID); err != nil {
					r.fail(r.procFail, i, s, "evict templates of %s: %v", s.Label, err)
				}
			}
		}
		rec.mode = ck.Mode
		r.recs[s.Label], r.ckIDs[s.Label], r.fsIDs[s.Label], r.ckSess[s.Label] = rec, ckID, fsID, sessOf
		return r.begin()
	case "restore":
		r.abort()
		if err := r.restore(ctx, i, s); err != nil {
			return err
		}
		return r.begin()
	case "fork", "view":
		return fmt.Errorf("%s is not supported in process workloads", s.Op)
	case "compact":
		return r.fsys.Compact()
	case "compare", "expect":
		if s.Op == "expect" {
			_, err := r.ops.apply(ctx, s)
			if err != nil {
				r.fail(r.procFail, i, s, "%v", err)
			}
		}
		return nil
	}
	// File operations go through the FUSE view from the host. With
	// allow_errors a failed one (rm of a missing file) is the workload's
	// business: the next restore compares the tree anyway.
	_, err := r.ops.apply(ctx, s)
	if err != nil && s.Error == "" && !r.w.AllowErrors {
		return err
	}
	return nil
}

// switchFS switches the view to fs checkpoint id; when the switch
// replaces the root mount (kernel-proc on a stock kernel), a clone of the
// new view becomes the sandbox's root, as the daemon does.
func (r *procRun) switchFS(id string) error {
	if err := r.fsys.Switch(id); err != nil {
		return err
	}
	if !r.reroot {
		return nil
	}
	mfd, err := unix.OpenTree(unix.AT_FDCWD, r.fsys.Mountpoint(), unix.OPEN_TREE_CLONE|unix.OPEN_TREE_CLOEXEC)
	if err != nil {
		return fmt.Errorf("clone the new view: %w", err)
	}
	defer unix.Close(mfd)
	return r.sb.ReplaceRoot(mfd)
}

func (r *procRun) restore(ctx context.Context, i int, s Step) error {
	ckID, fsID := r.ckIDs[s.Label], r.fsIDs[s.Label]
	rec := r.recs[s.Label]
	if ckID == "" {
		return fmt.Errorf("label %q has no checkpoint in this run", s.Label)
	}
	sessOf := r.ckSess[s.Label]
	var chMu sync.Mutex
	var opened []*sandbox.Channels
	opts := cr.RestoreOptions{
		SwitchFS: func() error { return r.switchFS(fsID) },
		Reroot:   r.reroot,
		Stdio: func(p cr.Proc) (*cr.Stdio, error) {
			sid, ok := sessOf[p.PID]
			if !ok {
				return nil, nil
			}
			ch, err := r.sb.NewChannels()
			if err != nil {
				return nil, err
			}
			in, out, err := ch.InitFDs(ctx)
			if err != nil {
				ch.Close()
				return nil, err
			}
			chMu.Lock()
			opened = append(opened, ch)
			chMu.Unlock()
			fin, fout := ch.ChildFiles()
			return &cr.Stdio{
				Stdin: "/proc/1/fd/" + strconv.Itoa(in), Stdout: "/proc/1/fd/" + strconv.Itoa(out), Stderr: "/proc/1/fd/" + strconv.Itoa(out),
				Files: [3]*os.File{fin, fout, fout},
				Started: func(pid int) error {
					_, err := r.sb.AdoptSession(sid, pid, ch)
					if err == nil {
						chMu.Lock()
						opened = slices.DeleteFunc(opened, func(c *sandbox.Channels) bool { return c == ch })
						chMu.Unlock()
					}
					return err
				},
			}, nil
		},
	}
	res, err := r.eng.Restore(ctx, r.sb, ckID, opts)
	chMu.Lock()
	for _, ch := range opened {
		ch.Close()
	}
	chMu.Unlock()
	if err != nil {
		r.fail(r.procFail, i, s, "restore: %v", err)
		return nil
	}
	if r.procPath != "" && rec.mode != cr.ModeEmpty {
		// The template path restores template checkpoints from templates;
		// a checkpoint the engine had to take with CRIU (a process tree,
		// a multi-threaded process: ck.Reason) restores through CRIU on
		// every path, by design.
		want := r.procPath
		switch {
		case rec.mode == cr.ModeCRIU:
			want = "criu"
		case r.procPath == "kernel-proc":
			want = "template" // copies moved onto the new root (cr's Reroot)
		}
		if res.Path != want && !(want == "criu" && res.Path == "criu-lazy") {
			r.fail(r.procFail, i, s, "restored through %s, not %s (checkpoint mode %s)", res.Path, want, rec.mode)
			return nil
		}
		if r.procPath == "criu" && rec.mode == cr.ModeTemplate {
			// A restore from the image leaves the templates it recreated
			// in the pool: evict them again, so that the next restore of
			// this checkpoint also goes through its image.
			if err := r.eng.Evict(ckID); err != nil {
				r.fail(r.procFail, i, s, "evict templates of %s: %v", s.Label, err)
				return nil
			}
		}
	}
	got, err := r.record(ctx)
	if err != nil {
		r.fail(r.procFail, i, s, "after restore: %v", err)
		return nil
	}
	if r.procFail != nil {
		r.procFail.Compares++
	}
	for name, want := range rec.states {
		if got.states[name] != want {
			r.fail(r.procFail, i, s, "session %s state after restore %q, at checkpoint %q", name, trunc(got.states[name]), trunc(want))
			return nil
		}
	}
	if got.shape != rec.shape {
		r.fail(r.procFail, i, s, "process tree after restore [%s], at checkpoint [%s]", got.shape, rec.shape)
		return nil
	}
	if d := tree.Diff(rec.tree, got.tree, 8); len(d) > 0 {
		r.fail(r.procFail, i, s, "file tree after restore differs from the checkpoint's:\n  %s", strings.Join(d, "\n  "))
	}
	return nil
}
