package fs

import (
	"fmt"
	"os"
	"os/exec"
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

// BenchmarkFirstCommand measures what a fork child's first command costs
// on its fresh mount: a view over the host root, warmed up as a prepared
// fork child is (the shell and env, twice), then
// sh -c 'cat /etc/hostname; ls /usr/bin' chrooted into it, with and
// without Options.NoOpen. It reports the FUSE requests of the command
// and the CPU time it took (the command's and this process's, which
// serves the mount).
func BenchmarkFirstCommand(b *testing.B) {
	for _, noOpen := range []bool{false, true} {
		b.Run(fmt.Sprintf("noopen=%v", noOpen), func(b *testing.B) {
			var reqs, opens uint64
			var cpu time.Duration
			var last map[string]uint64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				b.StopTimer()
				fx := mountT(b, nil, Options{Lowers: []string{"/"}, NoOpen: noOpen})
				for range 2 {
					chrootRun(b, fx.mp, "env >/dev/null")
				}
				before := fx.fs.RequestCounts()
				cpu0 := cpuTime(b)
				b.StartTimer()
				chrootRun(b, fx.mp, "cat /etc/hostname >/dev/null; ls /usr/bin >/dev/null")
				b.StopTimer()
				cpu += cpuTime(b) - cpu0
				last = countsSince(fx, before)
				for op, v := range fx.fs.RequestCounts() {
					reqs += v - before[op]
					if op == "OPEN" || op == "RELEASE" || op == "FLUSH" {
						opens += v - before[op]
					}
				}
				if err := fx.fs.Unmount(); err != nil {
					b.Fatal(err)
				}
				b.StartTimer()
			}
			if os.Getenv("FS_BENCH_VERBOSE") != "" {
				b.Logf("last command's requests: %v", last)
			}
			b.ReportMetric(float64(reqs)/float64(b.N), "requests/op")
			b.ReportMetric(float64(opens)/float64(b.N), "open+release+flush/op")
			b.ReportMetric(float64(cpu.Microseconds())/float64(b.N), "cpu-µs/op")
		})
	}
}

// chrootRun runs script with /bin/sh chrooted into root, through
// chroot(8): this process serves the mount, and Go holds its fork lock
// until a child it started has exec'd, so it must not exec from the
// mount itself.
func chrootRun(b *testing.B, root, script string) {
	cmd := exec.Command("chroot", root, "/bin/sh", "-c", script)
	if out, err := cmd.CombinedOutput(); err != nil {
		b.Fatalf("%s: %v: %s", script, err, out)
	}
}

// cpuTime is the CPU time of this process and its waited-for children.
func cpuTime(b *testing.B) time.Duration {
	var self, kids unix.Rusage
	if err := unix.Getrusage(unix.RUSAGE_SELF, &self); err != nil {
		b.Fatal(err)
	}
	if err := unix.Getrusage(unix.RUSAGE_CHILDREN, &kids); err != nil {
		b.Fatal(err)
	}
	tv := func(t unix.Timeval) time.Duration { return time.Duration(t.Nano()) }
	return tv(self.Utime) + tv(self.Stime) + tv(kids.Utime) + tv(kids.Stime)
}
