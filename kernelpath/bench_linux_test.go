package kernelpath

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/layer"
)

// Benchmarks (root, loop devices):
//
//	go test -run '^$' -bench . -benchtime 50x ./kernelpath/
//
// (BenchmarkIO and BenchmarkIODepth: -benchtime 7x.)
//
// Each benchmark measures the kernel path and the FUSE backend (package
// fs) on the same store in the same run and reports p50/p99 in µs plus the
// ratio kernel/FUSE.

// view is what the benchmarks need from either backend.
type view interface {
	layer.FS
}

func mountBackend(b *testing.B, st *layer.Store, backend, from string) view {
	b.Helper()
	mp := filepath.Join(filepath.Dir(st.Dir()), "mnt-"+layer.NewID())
	if err := os.Mkdir(mp, 0o755); err != nil {
		b.Fatal(err)
	}
	var v view
	var err error
	id := backend + "-" + layer.NewID()
	switch backend {
	case "kernel":
		v, err = Mount(st, mp, Options{MountID: id, From: from, Logger: slog.New(slog.DiscardHandler)})
	case "kernel-walk": // the kernel path without change tracking: every checkpoint walks the upper
		v, err = Mount(st, mp, Options{MountID: id, From: from, NoTrack: true, Logger: slog.New(slog.DiscardHandler)})
	case "fuse":
		v, err = fs.Mount(st, mp, fs.Options{MountID: id, From: from})
	}
	if err != nil {
		b.Fatalf("mount %s: %v", backend, err)
	}
	b.Cleanup(func() { _ = v.Unmount() })
	return v
}

func benchStore(b *testing.B, kind string) *layer.Store {
	st, err := layer.OpenStore(filepath.Join(loopFSSize(b, kind, 16<<30), "state"))
	if err != nil {
		b.Fatal(err)
	}
	return st
}

// populate writes n small files spread over directories of 100.
func populate(b *testing.B, root, prefix string, n int) {
	b.Helper()
	for i := range n {
		d := filepath.Join(root, fmt.Sprintf("%s%03d", prefix, i/100))
		if i%100 == 0 {
			if err := os.MkdirAll(d, 0o755); err != nil {
				b.Fatal(err)
			}
		}
		if err := os.WriteFile(filepath.Join(d, strconv.Itoa(i)), []byte("content of a small source file\n"), 0o644); err != nil {
			b.Fatal(err)
		}
	}
}

type lat struct{ d []time.Duration }

func (l *lat) add(d time.Duration) { l.d = append(l.d, d) }
func (l *lat) pct(p float64) time.Duration {
	s := append([]time.Duration(nil), l.d...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	if len(s) == 0 {
		return 0
	}
	return s[min(len(s)-1, int(float64(len(s))*p))]
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }

// BenchmarkCheckpoint: a view of `tree` files (frozen in a base
// checkpoint); before each Checkpoint, `delta` files are (re)written; one
// op = one Checkpoint. The kernel path freezes only the entries changed
// since the previous checkpoint, with a full freeze of the live upper every
// 16th time (that shows in p99). Rows: "kernel" is the time Checkpoint
// takes (the sandbox's freeze window: the layer is written after it),
// "kernel-done" the time until that layer and record are written (Flush),
// "kernel-sync" the kernel path writing its layer inside Checkpoint (as
// before the deferred finish), "fuse" the FUSE backend.
func BenchmarkCheckpoint(b *testing.B) {
	for _, kind := range fsKinds {
		for _, tree := range []int{1000, 10000} {
			for _, delta := range []int{10, 100, 1000} {
				b.Run(fmt.Sprintf("%s/tree=%d/delta=%d", kind, tree, delta), func(b *testing.B) {
					st := benchStore(b, kind)
					res := map[string]*lat{}
					for _, backend := range []string{"kernel", "kernel-sync", "fuse"} {
						mb := backend
						if mb == "kernel-sync" {
							mb = "kernel"
						}
						v := mountBackend(b, st, mb, "")
						kv, _ := v.(*FS)
						if backend == "kernel-sync" {
							kv.noDefer = true
						}
						populate(b, v.Mountpoint(), "t", tree)
						base, err := v.Checkpoint()
						if err != nil {
							b.Fatal(err)
						}
						if err := v.Switch(base); err != nil {
							b.Fatal(err)
						}
						l, done := &lat{}, &lat{}
						res[backend] = l
						if backend == "kernel" {
							res["kernel-done"] = done
						}
						b.ResetTimer()
						for range b.N {
							// A fresh delta of `delta` changed files before
							// every checkpoint (not timed).
							b.StopTimer()
							populate(b, v.Mountpoint(), "d", delta)
							b.StartTimer()
							t0 := time.Now()
							if _, err := v.Checkpoint(); err != nil {
								b.Fatal(err)
							}
							l.add(time.Since(t0))
							if kv != nil {
								if err := kv.Flush(); err != nil {
									b.Fatal(err)
								}
								done.add(time.Since(t0))
							}
						}
						b.StopTimer()
					}
					report(b, res)
				})
			}
		}
	}
}

// BenchmarkSwitch: switch back and forth between two checkpoints that
// differ by `delta` files over a tree of 1000; one op = one Switch.
func BenchmarkSwitch(b *testing.B) {
	for _, kind := range fsKinds {
		for _, delta := range []int{10, 100, 1000} {
			b.Run(fmt.Sprintf("%s/delta=%d", kind, delta), func(b *testing.B) {
				st := benchStore(b, kind)
				res := map[string]*lat{}
				for _, backend := range []string{"kernel", "fuse"} {
					v := mountBackend(b, st, backend, "")
					populate(b, v.Mountpoint(), "t", 1000)
					c1, err := v.Checkpoint()
					if err != nil {
						b.Fatal(err)
					}
					populate(b, v.Mountpoint(), "d", delta)
					c2, err := v.Checkpoint()
					if err != nil {
						b.Fatal(err)
					}
					l := &lat{}
					res[backend] = l
					b.ResetTimer()
					for i := range b.N {
						t0 := time.Now()
						if err := v.Switch([]string{c1, c2}[i%2]); err != nil {
							b.Fatal(err)
						}
						l.add(time.Since(t0))
					}
					b.StopTimer()
				}
				report(b, res)
			})
		}
	}
}

func report(b *testing.B, res map[string]*lat) {
	k, f := res["kernel"], res["fuse"]
	b.ReportMetric(us(k.pct(0.5)), "kernel-p50-µs")
	b.ReportMetric(us(k.pct(0.99)), "kernel-p99-µs")
	if f != nil && len(f.d) > 0 {
		b.ReportMetric(us(f.pct(0.5)), "fuse-p50-µs")
		b.ReportMetric(us(f.pct(0.99)), "fuse-p99-µs")
		b.ReportMetric(float64(k.pct(0.5))/float64(f.pct(0.5)), "kernel/fuse-p50")
	}
	if d := res["kernel-done"]; d != nil && len(d.d) > 0 {
		b.ReportMetric(us(d.pct(0.5)), "kernel-done-p50-µs")
	}
	if y := res["kernel-sync"]; y != nil && len(y.d) > 0 {
		b.ReportMetric(us(y.pct(0.5)), "kernel-sync-p50-µs")
		b.ReportMetric(float64(k.pct(0.5))/float64(y.pct(0.5)), "kernel/sync-p50")
	}
	if w := res["kernel-walk"]; w != nil && len(w.d) > 0 {
		b.ReportMetric(us(w.pct(0.5)), "walk-p50-µs")
		b.ReportMetric(us(w.pct(0.99)), "walk-p99-µs")
		b.ReportMetric(float64(w.pct(0.5))/float64(k.pct(0.5)), "walk/tracked-p50")
	}
	b.ReportMetric(0, "ns/op")
}

// BenchmarkIO compares file I/O in a plain directory of the loop XFS
// ("native"), in a kernelpath view (with and without its change tracking)
// and in a FUSE view on the same file system, in one run, and reports ms
// per op and the ratios to native.
// Rows: sequential write and (warm) read of 256 MiB in 1 MiB chunks,
// create+write+close of 5000 1 KiB files, lstat of those 5000 files.
func BenchmarkIO(b *testing.B) {
	rows := []struct {
		name string
		prep func(b *testing.B, dir string)
		run  func(b *testing.B, dir string, i int)
	}{
		{"seqwrite-256M", nil, func(b *testing.B, dir string, i int) { writeBig(b, filepath.Join(dir, "big"+strconv.Itoa(i%2)), 256) }},
		{"seqread-256M", func(b *testing.B, dir string) {
			writeBig(b, filepath.Join(dir, "big"), 256)
			readAll(b, filepath.Join(dir, "big"))
		},
			func(b *testing.B, dir string, _ int) { readAll(b, filepath.Join(dir, "big")) }},
		{"create-5k", nil, func(b *testing.B, dir string, i int) {
			populate(b, filepath.Join(dir, "r"+strconv.Itoa(i)), "s", 5000)
		}},
		{"stat-5k", func(b *testing.B, dir string) { populate(b, filepath.Join(dir, "t"), "s", 5000) },
			func(b *testing.B, dir string, _ int) { statTree(b, filepath.Join(dir, "t")) }},
	}
	for _, row := range rows {
		b.Run("xfs/"+row.name, func(b *testing.B) {
			st := benchStore(b, "xfs")
			dirs := map[string]string{"native": filepath.Join(filepath.Dir(st.Dir()), "native")}
			if err := os.Mkdir(dirs["native"], 0o755); err != nil {
				b.Fatal(err)
			}
			dirs["kernel"] = mountBackend(b, st, "kernel", "").Mountpoint()
			dirs["kernel-walk"] = mountBackend(b, st, "kernel-walk", "").Mountpoint()
			dirs["fuse"] = mountBackend(b, st, "fuse", "").Mountpoint()
			// Interleave the targets so background load and writeback hit
			// them alike; report medians. kernel-walk is the kernel path
			// without change tracking (no fanotify marks on its upper):
			// kernel/kernel-walk is what the tracking costs the I/O.
			targets := []string{"native", "kernel", "kernel-walk", "fuse"}
			lats := map[string]*lat{}
			for _, target := range targets {
				lats[target] = &lat{}
				if row.prep != nil {
					row.prep(b, dirs[target])
				}
			}
			b.ResetTimer()
			for i := range b.N {
				for k := range targets {
					target := targets[(i+k)%len(targets)]
					t0 := time.Now()
					row.run(b, dirs[target], i)
					lats[target].add(time.Since(t0))
				}
			}
			b.StopTimer()
			ms := map[string]float64{}
			for _, target := range targets {
				ms[target] = us(lats[target].pct(0.5)) / 1000
			}
			b.ReportMetric(ms["native"], "native-ms")
			b.ReportMetric(ms["kernel"], "kernel-ms")
			b.ReportMetric(ms["fuse"], "fuse-ms")
			b.ReportMetric(ms["kernel"]/ms["native"], "kernel/native")
			b.ReportMetric(ms["fuse"]/ms["native"], "fuse/native")
			b.ReportMetric(ms["kernel"]/ms["kernel-walk"], "kernel/kernel-walk")
			b.ReportMetric(0, "ns/op")
		})
	}
}

func writeBig(b *testing.B, p string, mib int) {
	fh, err := os.Create(p)
	if err != nil {
		b.Fatal(err)
	}
	buf := make([]byte, 1<<20)
	for i := range buf {
		buf[i] = byte(i)
	}
	for range mib {
		if _, err := fh.Write(buf); err != nil {
			b.Fatal(err)
		}
	}
	if err := fh.Close(); err != nil {
		b.Fatal(err)
	}
}

func readAll(b *testing.B, p string) {
	fh, err := os.Open(p)
	if err != nil {
		b.Fatal(err)
	}
	defer fh.Close()
	buf := make([]byte, 1<<20)
	for {
		n, err := fh.Read(buf)
		if n == 0 || err != nil {
			return
		}
	}
}

func statTree(b *testing.B, root string) {
	ents, err := os.ReadDir(root)
	if err != nil {
		b.Fatal(err)
	}
	for _, d := range ents {
		sub := filepath.Join(root, d.Name())
		files, err := os.ReadDir(sub)
		if err != nil {
			b.Fatal(err)
		}
		for _, f := range files {
			var st unix.Stat_t
			if err := unix.Lstat(filepath.Join(sub, f.Name()), &st); err != nil {
				b.Fatal(err)
			}
		}
	}
}

// BenchmarkCheckpointBigUpper: 10000 files written since the view was
// mounted (all in the live upper, as after a package install), then
// `delta` files rewritten before each Checkpoint. Three views on one store
// in one run: the kernel path with its change tracking (fanotify: only the
// entries named by events are visited), the kernel path without it
// ("kernel-walk": every checkpoint stats the whole live upper, the cost
// before tracking) and the FUSE backend; walk/tracked-p50 is the ratio.
func BenchmarkCheckpointBigUpper(b *testing.B) {
	for _, delta := range []int{10, 100} {
		b.Run(fmt.Sprintf("xfs/upper=10000/delta=%d", delta), func(b *testing.B) {
			st := benchStore(b, "xfs")
			res := map[string]*lat{}
			backends := []string{"kernel", "kernel-walk", "fuse"}
			views := map[string]view{}
			for _, backend := range backends {
				v := mountBackend(b, st, backend, "")
				populate(b, v.Mountpoint(), "u", 10000)
				if _, err := v.Checkpoint(); err != nil {
					b.Fatal(err)
				}
				views[backend], res[backend] = v, &lat{}
			}
			b.ResetTimer()
			for i := range b.N {
				// Interleaved, so that load from other suites hits all three
				// alike.
				for k := range backends {
					backend := backends[(i+k)%len(backends)]
					v := views[backend]
					b.StopTimer()
					populate(b, v.Mountpoint(), "d", delta)
					b.StartTimer()
					t0 := time.Now()
					if _, err := v.Checkpoint(); err != nil {
						b.Fatal(err)
					}
					res[backend].add(time.Since(t0))
				}
			}
			b.StopTimer()
			if kv, ok := views["kernel"].(*FS); ok && !strings.HasPrefix(kv.lastFreeze, "tracked") {
				b.Fatalf("the tracked view's last checkpoint was not tracked: %s", kv.lastFreeze)
			}
			report(b, res)
		})
	}
}

// BenchmarkIODepth: creates of 5000 1 KiB files into 50 directories that
// exist in the frozen layers (an agent writing into its project tree), on a
// view whose stack is 1 or 16 frozen layers deep (each holding the
// directories), against the same directories on the plain file system. A
// new name in a merged directory is looked up in every lower layer, so the
// cost grows with the depth; Compact (and the delta chain's merge at 16)
// bounds it.
func BenchmarkIODepth(b *testing.B) {
	st := benchStore(b, "xfs")
	dirs := func(root, tag string) {
		for d := range 50 {
			p := filepath.Join(root, fmt.Sprintf("s%03d", d))
			if err := os.MkdirAll(p, 0o755); err != nil {
				b.Fatal(err)
			}
			if err := os.WriteFile(filepath.Join(p, tag), []byte("x\n"), 0o644); err != nil {
				b.Fatal(err)
			}
		}
	}
	native := filepath.Join(filepath.Dir(st.Dir()), "native")
	dirs(native, "base")
	roots := map[string]string{"native": native}
	for _, depth := range []int{1, 16} {
		v := mountBackend(b, st, "kernel", "")
		var last string
		for l := range depth {
			dirs(v.Mountpoint(), "layer"+strconv.Itoa(l))
			id, err := v.Checkpoint()
			if err != nil {
				b.Fatal(err)
			}
			last = id
		}
		w := mountBackend(b, st, "kernel", last)
		if d := w.(*FS).Depth(); d != depth {
			b.Fatalf("view of depth %d has %d layers", depth, d)
		}
		roots["layers="+strconv.Itoa(depth)] = w.Mountpoint()
	}
	targets := []string{"native", "layers=1", "layers=16"}
	lats := map[string]*lat{}
	for _, t := range targets {
		lats[t] = &lat{}
	}
	b.ResetTimer()
	for i := range b.N {
		for k := range targets {
			target := targets[(i+k)%len(targets)]
			t0 := time.Now()
			for n := range 5000 {
				p := filepath.Join(roots[target], fmt.Sprintf("s%03d", n/100), "n"+strconv.Itoa(i)+"-"+strconv.Itoa(n))
				if err := os.WriteFile(p, []byte("content of a small source file\n"), 0o644); err != nil {
					b.Fatal(err)
				}
			}
			lats[target].add(time.Since(t0))
		}
	}
	b.StopTimer()
	nat := us(lats["native"].pct(0.5)) / 1000
	b.ReportMetric(nat, "native-ms")
	for _, t := range targets[1:] {
		ms := us(lats[t].pct(0.5)) / 1000
		b.ReportMetric(ms, t+"-ms")
		b.ReportMetric(ms/nat, t+"/native")
	}
	b.ReportMetric(0, "ns/op")
}

// BenchmarkEffectsBigUpper: like BenchmarkCheckpointBigUpper, but one op
// is the per-turn effect report (TakeFSEffects) after `delta` rewritten
// files: the kernel path with its change tracker, without it (a walk of
// the live upper) and FUSE, interleaved in one run.
func BenchmarkEffectsBigUpper(b *testing.B) {
	b.Run("xfs/upper=10000/delta=100", func(b *testing.B) {
		st := benchStore(b, "xfs")
		res := map[string]*lat{}
		backends := []string{"kernel", "kernel-walk", "fuse"}
		views := map[string]view{}
		for _, backend := range backends {
			v := mountBackend(b, st, backend, "")
			populate(b, v.Mountpoint(), "u", 10000)
			if _, err := v.Checkpoint(); err != nil {
				b.Fatal(err)
			}
			v.TakeFSEffects()
			views[backend], res[backend] = v, &lat{}
		}
		b.ResetTimer()
		for i := range b.N {
			for k := range backends {
				backend := backends[(i+k)%len(backends)]
				v := views[backend]
				b.StopTimer()
				populate(b, v.Mountpoint(), "d", 100)
				b.StartTimer()
				t0 := time.Now()
				v.TakeFSEffects()
				res[backend].add(time.Since(t0))
			}
		}
		b.StopTimer()
		if kv, ok := views["kernel"].(*FS); ok && kv.lastEffects != "tracked" {
			b.Fatalf("the tracked view's last effect report was not tracked: %s", kv.lastEffects)
		}
		report(b, res)
	})
}
