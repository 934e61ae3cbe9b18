package fs

import (
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// BenchmarkCheckpoint measures Checkpoint() (inside the server) with 1k,
// 10k and 100k files in the view, one changed file per checkpoint, and
// reports p50/p99 next to the plain baseline of renaming a file (the
// cheapest durable metadata operation on the same file system).
func BenchmarkCheckpoint(b *testing.B) {
	for _, n := range []int{1000, 10000, 100000} {
		b.Run(fmt.Sprintf("files=%d", n), func(b *testing.B) {
			fx := mountT(b, func(l string) {
				for i := 0; i < n; i++ {
					d := filepath.Join(l, fmt.Sprintf("d%03d", i/1000))
					if i%1000 == 0 {
						os.MkdirAll(d, 0o755)
					}
					os.WriteFile(filepath.Join(d, fmt.Sprint(i)), []byte("x"), 0o644)
				}
			}, Options{})
			filepath.WalkDir(fx.mp, func(string, os.DirEntry, error) error { return nil })
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				os.WriteFile(fx.p(fmt.Sprintf("d%03d/%d", (i%n)/1000, i%n)), []byte("y"), 0o644)
				b.StartTimer()
				t0 := time.Now()
				if _, err := fx.fs.Checkpoint(); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
		})
	}
}

// BenchmarkSwitch measures Switch() between two checkpoints differing in
// 10, 100 and 1000 paths.
func BenchmarkSwitch(b *testing.B) {
	for _, d := range []int{10, 100, 1000} {
		b.Run(fmt.Sprintf("delta=%d", d), func(b *testing.B) {
			fx := mountT(b, func(l string) {
				for i := 0; i < 1000; i++ {
					os.WriteFile(filepath.Join(l, fmt.Sprint(i)), []byte("x"), 0o644)
				}
			}, Options{})
			filepath.WalkDir(fx.mp, func(string, os.DirEntry, error) error { return nil })
			base := fx.checkpoint(b)
			for i := 0; i < d; i++ {
				os.WriteFile(fx.p(fmt.Sprint(i)), []byte("changed"), 0o644)
			}
			top := fx.checkpoint(b)
			lat := make([]time.Duration, 0, b.N)
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				id := base
				if i%2 == 1 {
					id = top
				}
				t0 := time.Now()
				if err := fx.fs.Switch(id); err != nil {
					b.Fatal(err)
				}
				lat = append(lat, time.Since(t0))
			}
			b.StopTimer()
			sort.Slice(lat, func(i, j int) bool { return lat[i] < lat[j] })
			b.ReportMetric(float64(lat[len(lat)/2].Microseconds()), "p50-µs")
			b.ReportMetric(float64(lat[len(lat)*99/100].Microseconds()), "p99-µs")
		})
	}
}

// BenchmarkLookupDeepStack measures a cold lookup (a new name each time,
// so the kernel cannot answer from its cache) in a directory present in
// every layer of a stack 1, 100 and 300 layers deep, right after a
// checkpoint (every node re-resolves).
func BenchmarkLookupDeepStack(b *testing.B) {
	for _, depth := range []int{1, 100, 300} {
		b.Run(fmt.Sprintf("layers=%d", depth), func(b *testing.B) {
			fx := mountT(b, func(l string) { os.MkdirAll(l+"/d", 0o755) }, Options{})
			for i := 0; i < depth; i++ {
				os.WriteFile(fx.p(fmt.Sprintf("d/f%d", i)), []byte("x"), 0o644)
				fx.checkpoint(b)
			}
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if i%100 == 0 {
					b.StopTimer()
					os.WriteFile(fx.p("d/touch"), []byte("x"), 0o644)
					fx.checkpoint(b)
					b.StartTimer()
				}
				var st unix.Stat_t
				unix.Lstat(fx.p(fmt.Sprintf("d/f%d", i%depth)), &st)
				unix.Lstat(fx.p(fmt.Sprintf("d/missing%d", i)), &st)
			}
		})
	}
}
