package main

import (
	"crypto/rand"
	"encoding/json"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"sort"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/layer"
)

type benchFSOpts struct {
	dir      string
	sizes    []int
	deltas   []int
	rounds   int
	ioMiB    int
	small    int
	stats    int
	skipIO   bool
	ioOnly   bool
	rows     string
	repeat   int
	skipFOFS bool
	asJSON   bool
	pt       bool
	ptLower  bool
	inProc   bool
	// worker names the I/O case a child process runs (see fsRunWorker).
	worker, workerDir, workerRead, workerTar string
}

type fsBenchRow struct {
	Name     string  `json:"name"`
	RewindUS float64 `json:"rewind_us"`
	P99US    float64 `json:"p99_us,omitempty"`
	PlainUS  float64 `json:"plain_us,omitempty"`
	FOFSUS   float64 `json:"fuse_overlayfs_us,omitempty"`
	Target   string  `json:"target,omitempty"`
}

func newBenchFSCmd() *cobra.Command {
	var o benchFSOpts
	cmd := &cobra.Command{
		Use:   "fs",
		Short: "DeltaFS: checkpoint/restore latency and I/O vs the plain dir and fuse-overlayfs",
		Long: `Measures, in one run: checkpoint latency (p50/p99, timed inside the server) with 1k, 10k and
100k files in the view; restore latency against the size of the delta (paths changed since the
common ancestor); and I/O rows (sequential write/read, create+write+close of small files,
stat of many files, unpacking a tarball) on the plain backing directory, on rewind's FUSE
overlay and on fuse-overlayfs over the same lower, printed with ratios. Each I/O workload runs
in a child process, as an agent's programs do (--in-process runs them in the bench process,
which also serves rewind's mount); the "new mount" row mounts rewind and fuse-overlayfs anew
for every run.`,
		Example: "  rewind bench fs\n  rewind bench fs --sizes 1000,10000 --io-mib 256 --json\n  rewind bench fs --io-only --io-mib 256 --repeat 5",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return runBenchFS(cmd, o)
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.dir, "dir", "", "scratch directory (default: a temp dir under /var/tmp)")
	f.IntSliceVar(&o.sizes, "sizes", []int{1000, 10000, 100000}, "files in the view for checkpoint latency")
	f.IntSliceVar(&o.deltas, "deltas", []int{10, 100, 1000}, "changed paths for restore latency")
	f.IntVar(&o.rounds, "rounds", 200, "checkpoints/restores measured per size")
	f.IntVar(&o.ioMiB, "io-mib", 1024, "size of the sequential read/write file in MiB")
	f.IntVar(&o.small, "small", 10000, "small files to create")
	f.IntVar(&o.stats, "stats", 100000, "files to stat")
	f.BoolVar(&o.skipIO, "no-io", false, "skip the I/O rows")
	f.BoolVar(&o.ioOnly, "io-only", false, "only the I/O rows (no checkpoint/restore latency)")
	f.IntVar(&o.repeat, "repeat", 1, "runs of each I/O row per target, interleaved; the median is reported")
	f.StringVar(&o.rows, "rows", "", "only the I/O rows whose name matches this regular expression (e.g. 'untar|create')")
	f.BoolVar(&o.skipFOFS, "no-fuse-overlayfs", false, "skip the fuse-overlayfs baseline")
	f.BoolVar(&o.asJSON, "json", false, "print JSON rows")
	f.BoolVar(&o.pt, "passthrough", true, "mount rewind with FUSE passthrough for the I/O rows")
	f.BoolVar(&o.ptLower, "passthrough-lower", false, "with --passthrough, also pass read-only opens of lower and checkpointed files through (fs.Options.PassthroughLower)")
	f.BoolVar(&o.inProc, "in-process", false, "run the I/O workloads inside the bench process, which also serves rewind's mount, instead of in a child process")
	for _, n := range []struct {
		v    *string
		name string
	}{{&o.worker, "worker"}, {&o.workerDir, "worker-dir"}, {&o.workerRead, "worker-read"}, {&o.workerTar, "worker-tarball"}} {
		f.StringVar(n.v, n.name, "", "internal: run one I/O case in this process")
		_ = f.MarkHidden(n.name)
	}
	return cmd
}

func fsPctUS(d []time.Duration, p float64) float64 {
	s := append([]time.Duration(nil), d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	i := int(p*float64(len(s))+0.5) - 1
	return float64(s[max(0, min(i, len(s)-1))].Nanoseconds()) / 1000
}

func fsMakeFiles(dir string, n int) error {
	per := 1000
	for i := 0; i < n; i++ {
		d := filepath.Join(dir, fmt.Sprintf("d%03d", i/per))
		if i%per == 0 {
			if err := os.MkdirAll(d, 0o755); err != nil {
				return err
			}
		}
		if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("f%05d", i)), []byte("x"), 0o644); err != nil {
			return err
		}
	}
	return nil
}

func fsStatAll(dir string) (int, error) {
	n := 0
	err := filepath.WalkDir(dir, func(p string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		var s unix.Stat_t
		n++
		return unix.Lstat(p, &s)
	})
	return n, err
}

type fsBenchEnv struct {
	root string
	st   *layer.Store
}

func (e *fsBenchEnv) mount(name string, lowers []string, pt bool) (*fs.FS, string, error) {
	return e.mountOpts(name, fs.Options{Lowers: lowers, Passthrough: pt})
}

func (e *fsBenchEnv) mountOpts(name string, opts fs.Options) (*fs.FS, string, error) {
	mp := filepath.Join(e.root, "mnt-"+name)
	if err := os.MkdirAll(mp, 0o755); err != nil {
		return nil, "", err
	}
	opts.MountID = name
	f, err := fs.Mount(e.st, mp, opts)
	return f, mp, err
}

func runBenchFS(cmd *cobra.Command, o benchFSOpts) error {
	if o.worker != "" {
		return fsRunWorker(cmd.OutOrStdout(), o)
	}
	if os.Geteuid() != 0 {
		return fmt.Errorf("bench fs: must run as root (FUSE DirectMount)")
	}
	root := o.dir
	if root == "" {
		var err error
		if root, err = os.MkdirTemp("/var/tmp", "rewind-bench-fs-"); err != nil {
			return fmt.Errorf("bench fs: %w", err)
		}
		defer os.RemoveAll(root)
	}
	st, err := layer.OpenStore(filepath.Join(root, "state"))
	if err != nil {
		return fmt.Errorf("bench fs: %w", err)
	}
	env := &fsBenchEnv{root: root, st: st}
	var rows []fsBenchRow
	out := cmd.ErrOrStderr()

	if o.ioOnly {
		o.sizes, o.deltas = nil, nil
	}
	// Checkpoint latency against the number of files in the view.
	for _, n := range o.sizes {
		lower := filepath.Join(root, fmt.Sprintf("lower-%d", n))
		if err := fsMakeFiles(lower, n); err != nil {
			return fmt.Errorf("bench fs: %w", err)
		}
		f, mp, err := env.mount(fmt.Sprintf("ckpt%d", n), []string{lower}, false)
		if err != nil {
			return fmt.Errorf("bench fs: %w", err)
		}
		if _, err := fsStatAll(mp); err != nil {
			f.Unmount()
			return fmt.Errorf("bench fs: %w", err)
		}
		var lat []time.Duration
		for i := 0; i < o.rounds; i++ {
			p := filepath.Join(mp, fmt.Sprintf("d%03d/f%05d", (i%n)/1000, i%n))
			if err := os.WriteFile(p, []byte(fmt.Sprint(i)), 0o644); err != nil {
				f.Unmount()
				return fmt.Errorf("bench fs: %w", err)
			}
			t0 := time.Now()
			if _, err := f.Checkpoint(); err != nil {
				f.Unmount()
				return fmt.Errorf("bench fs: %w", err)
			}
			lat = append(lat, time.Since(t0))
		}
		f.Unmount()
		rows = append(rows, fsBenchRow{Name: fmt.Sprintf("checkpoint, %d files", n), RewindUS: fsPctUS(lat, 0.5), P99US: fsPctUS(lat, 0.99), Target: "p50<=300 p99<=2000"})
		fmt.Fprintf(out, "checkpoint %d files: p50 %.0f µs p99 %.0f µs\n", n, fsPctUS(lat, 0.5), fsPctUS(lat, 0.99))
	}

	// Restore latency against the delta.
	if len(o.deltas) > 0 {
		lower := filepath.Join(root, "lower-restore")
		maxD := 0
		for _, d := range o.deltas {
			maxD = max(maxD, d)
		}
		if err := fsMakeFiles(lower, max(maxD, 1000)); err != nil {
			return fmt.Errorf("bench fs: %w", err)
		}
		for _, d := range o.deltas {
			f, mp, err := env.mount(fmt.Sprintf("restore%d", d), []string{lower}, false)
			if err != nil {
				return fmt.Errorf("bench fs: %w", err)
			}
			if _, err := fsStatAll(mp); err != nil {
				f.Unmount()
				return fmt.Errorf("bench fs: %w", err)
			}
			base, _ := f.Checkpoint()
			for i := 0; i < d; i++ {
				p := filepath.Join(mp, fmt.Sprintf("d%03d/f%05d", i/1000, i))
				if err := os.WriteFile(p, []byte("changed"), 0o644); err != nil {
					f.Unmount()
					return fmt.Errorf("bench fs: %w", err)
				}
			}
			top, _ := f.Checkpoint()
			var lat []time.Duration
			for i := 0; i < o.rounds; i++ {
				target := base
				if i%2 == 1 {
					target = top
				}
				t0 := time.Now()
				if err := f.Switch(target); err != nil {
					f.Unmount()
					return fmt.Errorf("bench fs: %w", err)
				}
				lat = append(lat, time.Since(t0))
				// Touch one changed path so the kernel really re-resolves.
				_, _ = os.Stat(filepath.Join(mp, "d000/f00000"))
			}
			f.Unmount()
			rows = append(rows, fsBenchRow{Name: fmt.Sprintf("restore, %d changed paths", d), RewindUS: fsPctUS(lat, 0.5), P99US: fsPctUS(lat, 0.99), Target: "p50<=2000 at 100"})
			fmt.Fprintf(out, "restore delta %d: p50 %.0f µs p99 %.0f µs\n", d, fsPctUS(lat, 0.5), fsPctUS(lat, 0.99))
		}
	}

	if !o.skipIO {
		ioRows, err := benchIO(env, o, out)
		if err != nil {
			return err
		}
		rows = append(rows, ioRows...)
	}
	if o.asJSON {
		return json.NewEncoder(cmd.OutOrStdout()).Encode(rows)
	}
	tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "ROW\tREWIND\tP99\tPLAIN\tx PLAIN\tFUSE-OVERLAYFS\tx FOFS\tTARGET")
	for _, r := range rows {
		ratio := func(b float64) string {
			if b == 0 {
				return "-"
			}
			return fmt.Sprintf("%.2fx", r.RewindUS/b)
		}
		us := func(v float64) string {
			if v == 0 {
				return "-"
			}
			if v >= 10000 {
				return fmt.Sprintf("%.1f ms", v/1000)
			}
			return fmt.Sprintf("%.0f µs", v)
		}
		fmt.Fprintf(tw, "%s\t%s\t%s\t%s\t%s\t%s\t%s\t%s\n", r.Name, us(r.RewindUS), us(r.P99US), us(r.PlainUS), ratio(r.PlainUS), us(r.FOFSUS), ratio(r.FOFSUS), r.Target)
	}
	return tw.Flush()
}

// fsIOTarget is one place the I/O rows run in.
type fsIOTarget struct {
	name  string
	dir   string
	close func()
}

func benchIO(env *fsBenchEnv, o benchFSOpts, out io.Writer) ([]fsBenchRow, error) {
	lower := filepath.Join(env.root, "io-lower")
	if err := fsMakeFiles(lower, o.stats); err != nil {
		return nil, fmt.Errorf("bench fs: %w", err)
	}
	big := filepath.Join(lower, "big")
	if err := fsWriteRandom(big, int64(o.ioMiB)<<20); err != nil {
		return nil, fmt.Errorf("bench fs: %w", err)
	}
	tarball := filepath.Join(env.root, "src.tar")
	goroot, err := exec.Command("go", "env", "GOROOT").Output()
	if err != nil {
		return nil, fmt.Errorf("bench fs: the untar row needs the Go toolchain's sources: go env GOROOT: %w", err)
	}
	if b, err := exec.Command("tar", "-C", filepath.Join(strings.TrimSpace(string(goroot)), "src"), "-cf", tarball, "net", "crypto").CombinedOutput(); err != nil {
		return nil, fmt.Errorf("bench fs: make tarball: %v: %s", err, b)
	}
	// Plain: a copy-free view of the same files is the lower itself, plus
	// a scratch dir on the same file system for writes.
	plainW := filepath.Join(env.root, "plain-w")
	os.MkdirAll(plainW, 0o755)
	targets := []fsIOTarget{{name: "plain", dir: plainW, close: func() {}}}
	ioOpts := fs.Options{Lowers: []string{lower}, Passthrough: o.pt, PassthroughLower: o.pt && o.ptLower}
	f, mp, err := env.mountOpts("io", ioOpts)
	if err != nil {
		return nil, fmt.Errorf("bench fs: %w", err)
	}
	defer f.Unmount()
	targets = append(targets, fsIOTarget{name: "rewind", dir: mp, close: func() {}})
	var fofsPath string
	if !o.skipFOFS {
		if path, err := exec.LookPath("fuse-overlayfs"); err == nil {
			fofsPath = path
			if fmp, err := fsMountFOFS(path, env.root, "fofs", lower); err != nil {
				fmt.Fprintf(out, "%v\n", err)
			} else {
				defer unix.Unmount(fmp, unix.MNT_DETACH)
				targets = append(targets, fsIOTarget{name: "fofs", dir: fmp})
			}
		} else {
			fmt.Fprintln(out, "fuse-overlayfs not installed: baseline skipped")
		}
	}
	cases := fsIOCases(o, tarball)
	var only *regexp.Regexp
	if o.rows != "" {
		var err error
		if only, err = regexp.Compile(o.rows); err != nil {
			return nil, fmt.Errorf("bench fs: --rows: %w", err)
		}
	}
	var rows []fsBenchRow
	for _, c := range cases {
		if only != nil && !only.MatchString(c.name) {
			continue
		}
		res := map[string][]float64{}
		var reqs map[string]uint64
		// Interleave the targets within each repetition, so that load
		// from elsewhere on the machine hits them alike.
		for rep := 0; rep < max(o.repeat, 1); rep++ {
			if c.redraw {
				// A new page-cache copy of the file for each FUSE target
				// in each repetition, cached in lockstep (see
				// fsIOCase.redraw).
				var paths []string
				for _, tg := range targets {
					if tg.name != "plain" {
						p := filepath.Join(tg.dir, "big")
						if err := fsDropCache(p); err != nil {
							return nil, fmt.Errorf("bench fs: %s on %s: %w", c.name, tg.name, err)
						}
						paths = append(paths, p)
					}
				}
				if err := fsReadLockstep(paths); err != nil {
					return nil, fmt.Errorf("bench fs: %s: %w", c.name, err)
				}
			}
			for _, tg := range fsRotate(targets, rep) {
				readDir := tg.dir
				if tg.name == "plain" {
					readDir = lower
				}
				if c.fresh && tg.name != "plain" {
					_ = fsReadAll(filepath.Join(lower, "big")) // the host's cache is warm, as for plain
					name := fmt.Sprintf("io-fresh%d", rep)
					var fmp string
					var umount func() error
					var ff *fs.FS
					if tg.name == "rewind" {
						var err error
						if ff, fmp, err = env.mountOpts(name, ioOpts); err != nil {
							return nil, fmt.Errorf("bench fs: %w", err)
						}
						umount = ff.Unmount
					} else {
						var err error
						if fmp, err = fsMountFOFS(fofsPath, env.root, name, lower); err != nil {
							return nil, fmt.Errorf("bench fs: %w", err)
						}
						umount = func() error { return unix.Unmount(fmp, 0) }
					}
					var before map[string]uint64
					if ff != nil {
						before = ff.RequestCounts()
					}
					us, err := fsRunCase(o, c, tarball, fmp, fmp)
					res[tg.name] = append(res[tg.name], us)
					if ff != nil && rep == 0 {
						reqs = fsCountsSince(ff.RequestCounts(), before)
					}
					if uerr := umount(); err == nil {
						err = uerr
					}
					if err != nil {
						return nil, fmt.Errorf("bench fs: %s on a new %s mount: %w", c.name, tg.name, err)
					}
					continue
				}
				if strings.HasPrefix(c.name, "stat") {
					_, _ = fsStatAll(readDir) // warm
				}
				if strings.HasPrefix(c.name, "seq read") {
					_ = fsReadAll(filepath.Join(readDir, "big")) // warm page cache
					seqw := filepath.Join(tg.dir, "seqw")
					if _, err := os.Stat(seqw); err != nil {
						// The seq write row did not run (--rows).
						if err := fsWriteRandom(seqw, int64(o.ioMiB)<<20); err != nil {
							return nil, fmt.Errorf("bench fs: %s on %s: %w", c.name, tg.name, err)
						}
					}
					_ = fsReadAll(seqw)
				}
				before := f.RequestCounts()
				us, err := fsRunCase(o, c, tarball, tg.dir, readDir)
				if err != nil {
					return nil, fmt.Errorf("bench fs: %s on %s: %w", c.name, tg.name, err)
				}
				res[tg.name] = append(res[tg.name], us)
				if tg.name == "rewind" && rep == 0 {
					reqs = fsCountsSince(f.RequestCounts(), before)
				}
			}
		}
		r := fsBenchRow{Name: c.name, RewindUS: fsMedian(res["rewind"]), PlainUS: fsMedian(res["plain"]), FOFSUS: fsMedian(res["fofs"]), Target: c.target + " plain, < fuse-overlayfs"}
		fmt.Fprintf(out, "%s: rewind %.1f ms plain %.1f ms fuse-overlayfs %.1f ms (median of %d); rewind's FUSE requests: %s\n",
			c.name, r.RewindUS/1000, r.PlainUS/1000, r.FOFSUS/1000, max(o.repeat, 1), fsFormatCounts(reqs))
		rows = append(rows, r)
	}
	return rows, nil
}

// fsIOCase is one I/O row.
type fsIOCase struct {
	name   string
	target string
	run    func(dir, readDir string) error
	// fresh runs the row on a new mount of the same lower (a fork's cold
	// view), for rewind and fuse-overlayfs alike.
	fresh bool
	// redraw drops the FUSE targets' cached pages of the lower file before
	// each repetition, so that each one's warm-up caches it anew. A warm
	// read of a FUSE file is a copy out of that mount's own page cache
	// (4 KiB folios on this kernel; the plain ext4 file has large ones),
	// whose speed depends on how physically contiguous those pages came
	// out of the allocator: 1.7-2.5x between a scattered and a contiguous
	// copy of the same file. The first target to cache the file in a run
	// takes the scattered free pages, so with one warm-up per run and a
	// fixed order the row measured the target order, not the file system.
	// The targets therefore cache it in lockstep, 1 MiB each in turn, so
	// that they draw from the same free pages.
	redraw bool
}

// fsRotate is targets with the FUSE targets (all but the first, plain)
// rotated by rep, so that each goes first in turn.
func fsRotate(targets []fsIOTarget, rep int) []fsIOTarget {
	if len(targets) < 3 {
		return targets
	}
	out := []fsIOTarget{targets[0]}
	fuse := targets[1:]
	for i := range fuse {
		out = append(out, fuse[(i+rep)%len(fuse)])
	}
	return out
}

// fsReadLockstep reads the files in paths to their ends, 1 MiB of each
// in turn.
func fsReadLockstep(paths []string) error {
	var fhs []*os.File
	defer func() {
		for _, fh := range fhs {
			fh.Close()
		}
	}()
	for _, p := range paths {
		fh, err := os.Open(p)
		if err != nil {
			return err
		}
		fhs = append(fhs, fh)
	}
	buf := make([]byte, 1<<20)
	for open := len(fhs); open > 0; {
		open = 0
		for _, fh := range fhs {
			n, err := fh.Read(buf)
			if err != nil && err != io.EOF {
				return fmt.Errorf("read %s: %w", fh.Name(), err)
			}
			if n > 0 {
				open++
			}
		}
	}
	return nil
}

// fsDropCache drops the cached pages of the file p (clean pages only).
func fsDropCache(p string) error {
	fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("drop cache: %w", err)
	}
	defer unix.Close(fd)
	if err := unix.Fadvise(fd, 0, 0, unix.FADV_DONTNEED); err != nil {
		return fmt.Errorf("drop cache of %s: %w", p, err)
	}
	return nil
}

// fsIOCases lists the I/O rows for the sizes in o; tarball is the
// archive the untar row unpacks.
func fsIOCases(o benchFSOpts, tarball string) []fsIOCase {
	return []fsIOCase{
		{name: fmt.Sprintf("seq write %d MiB", o.ioMiB), target: "<=1.1x", run: func(dir, _ string) error {
			return fsWriteRandom(filepath.Join(dir, "seqw"), int64(o.ioMiB)<<20)
		}},
		{name: fmt.Sprintf("seq read %d MiB (lower file)", o.ioMiB), target: "<=1.1x", redraw: true, run: func(_, rd string) error {
			return fsReadAll(filepath.Join(rd, "big"))
		}},
		{name: fmt.Sprintf("seq read %d MiB (lower file, new mount)", o.ioMiB), target: "<=1.1x", fresh: true, run: func(_, rd string) error {
			return fsReadAll(filepath.Join(rd, "big"))
		}},
		{name: fmt.Sprintf("seq read %d MiB (written in the view)", o.ioMiB), target: "<=1.1x", run: func(dir, _ string) error {
			return fsReadAll(filepath.Join(dir, "seqw"))
		}},
		{name: fmt.Sprintf("create+write+close %d files", o.small), target: "<=1.3x", run: func(dir, _ string) error {
			d, err := os.MkdirTemp(dir, "small-")
			if err != nil {
				return err
			}
			for i := 0; i < o.small; i++ {
				if err := os.WriteFile(filepath.Join(d, fmt.Sprint(i)), []byte("hello"), 0o644); err != nil {
					return err
				}
			}
			return nil
		}},
		{name: fmt.Sprintf("stat %d files (warm)", o.stats), target: "<=1.3x", run: func(_, rd string) error {
			_, err := fsStatAll(rd)
			return err
		}},
		{name: "build a C project (40 files, make -j2)", target: "<=1.3x", run: func(dir, _ string) error {
			d, err := os.MkdirTemp(dir, "build-")
			if err != nil {
				return err
			}
			return fsBuildC(d, 40)
		}},
		{name: "untar Go net+crypto", target: "<=1.3x", run: func(dir, _ string) error {
			d, err := os.MkdirTemp(dir, "untar-")
			if err != nil {
				return err
			}
			b, err := exec.Command("tar", "-C", d, "-xf", tarball).CombinedOutput()
			if err != nil {
				return fmt.Errorf("%v: %s", err, b)
			}
			return nil
		}},
	}
}

// fsRunWorker runs the I/O case o.worker once, in this process, and prints
// its duration in microseconds. The bench runs every workload this way, in
// a child process: an agent's programs never share the daemon's Go
// runtime, while a workload run inside the bench process would share its
// garbage collector (which scans rewind's node tree) and its scheduler
// with the FUSE server, a cost neither the plain directory nor
// fuse-overlayfs pays.
func fsRunWorker(out io.Writer, o benchFSOpts) error {
	for _, c := range fsIOCases(o, o.workerTar) {
		if c.name != o.worker {
			continue
		}
		t0 := time.Now()
		if err := c.run(o.workerDir, o.workerRead); err != nil {
			return fmt.Errorf("bench fs worker: %s: %w", c.name, err)
		}
		fmt.Fprintf(out, "%d\n", time.Since(t0).Microseconds())
		return nil
	}
	return fmt.Errorf("bench fs worker: no I/O case %q", o.worker)
}

// fsRunCase runs c on dir (reading from readDir) and returns its duration
// in microseconds: in a child process (fsRunWorker) unless o.inProc.
func fsRunCase(o benchFSOpts, c fsIOCase, tarball, dir, readDir string) (float64, error) {
	if o.inProc {
		t0 := time.Now()
		err := c.run(dir, readDir)
		return float64(time.Since(t0).Nanoseconds()) / 1000, err
	}
	exe, err := os.Executable()
	if err != nil {
		return 0, err
	}
	args := []string{"bench", "fs", "--worker", c.name, "--worker-dir", dir, "--worker-read", readDir, "--worker-tarball", tarball,
		fmt.Sprintf("--io-mib=%d", o.ioMiB), fmt.Sprintf("--small=%d", o.small), fmt.Sprintf("--stats=%d", o.stats)}
	b, err := exec.Command(exe, args...).Output()
	if err != nil {
		if ee, ok := err.(*exec.ExitError); ok {
			return 0, fmt.Errorf("%w: %s", err, ee.Stderr)
		}
		return 0, err
	}
	var us float64
	if _, err := fmt.Sscan(string(b), &us); err != nil {
		return 0, fmt.Errorf("worker output %q: %w", b, err)
	}
	return us, nil
}

// fsMountFOFS mounts fuse-overlayfs (binary path) over lower with an
// upper and a work directory of its own under root, and returns the
// mountpoint.
func fsMountFOFS(path, root, name, lower string) (string, error) {
	up, wk, mp := filepath.Join(root, name+"-up"), filepath.Join(root, name+"-work"), filepath.Join(root, name+"-mnt")
	for _, d := range []string{up, wk, mp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return "", fmt.Errorf("fuse-overlayfs: %w", err)
		}
	}
	if b, err := exec.Command(path, "-o", "lowerdir="+lower+",upperdir="+up+",workdir="+wk, mp).CombinedOutput(); err != nil {
		return "", fmt.Errorf("fuse-overlayfs: %v: %s", err, b)
	}
	return mp, nil
}

func fsMedian(v []float64) float64 {
	if len(v) == 0 {
		return 0
	}
	s := append([]float64(nil), v...)
	sort.Float64s(s)
	return s[len(s)/2]
}

// fsCountsSince is the per-opcode difference of two RequestCounts snapshots.
func fsCountsSince(now, before map[string]uint64) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range now {
		if v > before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}

// fsFormatCounts prints request counts, most frequent first.
func fsFormatCounts(m map[string]uint64) string {
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Slice(keys, func(i, j int) bool {
		if m[keys[i]] != m[keys[j]] {
			return m[keys[i]] > m[keys[j]]
		}
		return keys[i] < keys[j]
	})
	parts := make([]string, len(keys))
	for i, k := range keys {
		parts[i] = fmt.Sprintf("%s %d", k, m[k])
	}
	if len(parts) == 0 {
		return "none"
	}
	return strings.Join(parts, ", ")
}

func fsWriteRandom(p string, size int64) error {
	fh, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY|os.O_TRUNC, 0o644)
	if err != nil {
		return err
	}
	buf := make([]byte, 1<<20)
	rand.Read(buf)
	for off := int64(0); off < size; off += int64(len(buf)) {
		if _, err := fh.Write(buf[:min(int64(len(buf)), size-off)]); err != nil {
			fh.Close()
			return err
		}
	}
	if err := fh.Sync(); err != nil {
		fh.Close()
		return err
	}
	return fh.Close()
}

func fsReadAll(p string) error {
	fh, err := os.Open(p)
	if err != nil {
		return err
	}
	defer fh.Close()
	buf := make([]byte, 1<<20)
	for {
		_, err := fh.Read(buf)
		if err == io.EOF {
			return nil
		}
		if err != nil {
			return err
		}
	}
}

// fsBuildC writes a C project of n translation units (each including a
// project header and the C library's) with a Makefile into d and builds
// it with make -j2: compiler reads of sources and headers, object files
// written, a link reading them all back, as a build inside a sandbox does.
func fsBuildC(d string, n int) error {
	var hdr, mk strings.Builder
	hdr.WriteString("#ifndef PROJ_H\n#define PROJ_H\n#include <stdio.h>\n#include <stdlib.h>\n#include <string.h>\n")
	mk.WriteString("OBJS =")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&hdr, "long unit%d(long x);\n", i)
		fmt.Fprintf(&mk, " u%d.o", i)
		var c strings.Builder
		c.WriteString("#include \"proj.h\"\n")
		for j := 0; j < 12; j++ {
			fmt.Fprintf(&c, "static long f%d(long x) { char b[64]; long s = 0; for (int k = 0; k < %d; k++) { snprintf(b, sizeof b, \"%%ld\", x + k); s += (long)strlen(b) * (x ^ k); } return s; }\n", j, 10+j)
		}
		fmt.Fprintf(&c, "long unit%d(long x) { return f0(x)", i)
		for j := 1; j < 12; j++ {
			fmt.Fprintf(&c, " + f%d(x)", j)
		}
		c.WriteString("; }\n")
		if err := os.WriteFile(filepath.Join(d, fmt.Sprintf("u%d.c", i)), []byte(c.String()), 0o644); err != nil {
			return err
		}
	}
	hdr.WriteString("#endif\n")
	main := "#include \"proj.h\"\nint main(void) { long s = 0;\n"
	for i := 0; i < n; i++ {
		main += fmt.Sprintf("s += unit%d(%d);\n", i, i)
	}
	main += "printf(\"%ld\\n\", s); return 0; }\n"
	mk.WriteString(" main.o\nprog: $(OBJS)\n\t$(CC) -o $@ $(OBJS)\n%.o: %.c proj.h\n\t$(CC) -O1 -c -o $@ $<\n")
	for name, body := range map[string]string{"proj.h": hdr.String(), "main.c": main, "Makefile": mk.String()} {
		if err := os.WriteFile(filepath.Join(d, name), []byte(body), 0o644); err != nil {
			return err
		}
	}
	cmd := exec.Command("make", "-s", "-j2", "-C", d, "CC=cc", "prog")
	if b, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("make: %v: %s", err, b)
	}
	if b, err := exec.Command(filepath.Join(d, "prog")).CombinedOutput(); err != nil || len(b) == 0 {
		return fmt.Errorf("the built program: %v: %s", err, b)
	}
	return nil
}
