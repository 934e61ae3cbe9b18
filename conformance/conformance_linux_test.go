package conformance

import (
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/rewind-sandbox/rewind/internal/testenv"
	"github.com/rewind-sandbox/rewind/probe"
)

// requireFS checks what the file-system paths need: root, /dev/fuse,
// mkfs.xfs and a loop device.
func requireFS(t testing.TB) {
	t.Helper()
	testenv.RequireRoot(t)
	_, err := os.Stat("/dev/fuse")
	testenv.RequireNoErr(t, err, "/dev/fuse")
	_, err = exec.LookPath("python3")
	testenv.RequireNoErr(t, err, "python3 (mmap steps)")
}

// loopXFS makes an XFS file system with reflink=1 on a loop file and
// returns its mount point; it is unmounted at cleanup.
func loopXFS(t testing.TB) string {
	t.Helper()
	dir := t.TempDir()
	mp, err := MakeLoopXFS(dir, 1<<30)
	testenv.RequireNoErr(t, err, "loop XFS with reflink=1")
	t.Cleanup(func() {
		if err := RemoveLoopXFS(dir, mp); err != nil {
			t.Errorf("remove loop XFS: %v", err)
		}
	})
	return mp
}

// checkPath fails t for a failed path.
func checkPath(t *testing.T, name string, p PathResult, extra string) {
	t.Helper()
	if p.Status != "pass" {
		t.Errorf("%s on %s: %s at step %d: %s%s", name, p.Path, p.Status, p.Step, p.Detail, extra)
	}
}

func runWorkload(t *testing.T, w *Workload, kdir string) *Result {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	res, err := Run(ctx, w, Options{Paths: FSPaths, WorkDir: t.TempDir(), KernelDir: kdir})
	if err != nil {
		t.Fatalf("%s: %v", w.Name, err)
	}
	for _, p := range res.Paths {
		checkPath(t, w.Name, p, "")
	}
	return res
}

func TestCorpusFS(t *testing.T) {
	requireFS(t)
	kdir := loopXFS(t)
	files, err := filepath.Glob("testdata/*.json")
	if err != nil || len(files) == 0 {
		t.Fatalf("no corpus: %v", err)
	}
	for _, f := range files {
		w, err := Load(f)
		if err != nil {
			t.Fatal(err)
		}
		if w.Process() {
			continue // TestCorpusProcess
		}
		t.Run(w.Name, func(t *testing.T) {
			res := runWorkload(t, w, kdir)
			for _, p := range res.Paths {
				if p.Compares == 0 {
					t.Errorf("%s: no state compared", p.Path)
				}
				t.Logf("%s: %s, %d digests compared, exceptions %v", p.Path, p.Status, p.Compares, p.Exceptions)
			}
		})
	}
}

// TestExceptionsAreNecessary removes each documented exception from the
// corpus workloads that use it and checks that the path then fails: an
// exception never hides a difference that does not exist, and the runner
// does catch the behaviour it describes.
func TestExceptionsAreNecessary(t *testing.T) {
	requireFS(t)
	kdir := loopXFS(t)
	for _, file := range []string{"testdata/hardlink-copyup.json", "testdata/fd-across.json"} {
		w, err := Load(file)
		if err != nil {
			t.Fatal(err)
		}
		for i, s := range w.Steps {
			for path, ex := range s.Except {
				t.Run(fmt.Sprintf("%s/%d/%s/%s", w.Name, i, path, ex), func(t *testing.T) {
					w2 := *w
					w2.Steps = append([]Step(nil), w.Steps...)
					st := w2.Steps[i]
					st.Except = map[string]string{}
					for p, e := range s.Except {
						if p != path {
							st.Except[p] = e
						}
					}
					w2.Steps[i] = st
					// Stop right after the first comparison following the
					// step, so later steps do not mask the difference.
					end := i + 1
					for end < len(w2.Steps) && !isComparePoint(w2.Steps[end]) {
						end++
					}
					if end < len(w2.Steps) {
						w2.Steps = w2.Steps[:end+1]
					}
					ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
					defer cancel()
					res, err := Run(ctx, &w2, Options{Paths: []string{path}, WorkDir: t.TempDir(), KernelDir: kdir})
					if err != nil {
						t.Fatal(err)
					}
					if p := res.Paths[0]; p.Status != "fail" || p.Step < i {
						t.Fatalf("without exception %s at step %d, %s: %s at step %d (%s); want a failure at or after step %d",
							ex, i, path, p.Status, p.Step, p.Detail, i)
					}
				})
			}
		}
	}
}

// TestRandom runs seeded random workloads on every path; a failure is
// minimized and written out as a workload file (its path is in the error).
func TestRandom(t *testing.T) {
	requireFS(t)
	kdir := loopXFS(t)
	for _, seed := range []uint64{1, 2, 3, 4} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			out := filepath.Join(os.TempDir(), "rewind-conformance-repro")
			res, file, err := RunRandom(ctx, seed, 250, Options{Paths: FSPaths, WorkDir: t.TempDir(), KernelDir: kdir}, out)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range res.Paths {
				checkPath(t, fmt.Sprintf("seed %d", seed), p, "\nminimized reproducer: "+file)
			}
		})
	}
}

// TestRandomProcess runs seeded random process workloads (a bash
// session's state changed in random steps, GenerateProcess) on every
// process path; a failure is minimized and written out as a workload file.
func TestRandomProcess(t *testing.T) {
	requireProc(t, ProcPaths)
	for _, seed := range []uint64{1, 2} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
			defer cancel()
			out := filepath.Join(os.TempDir(), "rewind-conformance-repro")
			res, file, err := RunRandomProcess(ctx, seed, 100, ProcOptions{Paths: ProcPaths, WorkDir: t.TempDir()}, out)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range res.Paths {
				if p.Status != "pass" {
					t.Errorf("seed %d on %s: %s at step %d: %s\nminimized reproducer: %s", seed, p.Path, p.Status, p.Step, p.Detail, file)
				} else if p.Compares == 0 {
					t.Errorf("seed %d on %s: nothing compared", seed, p.Path)
				}
			}
		})
	}
}

// requireProc checks what the process and probe paths need.
func requireProc(t testing.TB, paths []string) {
	t.Helper()
	requireFS(t)
	for _, p := range paths {
		switch p {
		case "criu":
			testenv.RequireNoErr(t, CheckCRIU(""), "criu (scripts/deps.sh builds it)")
		case "ebpf":
			testenv.RequireNoErr(t, probe.CheckEBPF(), "eBPF probe")
		}
	}
}

// knownIssues lists the workloads of testdata/known/ and the path each one
// fails on because of an open bug in that path's package (reported in the
// area's notes). TestKnownIssues checks that every other path passes them
// and logs when a listed path starts passing (then move the workload into
// the corpus and delete the entry). They are not in the embedded corpus.
var knownIssues = map[string]string{}

func TestKnownIssues(t *testing.T) {
	files, _ := filepath.Glob("testdata/known/*.json")
	// The list and the directory must agree: an entry without its workload
	// (or a workload without an entry) is a bookkeeping error, not a pass.
	have := map[string]bool{}
	for _, f := range files {
		have[strings.TrimSuffix(filepath.Base(f), ".json")] = true
	}
	for key := range knownIssues {
		if name, _, _ := strings.Cut(key, "/"); !have[name] {
			t.Errorf("knownIssues lists %q, but testdata/known/%s.json does not exist", key, name)
		}
	}
	if len(files) == 0 {
		return // no open known issue
	}
	all := append(append([]string(nil), ProcPaths...), ProbePaths...)
	requireProc(t, all)
	kdir := loopXFS(t)
	for _, f := range files {
		w, err := Load(f)
		if err != nil {
			t.Fatal(err)
		}
		t.Run(w.Name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			var res *Result
			if w.Process() {
				res, err = RunProcess(ctx, w, ProcOptions{Paths: all, WorkDir: t.TempDir()})
			} else {
				res, err = Run(ctx, w, Options{Paths: FSPaths, WorkDir: t.TempDir(), KernelDir: kdir})
			}
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range res.Paths {
				why, known := knownIssues[w.Name+"/"+p.Path]
				switch {
				case known && p.Status == "pass":
					t.Logf("%s on %s passed this run: if it keeps passing, the known issue (%s) is fixed; move the workload into the corpus", w.Name, p.Path, why)
				case known:
					t.Logf("%s on %s: known issue (%s): %s", w.Name, p.Path, why, p.Detail)
				case p.Status == "fail":
					t.Errorf("%s on %s: %s at step %d: %s", w.Name, p.Path, p.Status, p.Step, p.Detail)
				}
			}
		})
	}
}

func TestCorpusProcess(t *testing.T) {
	paths := append(append([]string(nil), ProcPaths...), ProbePaths...)
	requireProc(t, paths)
	files, _ := filepath.Glob("testdata/*.json")
	for _, f := range files {
		w, err := Load(f)
		if err != nil {
			t.Fatal(err)
		}
		if !w.Process() {
			continue
		}
		t.Run(w.Name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
			defer cancel()
			res, err := RunProcess(ctx, w, ProcOptions{Paths: paths, WorkDir: t.TempDir()})
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range res.Paths {
				t.Logf("%s: %s, %d states compared", p.Path, p.Status, p.Compares)
				if p.Status == "skip" && slices.Contains(ProbePaths, p.Path) && p.Detail == "the workload has no turn" {
					continue
				}
				if p.Status != "pass" {
					t.Errorf("%s on %s: %s at step %d: %s", w.Name, p.Path, p.Status, p.Step, p.Detail)
				} else if p.Compares == 0 {
					t.Errorf("%s on %s: nothing compared", w.Name, p.Path)
				}
			}
		})
	}
}

// TestRandomFUSELinks adds hard links to the random workloads and runs them
// on the FUSE path, which promises plain-directory link semantics across
// copy-up (the kernel path has documented exceptions a random workload
// cannot place).
func TestRandomFUSELinks(t *testing.T) {
	requireFS(t)
	for _, seed := range []uint64{1, 2, 3} {
		t.Run(fmt.Sprint(seed), func(t *testing.T) {
			ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
			defer cancel()
			w := GenerateWith(seed, 300, GenOptions{HardLinks: true})
			out := filepath.Join(os.TempDir(), "rewind-conformance-repro")
			res, file, err := RunGenerated(ctx, w, Options{Paths: []string{"fuse"}, WorkDir: t.TempDir()}, out)
			if err != nil {
				t.Fatal(err)
			}
			for _, p := range res.Paths {
				checkPath(t, fmt.Sprintf("seed %d", seed), p, "\nminimized reproducer: "+file)
			}
		})
	}
}
