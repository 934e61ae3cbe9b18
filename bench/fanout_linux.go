package bench

import (
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/api"
	"github.com/rewind-sandbox/rewind/client"
)

// FanoutOptions configures RunFanout.
type FanoutOptions struct {
	// Counts of forks to make from one checkpoint (default 16, 32, 64):
	// each 1..MaxForks, none twice.
	Counts []int
	// Client reaches the rewind daemon.
	Client *client.Client
	// TrainerStepMS is the simulated trainer step the rollouts feed
	// (0: the default, 5000 ms): the trainer waits while forks come up.
	TrainerStepMS float64
	// Parent holds the baselines' copies (default: a temp dir).
	Parent string
	// FS is the file-system backend of the forked sandbox ("" or "auto",
	// "fuse", "kernel"); its fork children get the same.
	FS string
	// Repeat runs the whole benchmark this many times (default 1), the
	// order of its three parts (rewind's forks, the copies, the floor)
	// rotated by one each round; each row is the median run of its system
	// and width (see medianFanout).
	Repeat   int
	Progress io.Writer
}

// MaxForks is the most copies one fork call makes (the daemon's limit).
const MaxForks = 1024

// Validate refuses options RunFanout cannot follow: a width outside
// 1..MaxForks or given twice, a trainer step that is negative or not
// finite, an unknown file-system backend, a negative repeat count. It
// needs no daemon, so a command can check its flags before connecting.
func (o FanoutOptions) Validate() error {
	seen := map[int]bool{}
	for _, n := range o.Counts {
		switch {
		case n < 1 || n > MaxForks:
			return fmt.Errorf("fan-out width %d: want 1..%d", n, MaxForks)
		case seen[n]:
			return fmt.Errorf("fan-out width %d given twice", n)
		}
		seen[n] = true
	}
	switch {
	case o.TrainerStepMS < 0 || math.IsNaN(o.TrainerStepMS) || math.IsInf(o.TrainerStepMS, 0):
		return fmt.Errorf("trainer step %g ms: want a positive number", o.TrainerStepMS)
	case o.FS != "" && o.FS != "auto" && o.FS != "fuse" && o.FS != "kernel":
		return fmt.Errorf("unknown fs %q (want auto, fuse or kernel)", o.FS)
	case o.Repeat < 0:
		return fmt.Errorf("repeat %d: want 1 or more", o.Repeat)
	}
	return nil
}

// FanoutRow is one system at one fan-out width.
type FanoutRow struct {
	Name string `json:"name"`
	N    int    `json:"n"`
	// ReadyMS is the time until all N copies run and have each executed a
	// first command.
	ReadyMS float64 `json:"ready_ms"`
	// ForkMS is the fork call alone (rewind) or the copying (baselines).
	ForkMS float64 `json:"fork_ms"`
	// TrainerWait is ReadyMS/(ReadyMS+TrainerStepMS): the fraction of time
	// a trainer would wait for its rollouts; GPUUtil is 1 - TrainerWait.
	// Both are left out (0) for a failed row.
	TrainerWait float64 `json:"trainer_wait,omitempty"`
	GPUUtil     float64 `json:"gpu_util,omitempty"`
	// MemDeltaBytes is how far the host's MemAvailable dropped while the
	// copies existed, clamped at 0: a rough measure, since everything else
	// on the host moves MemAvailable too (and the page cache the copies
	// fill is not counted as unavailable).
	MemDeltaBytes int64 `json:"mem_delta_bytes"`
	DiskBytes     int64 `json:"disk_bytes"`
	// OverFloorMS is ReadyMS less the shell-floor row's at the same N:
	// what the system adds to running the first command itself (set when
	// both rows exist).
	OverFloorMS float64 `json:"over_floor_ms,omitempty"`
	// ReadyMSRuns are the ready times of every run that did not fail,
	// sorted, when the benchmark ran more than once (FanoutOptions.Repeat).
	ReadyMSRuns []float64 `json:"ready_ms_runs,omitempty"`
	Error       string    `json:"error,omitempty"`
}

// floorName is the row of N shells that are already running the
// repository's copy and only run the first command: the machine's floor
// under every system's ReadyMS.
const floorName = "shell-floor"

func memAvailable() int64 {
	b, err := os.ReadFile("/proc/meminfo")
	if err != nil {
		return 0
	}
	for _, l := range strings.Split(string(b), "\n") {
		if f := strings.Fields(l); len(f) >= 2 && f[0] == "MemAvailable:" {
			kb, _ := strconv.ParseInt(f[1], 10, 64)
			return kb * 1024
		}
	}
	return 0
}

// RunFanout measures rewind's fork of a running sandbox (a persistent bash
// with the benchmark repository) into N live copies against copying the
// repository N times (cp -a) and starting a shell in each.
//
// When ctx is canceled it removes what it made (sandboxes, copies, shells)
// and returns ctx's error.
func RunFanout(ctx context.Context, o FanoutOptions) ([]FanoutRow, error) {
	if err := o.Validate(); err != nil {
		return nil, fmt.Errorf("fanout: %w", err)
	}
	if len(o.Counts) == 0 {
		o.Counts = []int{16, 32, 64}
	}
	if o.TrainerStepMS == 0 {
		o.TrainerStepMS = 5000
	}
	if o.Repeat < 1 {
		o.Repeat = 1
	}
	setup := setupCommands()
	finishRow := func(r FanoutRow) FanoutRow {
		if r.Error == "" {
			r.TrainerWait = r.ReadyMS / (r.ReadyMS + o.TrainerStepMS)
			r.GPUUtil = 1 - r.TrainerWait
		}
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, "fanout %s n=%d: ready in %.1f ms %s\n", r.Name, r.N, r.ReadyMS, r.Error)
		}
		return r
	}
	rewindPart := func() ([]FanoutRow, error) {
		if o.Client == nil {
			return nil, nil
		}
		var rows []FanoutRow
		m := &rewindManager{c: o.Client, policy: "always", fs: o.FS}
		defer m.Close() // also after a failed or interrupted Start
		if err := m.Start(ctx, setup); err != nil {
			return nil, fmt.Errorf("start the rewind sandbox: %w", err)
		}
		for _, n := range o.Counts {
			// A new checkpoint per width: its first fork finds nothing
			// prepared. A trainer forks the same checkpoint at every step:
			// the repeated fork, once the daemon has prepared children of
			// it in the background (--warm-forks), is the steady state.
			id, _, err := m.Checkpoint(ctx) // waits until durable
			if err != nil {
				return nil, fmt.Errorf("checkpoint the rewind sandbox: %w", err)
			}
			first := fanoutRewind(ctx, o.Client, id, n)
			rows = append(rows, finishRow(first))
			if first.Error != "" {
				continue
			}
			r := FanoutRow{Name: "rewind-fork-repeat", N: n}
			if err := waitWarm(ctx, o.Client, id, n, 3*time.Minute); err != nil {
				r.Error = err.Error()
			} else {
				r = fanoutRewind(ctx, o.Client, id, n)
				r.Name = "rewind-fork-repeat"
				// The daemon prepares the next children now: let it
				// finish, so that no later row shares the CPU with it.
				if err := waitWarm(ctx, o.Client, id, n, 3*time.Minute); err != nil && r.Error == "" {
					r.Error = "refill after the repeated fork: " + err.Error()
				}
			}
			rows = append(rows, finishRow(r))
		}
		return rows, nil
	}
	copyPart := func() ([]FanoutRow, error) {
		var rows []FanoutRow
		for _, n := range o.Counts {
			rows = append(rows, finishRow(fanoutCopy(ctx, o.Parent, setup, n)))
		}
		return rows, nil
	}
	floorPart := func() ([]FanoutRow, error) {
		var rows []FanoutRow
		for _, n := range o.Counts {
			rows = append(rows, finishRow(fanoutFloor(ctx, o.Parent, setup, n)))
		}
		return rows, nil
	}
	parts := []func() ([]FanoutRow, error){rewindPart, copyPart, floorPart}
	var runs [][]FanoutRow
	for round := 0; round < o.Repeat; round++ {
		// Each part's rows keep their place in the output (rewind's,
		// then the copies', then the floor's), whatever order they ran in.
		got := make([][]FanoutRow, len(parts))
		for i := range parts {
			k := (i + round) % len(parts)
			rows, err := parts[k]()
			if err != nil {
				return nil, err
			}
			got[k] = rows
			if err := ctx.Err(); err != nil {
				return nil, err
			}
		}
		var rows []FanoutRow
		for _, g := range got {
			rows = append(rows, g...)
		}
		runs = append(runs, rows)
	}
	rows := medianFanout(runs)
	setOverFloor(rows)
	return rows, nil
}

// medianFanout returns, for each system and width in the order of the
// first run, the run with the median ready time (the lower middle one for
// an even count; failed runs count as slowest), with ReadyMSRuns listing
// every successful run's ready time when there was more than one run.
func medianFanout(runs [][]FanoutRow) []FanoutRow {
	if len(runs) == 0 {
		return nil
	}
	type key struct {
		name string
		n    int
	}
	byKey := map[key][]FanoutRow{}
	var order []key
	for _, rows := range runs {
		for _, r := range rows {
			k := key{r.Name, r.N}
			if _, seen := byKey[k]; !seen {
				order = append(order, k)
			}
			byKey[k] = append(byKey[k], r)
		}
	}
	out := make([]FanoutRow, 0, len(order))
	for _, k := range order {
		row, ready := medianRun(byKey[k], func(r FanoutRow) bool { return r.Error != "" }, func(r FanoutRow) float64 { return r.ReadyMS })
		row.ReadyMSRuns = ready
		out = append(out, row)
	}
	return out
}

// setOverFloor sets every row's OverFloorMS from the shell-floor row of
// the same width.
func setOverFloor(rows []FanoutRow) {
	floor := map[int]float64{}
	for _, r := range rows {
		if r.Name == floorName && r.Error == "" {
			floor[r.N] = r.ReadyMS
		}
	}
	for i, r := range rows {
		if f, ok := floor[r.N]; ok && r.Name != floorName && r.Error == "" {
			rows[i].OverFloorMS = r.ReadyMS - f
		}
	}
}

// fanoutFloor is the floor under every fan-out row: n shells on the host,
// started (untimed) in one copy of the repository, run the first command
// all at once. Nothing is copied or forked, so ReadyMS is what the first
// command alone costs n shells on this machine; a system's OverFloorMS is
// what it adds.
func fanoutFloor(ctx context.Context, parent string, setup []string, n int) FanoutRow {
	row := FanoutRow{Name: floorName, N: n}
	b := &copyBaseline{dirBase: dirBase{name: "fanout-floor"}, mode: "cp", parent: parent}
	defer b.Close()
	if err := b.Start(ctx, setup); err != nil {
		row.Error = err.Error()
		return row
	}
	shells := make([]*shell, 0, n)
	defer func() {
		for _, s := range shells {
			s.kill()
		}
	}()
	for i := 0; i < n; i++ {
		s, err := startShell(b.repo, b.repo)
		if err == nil {
			shells = append(shells, s)
			// The shell is up and has read its start-up once this answers.
			_, _, err = s.run(ctx, "true")
		}
		if err != nil {
			row.Error = err.Error()
			return row
		}
	}
	// The copy rows before it leave dirty pages: their writeback is not
	// the floor's.
	unix.Sync()
	mem0 := memAvailable()
	start := time.Now()
	errs := make(chan error, n)
	for _, s := range shells {
		go func() {
			_, code, err := s.run(ctx, firstCmd)
			if err == nil && code != 0 {
				err = fmt.Errorf("first command exited %d", code)
			}
			errs <- err
		}()
	}
	for range shells {
		if err := <-errs; err != nil && row.Error == "" {
			row.Error = err.Error()
		}
	}
	row.ReadyMS = ms(time.Since(start))
	row.MemDeltaBytes = max(mem0-memAvailable(), 0)
	return row
}

func fanoutRewind(ctx context.Context, c *client.Client, ckpt string, n int) FanoutRow {
	row := FanoutRow{Name: "rewind-fork", N: n}
	prefix := fmt.Sprintf("fan%d-%d-", n, time.Now().UnixNano()%1e6)
	mem0 := memAvailable()
	start := time.Now()
	res, err := c.Fork(ctx, ckpt, api.ForkRequest{Count: n, Prefix: prefix})
	if err != nil {
		row.Error = err.Error()
		// A fork the client gave up on (ctx canceled) may have made its
		// children all the same: they are named prefix1..prefixN.
		removeForked(ctx, c, prefix, n)
		return row
	}
	row.ForkMS = ms(time.Since(start))
	defer func() {
		cctx, cancel := cleanupContext(ctx)
		defer cancel()
		for _, sb := range res.Sandboxes {
			_ = c.Remove(cctx, sb)
		}
	}()
	var wg sync.WaitGroup
	errs := make(chan error, len(res.Sandboxes))
	for _, sb := range res.Sandboxes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs <- firstCommand(ctx, c, sb)
		}()
	}
	wg.Wait()
	close(errs)
	row.ReadyMS = ms(time.Since(start))
	row.MemDeltaBytes = max(mem0-memAvailable(), 0)
	for err := range errs {
		if err != nil && row.Error == "" {
			row.Error = err.Error()
		}
	}
	return row
}

// cleanupContext is a context for removing what a run made once ctx may be
// canceled (an interrupted benchmark): ctx's values, a deadline of its own.
func cleanupContext(ctx context.Context) (context.Context, context.CancelFunc) {
	return context.WithTimeout(context.WithoutCancel(ctx), time.Minute)
}

// removeForked removes the sandboxes named prefix1..prefixN, if any: the
// children of a fork whose answer never came.
func removeForked(ctx context.Context, c *client.Client, prefix string, n int) {
	cctx, cancel := cleanupContext(ctx)
	defer cancel()
	sbs, err := c.List(cctx)
	if err != nil {
		return
	}
	for _, sb := range sbs {
		if k, ok := strings.CutPrefix(sb.Name, prefix); ok {
			if i, err := strconv.Atoi(k); err == nil && i >= 1 && i <= n && strconv.Itoa(i) == k {
				_ = c.Remove(cctx, sb.Name)
			}
		}
	}
}

// firstCommand runs a rollout's first command in fork child sb: the
// command the copy baselines run in their new shells (fanoutCopy), sent to
// the child's copy of the forked sandbox's persistent shell, as a rollout
// would continue the agent's shell. It fails unless the command exits 0.
func firstCommand(ctx context.Context, c *client.Client, sb string) error {
	res, err := c.Step(ctx, sb, "sh", api.SendRequest{
		Text:      firstCmd + "\necho __RWB_0_$?__", // the marker of rewindManager.send
		Until:     rwMarker().String(),
		TimeoutMS: 120000,
		IdleMS:    120000,
	})
	if err != nil {
		return fmt.Errorf("first command in %s: %w", sb, err)
	}
	m := rwMarker().FindStringSubmatch(res.Output)
	if m == nil {
		return fmt.Errorf("first command in %s: no exit status in %q", sb, res.Output)
	}
	if m[1] != "0" {
		return fmt.Errorf("first command in %s exited %s", sb, m[1])
	}
	return nil
}

// firstCmd is every fan-out copy's first command (in a shell with $R the
// repository).
const firstCmd = "ls $R >/dev/null"

// waitWarm waits until the daemon has n fork children of checkpoint id
// prepared (its rewind_warm_forks metric).
func waitWarm(ctx context.Context, c *client.Client, id string, n int, timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	want := `rewind_warm_forks{checkpoint="` + id + `"} `
	have := 0
	for {
		text, err := c.Metrics(ctx)
		if err != nil {
			return err
		}
		have = 0
		for _, l := range strings.Split(text, "\n") {
			if v, ok := strings.CutPrefix(l, want); ok {
				f, _ := strconv.ParseFloat(strings.TrimSpace(v), 64)
				have = int(f)
			}
		}
		if have >= n {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("only %d of %d fork children prepared after %s (daemon started with --warm-forks below %d?)", have, n, timeout, n)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(100 * time.Millisecond):
		}
	}
}

func fanoutCopy(ctx context.Context, parent string, setup []string, n int) FanoutRow {
	row := FanoutRow{Name: "cp-a", N: n}
	b := &copyBaseline{dirBase: dirBase{name: "fanout-cp"}, mode: "cp", parent: parent}
	defer b.Close()
	if err := b.Start(ctx, setup); err != nil {
		row.Error = err.Error()
		return row
	}
	mem0 := memAvailable()
	start := time.Now()
	var shells []*shell
	defer func() {
		for _, s := range shells {
			s.kill()
		}
	}()
	for i := 0; i < n; i++ {
		dst := filepath.Join(b.root, "snaps", strconv.Itoa(i))
		if err := exec.CommandContext(ctx, "cp", "-a", b.repo, dst).Run(); err != nil {
			row.Error = err.Error()
			return row
		}
	}
	row.ForkMS = ms(time.Since(start))
	var wg sync.WaitGroup
	var mu sync.Mutex
	for i := 0; i < n; i++ {
		dst := filepath.Join(b.root, "snaps", strconv.Itoa(i))
		wg.Add(1)
		go func() {
			defer wg.Done()
			s, err := startShell(dst, dst)
			if err == nil {
				_, _, err = s.run(ctx, firstCmd)
			}
			mu.Lock()
			defer mu.Unlock()
			if s != nil {
				shells = append(shells, s)
			}
			if err != nil && row.Error == "" {
				row.Error = err.Error()
			}
		}()
	}
	wg.Wait()
	row.ReadyMS = ms(time.Since(start))
	row.MemDeltaBytes = max(mem0-memAvailable(), 0)
	row.DiskBytes = duBytes(filepath.Join(b.root, "snaps"))
	return row
}
