package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"sort"
	"strings"
	"time"
)

// digestScript prints what an agent's later turns depend on: a hash of
// every file under $R, the shell's cwd, a variable the trace sets, and the
// number of background jobs.
const digestScript = `jobs >/dev/null; printf 'files=%s jobs=%s cwd=%s step=%s\n' "$(cd "$R" && find . -type f -print0 | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)" "$(jobs -p | wc -l)" "${PWD#$R}" "${AGENT_STEP:-}"`

// Cost is what one state-management call cost the harness.
type Cost struct {
	// Visible is the time the harness waited for the call.
	Visible time.Duration
	// Async is work the call left running after it returned; it overlaps
	// the next LLM wait and only the part longer than that wait is charged.
	Async time.Duration
	// Frozen is how long the sandbox was stopped, when the manager knows.
	Frozen time.Duration
	// Decision is skip, fs or full (baselines always take full).
	Decision string
	// Phases, when the manager knows them, split the call's time by
	// phase (named like "restore.undo"); Replay summarizes each.
	Phases map[string]time.Duration
}

// Usage is the disk and memory a manager holds for its checkpoints: disk
// at the end of the search, memory at its peak (checkpoints kept in
// processes' memory, rewind's templates; baselines keep theirs on disk).
type Usage struct {
	DiskBytes int64 `json:"disk_bytes"`
	MemBytes  int64 `json:"mem_bytes"`
}

// MemSampler is implemented by managers whose checkpoints hold memory
// (rewind's templates): Replay samples it after every checkpoint, outside
// the timed calls, and reports the peak as Usage.MemBytes.
type MemSampler interface {
	MemBytes() int64
}

// Manager is a state manager under test: rewind, or a baseline.
type Manager interface {
	// Name is the row name in results (rewind rows start with "rewind-").
	Name() string
	// Start makes a fresh workspace with a persistent shell whose $R is the
	// repository root, and runs the setup commands in it.
	Start(ctx context.Context, setup []string) error
	// Run runs one command in the persistent shell.
	Run(ctx context.Context, cmd string) error
	// Checkpoint saves the current state and returns its id.
	Checkpoint(ctx context.Context) (string, Cost, error)
	// Restore returns to a checkpoint.
	Restore(ctx context.Context, id string) (Cost, error)
	// Digest describes the state an agent depends on: the repository's
	// files and the shell's cwd, variables and background jobs.
	Digest(ctx context.Context) (string, error)
	// Usage reports the space the checkpoints take.
	Usage() Usage
	// Close frees everything, whether Start succeeded, failed part way or
	// never ran, and whatever the context of the other calls.
	Close() error
}

// Stepper is a Manager whose API can do a tree-search step's state calls
// together with its commands: restore (when restore is set), run the
// commands, checkpoint. Replay uses it for every node with commands.
type Stepper interface {
	Step(ctx context.Context, restore string, cmds []string) (StepResult, error)
}

// StepResult is what a Stepper's step cost.
type StepResult struct {
	// ID is the checkpoint that ended the step.
	ID string
	// Restored says a restore ran; Restore is its cost.
	Restored bool
	Restore  Cost
	// Checkpoint is the checkpoint's cost.
	Checkpoint Cost
	// Exec is the rest of the step's time: the commands, with the round
	// trips of the calls that carried them.
	Exec time.Duration
}

// ReplayOptions configures Replay.
type ReplayOptions struct {
	// CrashChecks is how many random turns get a crash-recovery check: the
	// live state's digest is compared with the digest after restoring the
	// latest checkpoint (as a recovery after a crash would).
	CrashChecks int
	// Progress, when set, receives one line per node.
	Progress io.Writer
}

// Result is one manager's replay of one trace.
type Result struct {
	Name  string `json:"name"`
	Trace string `json:"trace"`
	Nodes int    `json:"nodes"`

	// LLMMS is the accounted LLM time (the trace's llm_ms, computed, not
	// slept), ExecMS the time commands ran, StateMS the time the harness
	// waited for state management: every call's visible time plus the part
	// of its asynchronous work that outlasted the next LLM wait.
	LLMMS   float64 `json:"llm_ms"`
	ExecMS  float64 `json:"exec_ms"`
	StateMS float64 `json:"state_ms"`
	// OverheadRatio = (LLM + exec + state) / (LLM + exec).
	OverheadRatio float64 `json:"overhead_ratio"`
	// StateMSZeroLLM and OverheadRatioZeroLLM are the same with an LLM
	// that answers at once: every asynchronous part is on the critical path
	// (pure state-management cost; an upper bound for rewind, whose daemon
	// would overlap part of it with the next command).
	StateMSZeroLLM       float64 `json:"state_ms_zero_llm"`
	OverheadRatioZeroLLM float64 `json:"overhead_ratio_zero_llm"`

	Checkpoint Latency `json:"checkpoint"`
	Restore    Latency `json:"restore"`
	// P50MS/P99MS are over every state-management call (checkpoints and
	// restores together).
	P50MS    float64 `json:"p50_ms"`
	P99MS    float64 `json:"p99_ms"`
	FrozenMS float64 `json:"frozen_ms"`

	Decisions map[string]int `json:"decisions,omitempty"`
	// Phases summarizes the per-phase times the manager reported for the
	// search's calls (crash checks excluded), by phase name.
	Phases map[string]Latency `json:"phases,omitempty"`
	Usage  Usage              `json:"usage"`

	CrashChecks  int `json:"crash_checks"`
	CrashCorrect int `json:"crash_correct"`
	// RecoveryCorrectness is CrashCorrect/CrashChecks (1 when no checks).
	RecoveryCorrectness float64 `json:"recovery_correctness"`
	// StateMSRuns are the state times of every run of the system, sorted,
	// when the benchmark ran it more than once (MCTSOptions.Repeat); the
	// row's other fields are those of the run with the median state time.
	StateMSRuns []float64 `json:"state_ms_runs,omitempty"`
	Error       string    `json:"error,omitempty"`
}

// Latency summarizes a set of call latencies.
type Latency struct {
	N     int     `json:"n"`
	P50MS float64 `json:"p50_ms"`
	P99MS float64 `json:"p99_ms"`
	SumMS float64 `json:"sum_ms"`
}

func summarize(ds []time.Duration) Latency {
	l := Latency{N: len(ds)}
	if len(ds) == 0 {
		return l
	}
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	pct := func(p float64) float64 {
		i := int(p*float64(len(s))+0.5) - 1
		return ms(s[max(0, min(i, len(s)-1))])
	}
	for _, d := range s {
		l.SumMS += ms(d)
	}
	l.P50MS, l.P99MS = pct(0.50), pct(0.99)
	return l
}

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }

// Replay runs a trace with a manager, as a tree-search harness would:
// before each node whose parent is not the current state it restores the
// parent's checkpoint, then runs the node's commands and ends the turn with
// a checkpoint.
func Replay(ctx context.Context, t *Trace, m Manager, o ReplayOptions) (res *Result, err error) {
	res = &Result{Name: m.Name(), Trace: t.Name, Nodes: len(t.Nodes), Decisions: map[string]int{}}
	defer func() {
		if err != nil {
			res.Error = err.Error()
		}
	}()
	// Close undoes whatever Start did, also when Start failed part way or
	// ctx was canceled (an interrupted benchmark).
	defer m.Close()
	if err := m.Start(ctx, t.Setup); err != nil {
		return res, fmt.Errorf("%s: start: %w", m.Name(), err)
	}

	checks := map[int]bool{}
	if o.CrashChecks > 0 && len(t.Nodes) > 0 {
		rng := rand.New(rand.NewPCG(uint64(t.Seed), 7))
		for _, i := range rng.Perm(len(t.Nodes))[:min(o.CrashChecks, len(t.Nodes))] {
			checks[t.Nodes[i].ID] = true
		}
	}

	var ckptLat, restLat, all []time.Duration
	var state, state0, exec, frozen time.Duration
	var pending time.Duration // async work of the last call, not yet masked
	var peakMem int64         // of a MemSampler
	phases := map[string][]time.Duration{}
	charge := func(c Cost) {
		for k, v := range c.Phases {
			phases[k] = append(phases[k], v)
		}
		state += c.Visible
		state0 += c.Visible + c.Async
		frozen += c.Frozen
		all = append(all, c.Visible)
		pending = c.Async
	}

	ckpt := map[int]string{}
	expect := map[int]shellState{0: shellState{}.run(t.Setup)}
	root, c, err := m.Checkpoint(ctx)
	if err != nil {
		return res, fmt.Errorf("%s: checkpoint of the root: %w", m.Name(), err)
	}
	ckpt[0] = root
	pending = c.Async // the root is taken before the search starts: not charged
	cur := 0
	var n Node
	// ended books the checkpoint that ends node n.
	ended := func(id string, c Cost) error {
		ckptLat = append(ckptLat, c.Visible)
		charge(c)
		if c.Decision == "" {
			c.Decision = "full"
		}
		res.Decisions[c.Decision]++
		ckpt[n.ID], cur = id, n.ID
		expect[n.ID] = expect[n.Parent].next(n)
		if ms, ok := m.(MemSampler); ok {
			peakMem = max(peakMem, ms.MemBytes())
		}

		if checks[n.ID] {
			ok, err := crashCheck(ctx, m, id, expect[n.ID])
			if err != nil {
				return fmt.Errorf("%s: node %d: crash check: %w", m.Name(), n.ID, err)
			}
			res.CrashChecks++
			if ok {
				res.CrashCorrect++
			}
		}
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, "%s: node %d/%d (%s) checkpoint %s %.1f ms\n", m.Name(), n.ID, len(t.Nodes), n.Kind, c.Decision, ms(c.Visible))
		}
		return nil
	}
	for _, n = range t.Nodes {
		llm := time.Duration(n.LLMMS * float64(time.Millisecond))
		res.LLMMS += ms(llm)
		// Async work overlaps the LLM wait; the rest is on the critical path.
		if pending > llm {
			state += pending - llm
		}
		pending = 0
		if st, ok := m.(Stepper); ok && len(n.Commands) > 0 {
			restore := ""
			if n.Parent != cur {
				restore = ckpt[n.Parent]
			}
			sr, err := st.Step(ctx, restore, n.Commands)
			if err != nil {
				return res, fmt.Errorf("%s: node %d: step: %w", m.Name(), n.ID, err)
			}
			if sr.Restored {
				restLat = append(restLat, sr.Restore.Visible)
				charge(sr.Restore)
				state += pending // a restore's async part is charged in full
				pending = 0
			}
			exec += sr.Exec
			if err := ended(sr.ID, sr.Checkpoint); err != nil {
				return res, err
			}
			continue
		}
		if n.Parent != cur {
			c, err := m.Restore(ctx, ckpt[n.Parent])
			if err != nil {
				return res, fmt.Errorf("%s: node %d: restore to node %d: %w", m.Name(), n.ID, n.Parent, err)
			}
			restLat = append(restLat, c.Visible)
			charge(c)
			state += pending // a restore's async part is charged in full
			pending = 0
		}
		start := time.Now()
		for _, cmd := range n.Commands {
			if err := m.Run(ctx, cmd); err != nil {
				return res, fmt.Errorf("%s: node %d: %w", m.Name(), n.ID, err)
			}
		}
		exec += time.Since(start)
		id, c, err := m.Checkpoint(ctx)
		if err != nil {
			return res, fmt.Errorf("%s: node %d: checkpoint: %w", m.Name(), n.ID, err)
		}
		if err := ended(id, c); err != nil {
			return res, err
		}
	}
	state += pending // the last checkpoint's async part: no LLM wait follows

	res.ExecMS, res.StateMS, res.StateMSZeroLLM, res.FrozenMS = ms(exec), ms(state), ms(state0), ms(frozen)
	if base := res.LLMMS + res.ExecMS; base > 0 {
		res.OverheadRatio = (base + res.StateMS) / base
	}
	if res.ExecMS > 0 {
		res.OverheadRatioZeroLLM = (res.ExecMS + res.StateMSZeroLLM) / res.ExecMS
	}
	res.Checkpoint, res.Restore = summarize(ckptLat), summarize(restLat)
	if len(phases) > 0 {
		res.Phases = map[string]Latency{}
		for k, v := range phases {
			res.Phases[k] = summarize(v)
		}
	}
	sa := summarize(all)
	res.P50MS, res.P99MS = sa.P50MS, sa.P99MS
	res.Usage = m.Usage()
	res.Usage.MemBytes = max(res.Usage.MemBytes, peakMem)
	res.RecoveryCorrectness = 1
	if res.CrashChecks > 0 {
		res.RecoveryCorrectness = float64(res.CrashCorrect) / float64(res.CrashChecks)
	}
	return res, nil
}

// crashCheck simulates a crash right after checkpoint id: the state a
// recovery rebuilds (restore of the latest checkpoint) must equal the state
// of a run without a crash — the same files and background jobs as the live
// sandbox had, and the cwd and variables the trace's commands set (a
// baseline that restarted the shell has lost them even before the crash).
// The check is the harness's own observation, not part of the search, and
// none of its calls is charged: it ends with one more restore of id, so the
// search goes on from the recovered state itself, not from that state plus
// the commands that read its digest.
func crashCheck(ctx context.Context, m Manager, id string, want shellState) (bool, error) {
	live, err := m.Digest(ctx)
	if err != nil {
		return false, err
	}
	if _, err := m.Restore(ctx, id); err != nil {
		return false, err
	}
	got, err := m.Digest(ctx)
	if err != nil {
		return false, err
	}
	if _, err := m.Restore(ctx, id); err != nil {
		return false, err
	}
	liveFiles, _, _ := strings.Cut(live, " cwd=")
	return got == liveFiles+want.suffix(), nil
}
