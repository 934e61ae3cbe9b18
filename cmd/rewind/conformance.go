//go:build linux

package main

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"text/tabwriter"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/conformance"
	"github.com/rewind-sandbox/rewind/probe"
)

// allConformancePaths are the path names `rewind conformance run` knows, in
// matrix order.
var allConformancePaths = []string{"fuse", "kernel", "template", "criu", "kernel-proc", "ebpf", "userspace"}

func newConformanceCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "conformance",
		Short: "Check that every rewind path reaches identical state on this host",
		Long: `conformance runs workloads (file operations, shell commands, checkpoints,
restores, forks) on every path rewind offers on this host and on a reference
model, and checks that all reach the same state at every checkpoint and
restore. See conformance/FORMAT.md for the workload format.`,
		Example: "  sudo rewind conformance run\n  sudo rewind conformance run --paths fuse,kernel --workload my.json",
	}
	cmd.AddCommand(newConformanceRunCmd())
	return cmd
}

func newConformanceRunCmd() *cobra.Command {
	var (
		paths     []string
		workloads []string
		seed      int64
		steps     int
		asJSON    bool
		workDir   string
		reproDir  string
		noLoop    bool
	)
	cmd := &cobra.Command{
		Use:   "run",
		Short: "Run the conformance corpus (or given workloads) and print a workload x path matrix",
		Long: `run executes the shipped corpus (embedded in the binary) or the --workload
files on each requested path and prints a matrix: pass, fail (with the first
differing path, step and entries), skip (path unavailable here; on the probe
paths ebpf and userspace also a workload with no turn, whose effect reports
there are none to compare) or '-' (the
workload does not apply to the path: file-system workloads run on fuse and
kernel, process workloads — those with sessions — on template, criu,
kernel-proc (the sandbox root on native overlayfs, its switch replacing the
root mount), ebpf and userspace). A '*' marks
a pass that used a documented exception (conformance/FORMAT.md). The exit
status is 1 when any path fails.

The kernel path runs on a loop-mounted XFS with reflink=1 made in the work
directory (needs xfsprogs and a free loop device); with --no-loop it uses the
work directory's own file system. Needs root. --seed runs randomized
workloads instead: file operations on the file-system paths, a bash
session's state changed in random steps on the process and probe paths; a
failure is minimized and written to --repro-dir.

Workload files may contain shell commands, run as root: only run files you trust.`,
		Example: `  sudo rewind conformance run
  sudo rewind conformance run --paths fuse,kernel --workload my-workload.json
  sudo rewind conformance run --seed 42 --steps 800 --repro-dir /tmp/repro`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			explicit := cmd.Flags().Changed("paths")
			for _, p := range paths {
				if !slices.Contains(allConformancePaths, p) {
					return fmt.Errorf("unknown path %q (known: %s)", p, strings.Join(allConformancePaths, ", "))
				}
			}
			if os.Geteuid() != 0 {
				return fmt.Errorf("conformance needs root (FUSE and overlay mounts, loop devices)")
			}
			var ws []*conformance.Workload
			if cmd.Flags().Changed("seed") {
				if len(workloads) > 0 {
					return fmt.Errorf("--seed and --workload are exclusive")
				}
			} else if len(workloads) > 0 {
				for _, f := range workloads {
					w, err := conformance.Load(f)
					if err != nil {
						return err
					}
					ws = append(ws, w)
				}
			} else {
				var err error
				if ws, err = conformance.Corpus(); err != nil {
					return err
				}
			}
			return runConformance(cmd.Context(), cmd.OutOrStdout(), conformanceRun{
				paths: paths, explicit: explicit, workloads: ws, seed: seed, random: cmd.Flags().Changed("seed"),
				steps: steps, json: asJSON, workDir: workDir, reproDir: reproDir, noLoop: noLoop,
			})
		},
	}
	cmd.Flags().StringSliceVar(&paths, "paths", allConformancePaths, "paths to run: "+strings.Join(allConformancePaths, ","))
	cmd.Flags().StringArrayVar(&workloads, "workload", nil, "workload file (repeatable; default: the shipped corpus)")
	cmd.Flags().Int64Var(&seed, "seed", 0, "run one randomized workload generated from this seed")
	cmd.Flags().IntVar(&steps, "steps", 500, "steps of the randomized workload (--seed)")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the results as JSON")
	cmd.Flags().StringVar(&workDir, "work-dir", "", "scratch directory (default: a new directory under $TMPDIR, removed at the end)")
	cmd.Flags().StringVar(&reproDir, "repro-dir", ".", "where a minimized failing randomized workload is written")
	cmd.Flags().BoolVar(&noLoop, "no-loop", false, "run the kernel path on the work directory's file system instead of a loop XFS")
	return cmd
}

type conformanceRun struct {
	paths     []string
	explicit  bool
	workloads []*conformance.Workload
	seed      int64
	random    bool
	steps     int
	json      bool
	workDir   string
	reproDir  string
	noLoop    bool
}

// pathAvailability says why a path cannot run here ("" = it can).
func pathAvailability(p string) string {
	switch p {
	case "fuse":
		if _, err := os.Stat("/dev/fuse"); err != nil {
			return "no /dev/fuse"
		}
	case "kernel":
		b, _ := os.ReadFile("/proc/filesystems")
		if !strings.Contains(string(b), "overlay") {
			return "no overlayfs in /proc/filesystems"
		}
	case "template", "userspace":
		if _, err := os.Stat("/dev/fuse"); err != nil {
			return "no /dev/fuse (the sandbox root is a FUSE view)"
		}
	case "kernel-proc":
		b, _ := os.ReadFile("/proc/filesystems")
		if !strings.Contains(string(b), "overlay") {
			return "no overlayfs in /proc/filesystems"
		}
		if err := conformance.CheckCRIU(""); err != nil {
			return err.Error()
		}
	case "criu":
		if _, err := os.Stat("/dev/fuse"); err != nil {
			return "no /dev/fuse (the sandbox root is a FUSE view)"
		}
		if err := conformance.CheckCRIU(""); err != nil {
			return err.Error()
		}
	case "ebpf":
		if err := probe.CheckEBPF(); err != nil {
			return err.Error()
		}
	}
	return ""
}

// runOne runs w on the paths that apply to it (file-system paths for a
// file-system workload, process and probe paths for a process workload)
// and marks the others "-".
func runOne(ctx context.Context, w *conformance.Workload, run []string, opts conformance.Options) (*conformance.Result, error) {
	var fsPaths, procPaths []string
	for _, p := range run {
		if slices.Contains(conformance.FSPaths, p) {
			fsPaths = append(fsPaths, p)
		} else {
			procPaths = append(procPaths, p)
		}
	}
	res := &conformance.Result{Workload: w.Name, Steps: len(w.Steps)}
	var sub *conformance.Result
	var err error
	if w.Process() {
		sub, err = conformance.RunProcess(ctx, w, conformance.ProcOptions{Paths: procPaths, WorkDir: opts.WorkDir, Logger: opts.Logger})
	} else {
		o := opts
		o.Paths = fsPaths
		sub, err = conformance.Run(ctx, w, o)
	}
	if err != nil {
		return nil, err
	}
	res.Paths = columns(sub, run)
	return res, nil
}

// columns returns sub's result for each path of run, in that order, with
// "-" for a path sub did not run (the workload does not apply to it).
func columns(sub *conformance.Result, run []string) []conformance.PathResult {
	out := make([]conformance.PathResult, 0, len(run))
	for _, p := range run {
		pr := conformance.PathResult{Path: p, Status: "-"}
		for _, q := range sub.Paths {
			if q.Path == p {
				pr = q
			}
		}
		out = append(out, pr)
	}
	return out
}

func runConformance(ctx context.Context, out io.Writer, r conformanceRun) error {
	if ctx == nil {
		ctx = context.Background()
	}
	base := r.workDir
	if base == "" {
		d, err := os.MkdirTemp("", "rewind-conformance-")
		if err != nil {
			return fmt.Errorf("work dir: %w", err)
		}
		defer os.RemoveAll(d)
		base = d
	}
	skipped := map[string]string{}
	var run []string
	for _, p := range r.paths {
		if why := pathAvailability(p); why != "" {
			skipped[p] = why
			continue
		}
		run = append(run, p)
	}
	opts := conformance.Options{Paths: run, WorkDir: base, Logger: slog.New(slog.DiscardHandler)}
	kernelNote := ""
	if slices.Contains(run, "kernel") && !r.noLoop {
		loopDir, err := os.MkdirTemp(base, "loop-")
		if err != nil {
			return fmt.Errorf("work dir: %w", err)
		}
		mp, err := conformance.MakeLoopXFS(loopDir, 1<<30)
		if err != nil {
			kernelNote = "kernel path on the work directory's file system (" + err.Error() + ")"
		} else {
			defer func() { _ = conformance.RemoveLoopXFS(loopDir, mp) }()
			opts.KernelDir = mp
		}
	}

	var results []*conformance.Result
	var repro string
	if r.random {
		// The file-system paths run a random file-system workload, the
		// process and probe paths a random process workload, both from
		// the seed; the first failure's reproducer is reported.
		fsPaths := slices.DeleteFunc(slices.Clone(run), func(p string) bool { return !slices.Contains(conformance.FSPaths, p) })
		procPaths := slices.DeleteFunc(slices.Clone(run), func(p string) bool { return slices.Contains(conformance.FSPaths, p) })
		var ran []*conformance.Result
		var files []string
		if len(fsPaths) > 0 {
			o := opts
			o.Paths = fsPaths
			res, file, err := conformance.RunRandom(ctx, uint64(r.seed), r.steps, o, r.reproDir)
			if err != nil {
				return err
			}
			ran, files = append(ran, res), append(files, file)
		}
		if len(procPaths) > 0 {
			po := conformance.ProcOptions{Paths: procPaths, WorkDir: opts.WorkDir, Logger: opts.Logger}
			res, file, err := conformance.RunRandomProcess(ctx, uint64(r.seed), r.steps, po, r.reproDir)
			if err != nil {
				return err
			}
			ran, files = append(ran, res), append(files, file)
		}
		for i, res := range ran {
			results = append(results, &conformance.Result{Workload: res.Workload, Steps: res.Steps, Paths: columns(res, run)})
			if file := files[i]; file != "" && repro == "" {
				if abs, err := filepath.Abs(file); err == nil {
					file = abs
				}
				repro = file
			}
		}
	} else {
		for _, w := range r.workloads {
			res, err := runOne(ctx, w, run, opts)
			if err != nil {
				return err
			}
			results = append(results, res)
		}
	}

	failed := false
	for _, res := range results {
		failed = failed || res.Failed()
	}
	if r.explicit && len(skipped) > 0 {
		failed = true // a path asked for by name must run
	}
	if r.json {
		enc := json.NewEncoder(out)
		enc.SetIndent("", "  ")
		if err := enc.Encode(struct {
			Results []*conformance.Result `json:"results"`
			Skipped map[string]string     `json:"skipped,omitempty"`
			Repro   string                `json:"repro,omitempty"`
		}{results, skipped, repro}); err != nil {
			return err
		}
	} else {
		printMatrix(out, r.paths, results, skipped)
		if kernelNote != "" {
			fmt.Fprintln(out, "note:", kernelNote)
		}
		if repro != "" {
			fmt.Fprintf(out, "minimized reproducer: %s\n  rerun: rewind conformance run --workload %s\n", repro, repro)
		}
	}
	if failed {
		return exitError{1}
	}
	return nil
}

func printMatrix(out io.Writer, paths []string, results []*conformance.Result, skipped map[string]string) {
	tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
	fmt.Fprintf(tw, "WORKLOAD\tSTEPS\t%s\n", strings.ToUpper(strings.Join(paths, "\t")))
	for _, res := range results {
		fmt.Fprintf(tw, "%s\t%d", res.Workload, res.Steps)
		for _, p := range paths {
			cell := "skip"
			if _, ok := skipped[p]; !ok {
				cell = "-"
			}
			for _, pr := range res.Paths {
				if pr.Path != p {
					continue
				}
				cell = pr.Status
				if pr.Status == "fail" {
					cell = fmt.Sprintf("FAIL@%d", pr.Step)
				} else if len(pr.Exceptions) > 0 {
					cell += "*"
				}
			}
			fmt.Fprintf(tw, "\t%s", cell)
		}
		fmt.Fprintln(tw)
	}
	tw.Flush()
	for _, p := range paths {
		if why, ok := skipped[p]; ok {
			fmt.Fprintf(out, "skip %s: %s\n", p, why)
		}
	}
	for _, res := range results {
		if ff := res.FirstFailure(); ff != nil {
			fmt.Fprintf(out, "\nFAIL %s: first differing path %s at step %d (%s):\n  %s\n", res.Workload, ff.Path, ff.Step, ff.Op, ff.Detail)
		}
	}
	exc := map[string]bool{}
	for _, res := range results {
		for _, pr := range res.Paths {
			for _, e := range pr.Exceptions {
				exc[pr.Path+": "+e] = true
			}
		}
	}
	if len(exc) > 0 {
		keys := make([]string, 0, len(exc))
		for k := range exc {
			keys = append(keys, k)
		}
		slices.Sort(keys)
		fmt.Fprintf(out, "\n* documented exceptions applied (conformance/FORMAT.md): %s\n", strings.Join(keys, ", "))
	}
}
