package conformance

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
)

// RunRandom generates a workload from seed (n steps) and runs it. When a
// path fails, the workload is minimized against that path and written to
// reproDir as <name>-min.json; the file's path is returned. Run that file
// with `rewind conformance run --workload FILE` to reproduce.
func RunRandom(ctx context.Context, seed uint64, n int, opts Options, reproDir string) (*Result, string, error) {
	return RunGenerated(ctx, Generate(seed, n), opts, reproDir)
}

// RunGenerated runs a generated workload like RunRandom.
func RunGenerated(ctx context.Context, w *Workload, opts Options, reproDir string) (*Result, string, error) {
	res, err := Run(ctx, w, opts)
	if err != nil || !res.Failed() {
		return res, "", err
	}
	ff := res.FirstFailure()
	one := opts
	one.Paths = []string{ff.Path}
	min := Minimize(ctx, w, func(c *Workload) bool {
		r, err := Run(ctx, c, one)
		return err == nil && r.Failed()
	}, 400)
	file, err := writeRepro(w, min, reproDir)
	return res, file, err
}

// writeRepro writes min, minimized from w, to reproDir as <name>-min.json
// and returns the file's path.
func writeRepro(w, min *Workload, reproDir string) (string, error) {
	min.Name = w.Name + "-min"
	if err := os.MkdirAll(reproDir, 0o755); err != nil {
		return "", fmt.Errorf("write reproducer: %w", err)
	}
	file := filepath.Join(reproDir, min.Name+".json")
	if err := os.WriteFile(file, min.Marshal(), 0o644); err != nil {
		return "", fmt.Errorf("write reproducer: %w", err)
	}
	return file, nil
}

// RunRandomProcess generates a process workload from seed (n steps, see
// GenerateProcess) and runs it on the process paths of opts. A failure is
// minimized against the first failing path and written to reproDir like
// RunRandom's.
func RunRandomProcess(ctx context.Context, seed uint64, n int, opts ProcOptions, reproDir string) (*Result, string, error) {
	w := GenerateProcess(seed, n)
	res, err := RunProcess(ctx, w, opts)
	if err != nil || !res.Failed() {
		return res, "", err
	}
	one := opts
	one.Paths = []string{res.FirstFailure().Path}
	min := Minimize(ctx, w, func(c *Workload) bool {
		r, err := RunProcess(ctx, c, one)
		return err == nil && r.Failed()
	}, 150)
	file, err := writeRepro(w, min, reproDir)
	return res, file, err
}
