package bench

import (
	"context"
	"fmt"
	"io"
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
	// Counts of forks to make from one checkpoint (default 16, 32, 64).
	Counts []int
	// Client reaches the rewind daemon.
	Client *client.Client
	// TrainerStepMS is the simulated trainer step the rollouts feed
	// (default 5000 ms): the trainer waits while forks come up.
	TrainerStepMS float64
	// Parent holds the baselines' copies (default: a temp dir).
	Parent string
	// FS is the file-system backend of the forked sandbox ("" or "auto",
	// "fuse", "kernel"); its fork children get the same.
	FS       string
	Progress io.Writer
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
	TrainerWait float64 `json:"trainer_wait"`
	GPUUtil     float64 `json:"gpu_util"`
	// MemDeltaBytes is the drop in MemAvailable while the copies exist.
	MemDeltaBytes int64 `json:"mem_delta_bytes"`
	DiskBytes     int64 `json:"disk_bytes"`
	// OverFloorMS is ReadyMS less the shell-floor row's at the same N:
	// what the system adds to running the first command itself (set when
	// both rows exist).
	OverFloorMS float64 `json:"over_floor_ms,omitempty"`
	Error       string  `json:"error,omitempty"`
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
func RunFanout(ctx context.Context, o FanoutOptions) ([]FanoutRow, error) {
	if len(o.Counts) == 0 {
		o.Counts = []int{16, 32, 64}
	}
	if o.TrainerStepMS <= 0 {
		o.TrainerStepMS = 5000
	}
	setup := setupCommands()
	var rows []FanoutRow
	finishRow := func(r FanoutRow) FanoutRow {
		r.TrainerWait = r.ReadyMS / (r.ReadyMS + o.TrainerStepMS)
		r.GPUUtil = 1 - r.TrainerWait
		if o.Progress != nil {
			fmt.Fprintf(o.Progress, "fanout %s n=%d: ready in %.1f ms %s\n", r.Name, r.N, r.ReadyMS, r.Error)
		}
		return r
	}
	if o.Client != nil {
		m := &rewindManager{c: o.Client, policy: "always", fs: o.FS}
		if err := m.Start(ctx, setup); err != nil {
			return nil, fmt.Errorf("rewind: %w", err)
		}
		defer m.Close()
		for _, n := range o.Counts {
			// A new checkpoint per width: its first fork finds nothing
			// prepared. A trainer forks the same checkpoint at every step:
			// the repeated fork, once the daemon has prepared children of
			// it in the background (--warm-forks), is the steady state.
			id, _, err := m.Checkpoint(ctx) // waits until durable
			if err != nil {
				return nil, fmt.Errorf("rewind: checkpoint: %w", err)
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
	}
	for _, n := range o.Counts {
		rows = append(rows, finishRow(fanoutCopy(ctx, o.Parent, setup, n)))
	}
	for _, n := range o.Counts {
		rows = append(rows, finishRow(fanoutFloor(ctx, o.Parent, setup, n)))
	}
	setOverFloor(rows)
	return rows, nil
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
	if err := b.Start(ctx, setup); err != nil {
		row.Error = err.Error()
		return row
	}
	defer b.Close()
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
	row.MemDeltaBytes = mem0 - memAvailable()
	return row
}

func fanoutRewind(ctx context.Context, c *client.Client, ckpt string, n int) FanoutRow {
	row := FanoutRow{Name: "rewind-fork", N: n}
	mem0 := memAvailable()
	start := time.Now()
	res, err := c.Fork(ctx, ckpt, api.ForkRequest{Count: n, Prefix: fmt.Sprintf("fan%d-%d", n, time.Now().UnixNano()%1e6)})
	if err != nil {
		row.Error = err.Error()
		return row
	}
	row.ForkMS = ms(time.Since(start))
	defer func() {
		for _, sb := range res.Sandboxes {
			_ = c.Remove(context.WithoutCancel(ctx), sb)
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
	row.MemDeltaBytes = mem0 - memAvailable()
	for err := range errs {
		if err != nil && row.Error == "" {
			row.Error = err.Error()
		}
	}
	return row
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
	if err := b.Start(ctx, setup); err != nil {
		row.Error = err.Error()
		return row
	}
	defer b.Close()
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
	row.MemDeltaBytes = mem0 - memAvailable()
	row.DiskBytes = duBytes(filepath.Join(b.root, "snaps"))
	return row
}
