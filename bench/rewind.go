package bench

import (
	"context"
	"fmt"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"sync"
	"time"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
)

// RepoDir is where the rewind rows keep the repository inside the sandbox.
const RepoDir = "/root/rewind-bench-repo"

// rewindManager drives a rewind daemon through its public API, as a harness
// would: one sandbox on the host root (read-only base), a persistent bash
// session, `turn` after every node, `restore` on rollbacks.
type rewindManager struct {
	c      *client.Client
	policy string
	fs     string // file-system backend of the sandbox ("": the daemon's default)
	name   string
	seq    int
	// plainRTTs are the round trips of the plain sends so far (each call's
	// time beyond the daemon's time of the send), sorted.
	plainRTTs []time.Duration
}

// typicalRTT is the median round trip of a plain send so far (0 before
// the first): what a send's call costs beyond the daemon's work when it
// carries no state operation.
func (r *rewindManager) typicalRTT() time.Duration {
	if len(r.plainRTTs) == 0 {
		return 0
	}
	return r.plainRTTs[len(r.plainRTTs)/2]
}

// NewRewind returns a rewind row named "rewind-<policy>" ("always" is
// DeltaBox-style, every turn a full checkpoint; "effects" is Crab +
// DeltaBox). After each turn it waits until the checkpoint is durable and
// accounts that wait as asynchronous work (it runs during the LLM wait).
func NewRewind(c *client.Client, policy string) Manager {
	return &rewindManager{c: c, policy: policy}
}

func (r *rewindManager) Name() string { return "rewind-" + r.policy }

func (r *rewindManager) Start(ctx context.Context, setup []string) error {
	r.name = fmt.Sprintf("bench-%s-%d", r.policy, time.Now().UnixNano()%1e9)
	if _, err := r.c.Create(ctx, api.CreateRequest{Name: r.name, Policy: r.policy, FS: r.fs}); err != nil {
		return err
	}
	if _, err := r.c.StartSession(ctx, r.name, api.SessionRequest{ID: "sh", Argv: []string{"bash", "--noprofile", "--norc"}, Env: []string{"R=" + RepoDir, "HOME=/root", "PS1="}}); err != nil {
		return err
	}
	if _, _, err := r.run(ctx, "mkdir -p $R && cd $R"); err != nil {
		return err
	}
	for _, c := range setup {
		out, code, err := r.run(ctx, c)
		if err != nil {
			return err
		}
		if code != 0 {
			return fmt.Errorf("setup %q exited %d: %s", c, code, out)
		}
	}
	return nil
}

var rwMarker = sync.OnceValue(func() *regexp.Regexp { return regexp.MustCompile(`__RWB_\d+_(\d+)__`) })

func (r *rewindManager) run(ctx context.Context, cmd string) (string, int, error) {
	out, code, _, err := r.send(ctx, cmd, "", nil)
	return out, code, err
}

// send runs cmd in the session, after restoring to restore (when set) and
// ending the turn with turn (when set), in one call.
func (r *rewindManager) send(ctx context.Context, cmd, restore string, turn *api.TurnRequest) (string, int, *api.SendResult, error) {
	r.seq++
	marker := fmt.Sprintf("__RWB_%d_", r.seq)
	start := time.Now()
	res, err := r.c.Step(ctx, r.name, "sh", api.SendRequest{
		Restore:   restore,
		Turn:      turn,
		Text:      cmd + "\necho " + marker + "$?__",
		Until:     regexp.QuoteMeta(marker) + `\d+__`,
		TimeoutMS: 300000,
		IdleMS:    300000,
	})
	if err != nil {
		return "", -1, nil, err
	}
	if restore == "" && turn == nil {
		rtt := max(time.Since(start)-time.Duration(res.ElapsedUS)*time.Microsecond, 0)
		i, _ := slices.BinarySearch(r.plainRTTs, rtt)
		r.plainRTTs = slices.Insert(r.plainRTTs, i, rtt)
	}
	out := res.Output
	i := strings.Index(out, marker)
	if i < 0 {
		return out, -1, res, fmt.Errorf("session output lacks the end marker of %q: %q", cmd, out)
	}
	code := -1
	if m := rwMarker().FindStringSubmatch(out[i:]); m != nil {
		code, _ = strconv.Atoi(m[1])
	}
	return out[:i], code, res, nil
}

func (r *rewindManager) Run(ctx context.Context, cmd string) error {
	_, _, err := r.run(ctx, cmd)
	return err
}

// turnRequest is the bench's turn: auto, deferred (the probe read and the
// policy's decision run with the checkpoint, off the call, as the
// checkpoint's own work does).
func turnRequest() *api.TurnRequest { return &api.TurnRequest{Mode: "auto", Defer: true} }

func (r *rewindManager) Checkpoint(ctx context.Context) (string, Cost, error) {
	start := time.Now()
	res, err := r.c.Turn(ctx, r.name, *turnRequest())
	if err != nil {
		return "", Cost{}, err
	}
	return r.turnCost(ctx, res, time.Since(start))
}

// turnCost is the cost of a turn the harness waited visible for; it waits
// for the checkpoint to be durable, accounted as asynchronous work.
func (r *rewindManager) turnCost(ctx context.Context, res *api.TurnResult, visible time.Duration) (string, Cost, error) {
	c := Cost{Visible: visible, Decision: string(res.Decision)}
	us := func(n int64) time.Duration { return time.Duration(n) * time.Microsecond }
	c.Phases = map[string]time.Duration{
		"turn." + string(res.Decision): c.Visible,
		"turn.daemon":                  us(res.Phases.TotalUS),
		"turn.wait_previous":           us(res.Phases.WaitUS),
		"turn.probe_window":            us(res.Phases.WindowUS),
		"turn.decide":                  us(res.Phases.DecideUS),
		"turn.outside_daemon":          outside(c.Visible, us(res.Phases.TotalUS)),
	}
	// The rest of the checkpoint runs while the agent waits for its LLM.
	w := time.Now()
	ck, err := r.c.Wait(ctx, res.ID)
	if err != nil {
		return "", c, err
	}
	c.Async = time.Since(w)
	c.Phases["checkpoint.durable_wait"] = c.Async
	if res.Decision != "skip" {
		// What the checkpoint really was (decided by the checkpoint for a
		// deferred turn; and a full decision whose processes provably did
		// not change becomes fs-only).
		c.Decision = string(ck.Decision)
		if ck.Decided == "skip" {
			// The policy skipped it: an fs checkpoint freezing nothing new.
			c.Decision = "skip"
		}
		c.Frozen = time.Duration(ck.FrozenUS) * time.Microsecond
		c.Phases["checkpoint."+c.Decision+".took"] = us(ck.TookUS)
		c.Phases["checkpoint."+c.Decision+".frozen"] = c.Frozen
	}
	return res.ID, c, nil
}

func (r *rewindManager) Restore(ctx context.Context, id string) (Cost, error) {
	start := time.Now()
	res, err := r.c.Restore(ctx, r.name, id, 0)
	c := Cost{Visible: time.Since(start), Decision: "full"}
	if err != nil {
		return c, err
	}
	return restoreCost(res, c.Visible), nil
}

// outside is the part of a call's time spent outside the daemon: the
// harness's time of the call less the daemon's, clamped at 0. The two are
// read on different clocks (the daemon rounds to microseconds and starts
// its clock after reading the request), so a call the daemon spent nearly
// all of would otherwise come out slightly negative. It is a reported
// phase only: nothing is charged from it.
func outside(visible, daemon time.Duration) time.Duration { return max(visible-daemon, 0) }

func restoreCost(res *api.RestoreResult, visible time.Duration) Cost {
	c := Cost{Visible: visible, Decision: "full"}
	us := func(n int64) time.Duration { return time.Duration(n) * time.Microsecond }
	ph := res.Phases
	c.Phases = map[string]time.Duration{
		"restore.daemon":           us(ph.TotalUS),
		"restore.probe_window":     us(ph.WindowUS),
		"restore.undo." + ph.Undo:  us(ph.UndoUS),
		"restore.kill":             us(ph.KillUS),
		"restore.fs_switch":        us(ph.SwitchUS),
		"restore.proc":             us(ph.ProcUS),
		"restore.persist":          us(ph.PersistUS),
		"restore.path." + res.Path: c.Visible,
		"restore.queue":            us(ph.QueueUS),
		"restore.outside_daemon":   outside(c.Visible, us(ph.TotalUS+ph.QueueUS)),
	}
	return c
}

// Step is a tree-search step the way a harness on rewind's API would do
// it: the restore rides on the step's first send and the turn on its last
// (api.SendRequest's Restore and Turn), so the step costs the round trips
// of its sends only. Of a call that carries a restore or a turn, exec is
// what the same send would have cost without them: the daemon's time of
// the send itself (the command running and its answer being read) plus
// the median round trip of the plain sends so far in this run (none
// before the first; the median, not the fastest, because a plain send's
// own round trip varies by as much as a turn costs: the fastest would
// charge that variation to state management). Everything else the
// harness waited for — the restore, the turn, the rest of the round
// trip, anything the checkpoint's start delayed the answer by — is
// charged to state management (to the turn when the call has one, else to
// the restore). The checkpoint's asynchronous part is accounted as for
// Checkpoint.
func (r *rewindManager) Step(ctx context.Context, restore string, cmds []string) (StepResult, error) {
	var sr StepResult
	us := func(n int64) time.Duration { return time.Duration(n) * time.Microsecond }
	var turnRes *api.TurnResult
	var turnVisible, credited time.Duration
	for i, cmd := range cmds {
		var turn *api.TurnRequest
		if i == len(cmds)-1 {
			turn = turnRequest()
		}
		start := time.Now()
		_, _, res, err := r.send(ctx, cmd, restore, turn)
		took := time.Since(start)
		if err != nil {
			return sr, err
		}
		if restore == "" && turn == nil {
			sr.Exec += took
			continue
		}
		rest := took - us(res.ElapsedUS)
		rtt := min(r.typicalRTT(), max(rest, 0))
		sr.Exec += us(res.ElapsedUS) + rtt
		rest -= rtt
		credited += rtt
		if restore != "" {
			if res.Restore == nil {
				return sr, fmt.Errorf("the send answered no restore")
			}
			visible := rest
			if turn != nil {
				visible = us(res.Restore.ElapsedUS)
				rest -= visible
			}
			sr.Restore = restoreCost(res.Restore, visible)
			sr.Restored = true
			restore = ""
		}
		if turn != nil {
			if res.Turn == nil {
				return sr, fmt.Errorf("the send answered no turn")
			}
			turnRes, turnVisible = res.Turn, rest
		}
	}
	id, c, err := r.turnCost(ctx, turnRes, turnVisible)
	if c.Phases != nil {
		c.Phases["step.send_round_trip"] = credited // counted as exec
	}
	sr.ID, sr.Checkpoint = id, c
	return sr, err
}

func (r *rewindManager) Digest(ctx context.Context) (string, error) {
	out, _, err := r.run(ctx, digestScript)
	return strings.TrimSpace(out), err
}

// Usage is what the sandbox's checkpoints hold (the daemon's measure):
// disk is their fs layers and CRIU images, memory their templates'
// private dirty memory.
func (r *rewindManager) Usage() Usage {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	u, err := r.c.Usage(ctx, r.name)
	if err != nil {
		return Usage{}
	}
	return Usage{DiskBytes: u.FSBytes + u.ProcBytes, MemBytes: u.TemplateBytes}
}

// MemBytes is the templates' memory now (Replay samples it for the peak).
func (r *rewindManager) MemBytes() int64 { return r.Usage().MemBytes }

// Close removes the sandbox, with a context of its own: it runs when the
// run's context may be canceled (an interrupted benchmark).
func (r *rewindManager) Close() error {
	if r.name == "" {
		return nil
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	return r.c.Remove(ctx, r.name)
}
