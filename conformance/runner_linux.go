package conformance

import (
	"context"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"github.com/rewind-sandbox/rewind/conformance/tree"
	"github.com/rewind-sandbox/rewind/kernelpath"
)

// Options configures Run.
type Options struct {
	// Paths lists the file-system paths to run: "fuse", "kernel".
	Paths []string
	// WorkDir is a scratch directory (models, FUSE store, mount points).
	WorkDir string
	// KernelDir holds the kernel path's layer store and mounts; it should
	// be on XFS with reflink=1 (or btrfs) for the production freeze mode.
	// "" = WorkDir.
	KernelDir string
	// MaxDiff bounds the differing entries reported per failure (default 8).
	MaxDiff int
	// Logger receives the backends' logs (default: discarded).
	Logger *slog.Logger
}

// PathResult is the outcome of one path on one workload.
type PathResult struct {
	// Path is "fuse", "kernel", ...
	Path string `json:"path"`
	// Status is "pass", "fail" or "skip".
	Status string `json:"status"`
	// Step is the index of the first differing step (fail only).
	Step int `json:"step,omitempty"`
	// Op is that step's operation.
	Op string `json:"op,omitempty"`
	// Detail describes the first difference.
	Detail string `json:"detail,omitempty"`
	// Exceptions lists the documented exceptions applied on this path.
	Exceptions []string `json:"exceptions,omitempty"`
	// Compares counts the state digests that were compared.
	Compares int `json:"compares"`
}

// Result is the outcome of one workload on every path.
type Result struct {
	Workload string       `json:"workload"`
	Steps    int          `json:"steps"`
	Paths    []PathResult `json:"paths"`
}

// Failed reports whether any path failed.
func (r *Result) Failed() bool {
	for _, p := range r.Paths {
		if p.Status == "fail" {
			return true
		}
	}
	return false
}

// FirstFailure returns the failing path result that diverged earliest.
func (r *Result) FirstFailure() *PathResult {
	var best *PathResult
	for i := range r.Paths {
		p := &r.Paths[i]
		if p.Status == "fail" && (best == nil || p.Step < best.Step) {
			best = p
		}
	}
	return best
}

// FSPaths are the file-system paths Run knows.
var FSPaths = []string{"fuse", "kernel"}

type runTarget struct {
	t   target
	ref *model
	res *PathResult
	on  bool
}

// Run executes w on the reference model and on every path in opts.Paths,
// in lockstep, and compares each path's tree with the model's at every
// checkpoint, restore, fork, compare step and at the end; the errno of
// every operation, the output of fdread steps and expectations are
// compared too. A path that differs is stopped and reported with its first
// difference. The returned error is for broken workloads or setup
// failures of the model, not for path failures.
func Run(ctx context.Context, w *Workload, opts Options) (*Result, error) {
	if opts.MaxDiff <= 0 {
		opts.MaxDiff = 8
	}
	log := opts.Logger
	if log == nil {
		log = slog.New(slog.DiscardHandler)
	}
	if opts.WorkDir == "" {
		return nil, fmt.Errorf("conformance: WorkDir is required")
	}
	work, err := os.MkdirTemp(opts.WorkDir, "run-")
	if err != nil {
		return nil, fmt.Errorf("conformance: %w", err)
	}
	defer os.RemoveAll(work)
	kdir := opts.KernelDir
	if kdir == "" {
		kdir = opts.WorkDir
	}

	if w.Process() {
		res := &Result{Workload: w.Name, Steps: len(w.Steps)}
		for _, p := range opts.Paths {
			res.Paths = append(res.Paths, PathResult{Path: p, Status: "skip", Detail: "process workload (RunProcess)"})
		}
		return res, nil
	}
	ref, err := newModel(filepath.Join(work, "model"), "", nil)
	if err != nil {
		return nil, err
	}
	defer ref.close()
	models := []*model{ref}
	res := &Result{Workload: w.Name, Steps: len(w.Steps), Paths: make([]PathResult, 0, len(opts.Paths))}
	var rts []*runTarget
	defer func() {
		for _, rt := range rts {
			if rt.on {
				_ = rt.t.close()
			}
		}
	}()
	for _, p := range opts.Paths {
		res.Paths = append(res.Paths, PathResult{Path: p, Status: "pass"})
		pr := &res.Paths[len(res.Paths)-1]
		var t target
		switch p {
		case "fuse":
			dir := filepath.Join(work, "fuse")
			if err := os.Mkdir(dir, 0o755); err != nil {
				return nil, err
			}
			t, err = newFSTarget("fuse", dir, fuseMount(log), map[string]bool{})
		case "kernel":
			dir, derr := os.MkdirTemp(kdir, "kernel-")
			if derr != nil {
				return nil, fmt.Errorf("conformance: %w", derr)
			}
			defer os.RemoveAll(dir)
			var ft *fsTarget
			ft, err = newFSTarget("kernel", dir, kernelMount(log), map[string]bool{ExHardlinkCopyUp: true, ExUnlinkLowerNlink: true})
			if err == nil {
				if kf, ok := ft.views["main"].fs.(*kernelpath.FS); ok && kf.FreezeMode() != kernelpath.FreezeIoctl {
					ft.exc[ExFDKeepsOldView] = true
				}
				t = ft
			}
		default:
			err = fmt.Errorf("unknown path %q (known: %s)", p, strings.Join(FSPaths, ", "))
		}
		if err != nil {
			pr.Status, pr.Step, pr.Detail = "fail", -1, "setup: "+err.Error()
			continue
		}
		rt := &runTarget{t: t, ref: ref, res: pr, on: true}
		// A variant model when the workload names an exception this
		// path exhibits.
		exc := map[string]bool{}
		for _, s := range w.Steps {
			if e := s.Except[p]; e != "" && t.applies(e) {
				exc[e] = true
			}
		}
		if len(exc) > 0 {
			vm, err := newModel(filepath.Join(work, "model-"+p), p, exc)
			if err != nil {
				return nil, err
			}
			defer vm.close()
			models = append(models, vm)
			rt.ref = vm
		}
		rts = append(rts, rt)
	}

	fail := func(rt *runTarget, i int, s Step, format string, args ...any) {
		rt.res.Status, rt.res.Step, rt.res.Op = "fail", i, s.Op
		rt.res.Detail = fmt.Sprintf(format, args...)
		rt.on = false
		if err := rt.t.close(); err != nil {
			log.Warn("conformance: close after failure", "path", rt.t.name(), "err", err)
		}
	}

	for i, s := range w.Steps {
		if err := ctx.Err(); err != nil {
			return nil, err
		}
		if !slices.ContainsFunc(rts, func(rt *runTarget) bool { return rt.on }) && len(rts) > 0 {
			break
		}
		type outcome struct {
			out string
			err error
		}
		mres := map[*model]outcome{}
		for _, m := range models {
			if err := m.beforeStep(s); err != nil {
				return nil, fmt.Errorf("step %d (%s): %s: %w", i, s.Op, m.name(), err)
			}
			out, err := doStep(ctx, m, s)
			mres[m] = outcome{out, err}
			if m == ref {
				if err := checkModel(w, s, out, err); err != nil {
					return nil, fmt.Errorf("workload %s: step %d (%s): the reference model %w", w.Name, i, s.Op, err)
				}
			}
		}
		for _, rt := range rts {
			if !rt.on {
				continue
			}
			if e := s.Except[rt.res.Path]; e != "" && rt.t.applies(e) && !slices.Contains(rt.res.Exceptions, e) {
				rt.res.Exceptions = append(rt.res.Exceptions, e)
			}
			out, err := doStep(ctx, rt.t, s)
			want := mres[rt.ref]
			if a, b := stepErr(s, want.err), stepErr(s, err); a != b {
				fail(rt, i, s, "%s: model %s, %s %s (%v)", describe(s), a, rt.t.name(), b, err)
				continue
			}
			if (s.Op == "fdread" || (s.Op == "sh" && s.Expect != nil)) && out != want.out {
				fail(rt, i, s, "%s: output %q, model %q", describe(s), trunc(out), trunc(want.out))
				continue
			}
		}
		if isComparePoint(s) {
			if err := compareAll(models, rts, ref, i, s, opts.MaxDiff, fail); err != nil {
				return nil, err
			}
		}
	}
	if len(w.Steps) > 0 {
		end := Step{Op: "compare"}
		if err := compareAll(models, rts, ref, len(w.Steps), end, opts.MaxDiff, fail); err != nil {
			return nil, err
		}
	}
	return res, nil
}

func isComparePoint(s Step) bool {
	switch s.Op {
	case "checkpoint", "restore", "fork", "view", "compact", "compare":
		return true
	}
	return false
}

// digestOptions are the tree options every comparison uses. Times are not
// compared: no path promises to preserve atime/ctime and copy-up changes
// them legitimately.
func digestOptions(m bool) tree.Options {
	o := tree.Options{IgnoreRoot: true, XattrPrefixes: []string{"user."}}
	if m {
		o.Exclude = []string{hiddenDir}
	}
	return o
}

func compareAll(models []*model, rts []*runTarget, ref *model, i int, s Step, maxDiff int,
	fail func(*runTarget, int, Step, string, ...any)) error {
	snaps := map[*model]tree.Snapshot{}
	for _, m := range models {
		snap, err := tree.Take(m.ops().root, digestOptions(true))
		if err != nil {
			return fmt.Errorf("step %d: %s: %w", i, m.name(), err)
		}
		snaps[m] = snap
	}
	for _, rt := range rts {
		if !rt.on {
			continue
		}
		got, err := tree.Take(rt.t.ops().root, digestOptions(false))
		if err != nil {
			fail(rt, i, s, "%s: digest: %v", describe(s), err)
			continue
		}
		rt.res.Compares++
		want := snaps[rt.ref]
		if !tree.Equal(want, got) {
			d := tree.Diff(want, got, maxDiff)
			fail(rt, i, s, "%s: tree differs from %s:\n  %s", describe(s), rt.ref.name(), strings.Join(d, "\n  "))
		}
	}
	_ = ref
	return nil
}

// doStep runs one step on a target.
func doStep(ctx context.Context, t target, s Step) (string, error) {
	switch s.Op {
	case "checkpoint":
		return "", t.checkpoint(s.Label)
	case "restore":
		return "", t.restore(s.Label, s)
	case "fork":
		return "", t.fork(s.Label, s.View)
	case "view":
		return "", t.setView(s.View)
	case "compact":
		return "", t.compact()
	case "turn", "compare":
		return "", nil
	}
	return t.ops().apply(ctx, s)
}

// checkModel validates a step's outcome on the reference model: a step
// fails only when the workload says so (Error) or allows errors; fdread,
// sh and expect steps must see what the workload expects.
func checkModel(w *Workload, s Step, out string, err error) error {
	switch {
	case s.Error != "":
		if stepErr(s, err) != s.Error {
			return fmt.Errorf("returned %s, the workload expects %s", errName(err), s.Error)
		}
	case err != nil && !w.AllowErrors:
		return fmt.Errorf("failed: %v", err)
	}
	if err == nil && s.Expect != nil && (s.Op == "fdread" || s.Op == "sh") && out != *s.Expect {
		return fmt.Errorf("printed %q, the workload expects %q", trunc(out), trunc(*s.Expect))
	}
	return nil
}

func describe(s Step) string {
	var b strings.Builder
	b.WriteString(s.Op)
	for _, f := range []struct{ k, v string }{{"path", s.Path}, {"to", s.To}, {"label", s.Label}, {"fd", s.FD}, {"view", s.View}} {
		if f.v != "" {
			fmt.Fprintf(&b, " %s=%s", f.k, f.v)
		}
	}
	if s.Cmd != "" {
		fmt.Fprintf(&b, " cmd=%q", trunc(s.Cmd))
	}
	return b.String()
}

// stepErr is errName with the errno aliases POSIX allows for one
// operation: rename(2) onto a non-empty directory may fail with
// ENOTEMPTY or EEXIST (overlayfs says EEXIST, most file systems
// ENOTEMPTY); both read as ENOTEMPTY. Nothing else is aliased.
func stepErr(s Step, err error) string {
	n := errName(err)
	if s.Op == "rename" && n == "EEXIST" {
		return "ENOTEMPTY"
	}
	return n
}
