package bench

import (
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"

	"github.com/rewind-sandbox/rewind/client"
	"golang.org/x/sys/unix"
)

// AllSystems lists every system RunMCTS knows, rewind's rows first.
var AllSystems = []string{"rewind-effects", "rewind-always", "criu-cp-a", "cp-a", "cp-reflink", "tarball", "overlay-remount", "fuse-overlayfs-copy"}

// MCTSOptions configures RunMCTS.
type MCTSOptions struct {
	Traces []*Trace
	// Systems to run (default AllSystems).
	Systems []string
	// Client reaches the rewind daemon (needed for rewind-* rows).
	Client *client.Client
	// Parent is where baselines keep their directories (default: a temp dir).
	Parent string
	// CrashChecks per trace and system (0: none).
	CrashChecks int
	// Repeat runs every system this many times (default 1), the systems'
	// order rotated by one each round (a system run right after the copy
	// baselines finds the page cache and the disk busier); each row is the
	// run with the median state time (see MedianRuns).
	Repeat   int
	Progress io.Writer
}

// CheckSystems refuses a list of systems with an unknown name, an empty
// one or one named twice, saying which systems there are.
func CheckSystems(names []string) error {
	known := "known: " + strings.Join(AllSystems, ", ")
	seen := map[string]bool{}
	for _, n := range names {
		switch {
		case n == "":
			return fmt.Errorf("an empty system name (%s)", known)
		case !slices.Contains(AllSystems, n):
			return fmt.Errorf("unknown system %q (%s)", n, known)
		case seen[n]:
			return fmt.Errorf("system %q named twice", n)
		}
		seen[n] = true
	}
	return nil
}

// RunMCTS replays every trace with every system and aggregates the rows.
// A system that fails records its error in its row; the run goes on. When
// ctx is canceled it stops after cleaning up the system it was running
// and returns the rows so far with ctx's error.
func RunMCTS(ctx context.Context, o MCTSOptions) (*Report, error) {
	if len(o.Systems) == 0 {
		o.Systems = AllSystems
	}
	if err := CheckSystems(o.Systems); err != nil {
		return nil, fmt.Errorf("mcts: %w", err)
	}
	if len(o.Traces) == 0 {
		return nil, errors.New("mcts: no traces")
	}
	if o.CrashChecks < 0 {
		return nil, fmt.Errorf("mcts: %d crash checks: want 0 or more", o.CrashChecks)
	}
	parent := o.Parent
	if parent == "" {
		parent = os.TempDir()
	}
	rep := &Report{Kind: "mcts"}
	for _, t := range o.Traces {
		rep.Traces = append(rep.Traces, fmt.Sprintf("%s (%d nodes, %d rollbacks)", t.Name, len(t.Nodes), t.Rollbacks()))
	}
	if o.Repeat < 1 {
		o.Repeat = 1
	}
	var xfsDir string
	defer func() { removeScratchXFS(xfsDir) }()
	runs := map[string][]*Result{}
	for round := 0; round < o.Repeat; round++ {
		n := len(o.Systems)
		for i := range n {
			name := o.Systems[(i+round)%n]
			var agg *Result
			for _, t := range o.Traces {
				m, cleanup, err := newSystem(name, o.Client, parent, &xfsDir)
				var r *Result
				if err != nil {
					r = &Result{Name: name, Trace: t.Name, Error: err.Error()}
				} else {
					r, _ = Replay(ctx, t, m, ReplayOptions{CrashChecks: o.CrashChecks, Progress: o.Progress})
					cleanup()
				}
				if o.Progress != nil && r.Error != "" {
					fmt.Fprintf(o.Progress, "%s on %s (run %d of %d): failed: %s\n", name, t.Name, round+1, o.Repeat, r.Error)
				} else if o.Progress != nil {
					fmt.Fprintf(o.Progress, "%s on %s (run %d of %d): state %.0f ms, overhead %.3fx\n", name, t.Name, round+1, o.Repeat, r.StateMS, r.OverheadRatio)
				}
				if agg == nil {
					agg = r
					finish(agg)
				} else {
					merge(agg, r)
				}
				if ctx.Err() != nil {
					rep.Systems = MedianRuns(o.Systems, runs)
					return rep, ctx.Err()
				}
			}
			runs[name] = append(runs[name], agg)
		}
	}
	rep.Systems = MedianRuns(o.Systems, runs)
	rep.compareRuns(runs)
	return rep, nil
}

// MedianRuns returns one row per system of order that has runs: the run
// with the median state time (the lower of the two middle ones for an even
// count; runs that failed count as slowest), with StateMSRuns listing the
// state times of every run that did not fail, when there was more than one
// run.
func MedianRuns(order []string, runs map[string][]*Result) []*Result {
	var out []*Result
	for _, name := range order {
		if len(runs[name]) == 0 {
			continue
		}
		row, states := medianRun(runs[name], func(r *Result) bool { return r.Error != "" }, func(r *Result) float64 { return r.StateMS })
		row.StateMSRuns = states
		out = append(out, row)
	}
	return out
}

func newSystem(name string, c *client.Client, parent string, xfsDir *string) (Manager, func(), error) {
	nop := func() {}
	switch name {
	case "rewind-effects", "rewind-always":
		if c == nil {
			return nil, nop, fmt.Errorf("no rewind daemon client")
		}
		return NewRewind(c, strings.TrimPrefix(name, "rewind-")), nop, nil
	case "criu-cp-a":
		return NewCRIUBaseline(parent), nop, nil
	case "cp-a":
		return NewCopyBaseline("cp", parent), nop, nil
	case "tarball":
		return NewCopyBaseline("tar", parent), nop, nil
	case "cp-reflink":
		if *xfsDir == "" {
			d, err := scratchXFS()
			if err != nil {
				return nil, nop, err
			}
			*xfsDir = d
		}
		return NewCopyBaseline("reflink", *xfsDir), nop, nil
	case "overlay-remount":
		return NewOverlayBaseline(parent), nop, nil
	case "fuse-overlayfs-copy":
		return NewFuseOverlayBaseline(parent), nop, nil
	}
	return nil, nop, fmt.Errorf("unknown system %q (known: %s)", name, strings.Join(AllSystems, ", "))
}

// removeScratchXFS undoes scratchXFS: it detaches the mount (the loop
// device goes with its last user) and removes the temp dir with its image.
// "" is a no-op.
func removeScratchXFS(mnt string) {
	if mnt == "" {
		return
	}
	_ = unix.Unmount(mnt, unix.MNT_DETACH)
	_ = os.RemoveAll(filepath.Dir(mnt))
}

// scratchXFS loop-mounts a sparse 4 GiB XFS image with reflink=1 in a temp
// dir and returns the mount point.
func scratchXFS() (mnt string, err error) {
	tmp, err := os.MkdirTemp("", "rewind-bench-xfs-")
	if err != nil {
		return "", err
	}
	defer func() {
		if err != nil {
			_ = os.RemoveAll(tmp)
		}
	}()
	img := filepath.Join(tmp, "img")
	f, err := os.Create(img)
	if err != nil {
		return "", err
	}
	err = f.Truncate(4 << 30)
	f.Close()
	if err != nil {
		return "", err
	}
	if out, err := exec.Command("mkfs.xfs", "-q", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		return "", fmt.Errorf("mkfs.xfs: %v: %s", err, out)
	}
	mnt = filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		return "", err
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		return "", fmt.Errorf("mount loop XFS (needs root): %v: %s", err, out)
	}
	return mnt, nil
}
