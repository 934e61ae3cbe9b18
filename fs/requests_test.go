package fs

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// countsSince returns the requests served since before, by opcode.
func countsSince(fx *fixture, before map[string]uint64) map[string]uint64 {
	d := map[string]uint64{}
	for k, v := range fx.fs.RequestCounts() {
		if v > before[k] {
			d[k] = v - before[k]
		}
	}
	return d
}

// TestRoundTrips checks that common operations cost no avoidable FUSE
// round trips, and still do what they should.
func TestRoundTrips(t *testing.T) {
	cases := []struct {
		name  string
		setup func(t *testing.T, fx *fixture)
		run   func(t *testing.T, fx *fixture)
		check func(t *testing.T, fx *fixture)
		max   map[string]uint64 // opcode -> most requests allowed during run
	}{{
		name: "close sends no FLUSH",
		run: func(t *testing.T, fx *fixture) {
			for i := 0; i < 20; i++ {
				mustWrite(t, fx.p(fmt.Sprintf("f%d", i)), fmt.Sprint("content ", i))
			}
			fh, err := os.OpenFile(fx.p("lower.txt"), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			if _, err := fh.WriteString(" appended"); err != nil {
				t.Fatal(err)
			}
			if err := fh.Close(); err != nil {
				t.Fatal(err)
			}
		},
		check: func(t *testing.T, fx *fixture) {
			for i := 0; i < 20; i++ {
				if got := mustRead(t, fx.p(fmt.Sprintf("f%d", i))); got != fmt.Sprint("content ", i) {
					t.Errorf("f%d: %q", i, got)
				}
			}
			if got := mustRead(t, fx.p("lower.txt")); got != "base appended" {
				t.Errorf("lower.txt: %q", got)
			}
		},
		max: map[string]uint64{"FLUSH": 0},
	}, {
		name: "writes are counted",
		run: func(t *testing.T, fx *fixture) {
			fh, err := os.OpenFile(fx.p("lower.txt"), os.O_WRONLY|os.O_APPEND, 0)
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			for i := 0; i < 3; i++ {
				if _, err := fh.WriteString("+"); err != nil {
					t.Fatal(err)
				}
			}
		},
		check: func(t *testing.T, fx *fixture) {
			if got := mustRead(t, fx.p("lower.txt")); got != "base+++" {
				t.Errorf("lower.txt: %q", got)
			}
			// Without passthrough the three writes reach the daemon and
			// are counted; with it the kernel writes the upper copy.
			got := fx.fs.RequestCounts()["WRITE"]
			if !fx.fs.opts.Passthrough && got < 3 {
				t.Errorf("WRITE requests: %d, want >= 3", got)
			}
			if fx.fs.opts.Passthrough && got != 0 {
				t.Errorf("WRITE requests with passthrough: %d, want 0", got)
			}
		},
	}, {
		name: "repeated writes ask for security.capability once",
		run: func(t *testing.T, fx *fixture) {
			fh, err := os.Create(fx.p("log"))
			if err != nil {
				t.Fatal(err)
			}
			defer fh.Close()
			for i := 0; i < 20; i++ {
				if _, err := fh.WriteString("line\n"); err != nil {
					t.Fatal(err)
				}
			}
		},
		check: func(t *testing.T, fx *fixture) {
			if got := mustRead(t, fx.p("log")); got != strings.Repeat("line\n", 20) {
				t.Errorf("log: %q", got)
			}
		},
		max: map[string]uint64{"GETXATTR": 1},
	}, {
		name: "chown asks for no attributes",
		setup: func(t *testing.T, fx *fixture) {
			mustWrite(t, fx.p("o"), "x")
			var st unix.Stat_t
			if err := unix.Lstat(fx.p("o"), &st); err != nil {
				t.Fatal(err)
			}
		},
		run: func(t *testing.T, fx *fixture) {
			if err := os.Chown(fx.p("o"), 1000, 1000); err != nil {
				t.Fatal(err)
			}
		},
		check: func(t *testing.T, fx *fixture) {
			var st unix.Stat_t
			if err := unix.Lstat(fx.fs.upperNow().path+"/o", &st); err != nil {
				t.Fatal(err)
			}
			if st.Uid != 1000 || st.Gid != 1000 {
				t.Errorf("upper copy owned by %d:%d", st.Uid, st.Gid)
			}
		},
		max: map[string]uint64{"GETATTR": 0},
	}, {
		name: "chmod and utimens replies are cached",
		setup: func(t *testing.T, fx *fixture) {
			mustWrite(t, fx.p("m"), "x")
			var st unix.Stat_t
			if err := unix.Lstat(fx.p("m"), &st); err != nil {
				t.Fatal(err)
			}
		},
		run: func(t *testing.T, fx *fixture) {
			if err := os.Chmod(fx.p("m"), 0o751); err != nil {
				t.Fatal(err)
			}
			mt := time.Unix(1700000000, 0)
			if err := os.Chtimes(fx.p("m"), mt, mt); err != nil {
				t.Fatal(err)
			}
			var st unix.Stat_t
			if err := unix.Lstat(fx.p("m"), &st); err != nil {
				t.Fatal(err)
			}
		},
		check: func(t *testing.T, fx *fixture) {
			var st unix.Stat_t
			if err := unix.Lstat(fx.p("m"), &st); err != nil {
				t.Fatal(err)
			}
			if st.Mode&07777 != 0o751 || st.Mtim.Sec != 1700000000 {
				t.Errorf("mode %o mtime %d, want 751 1700000000", st.Mode&07777, st.Mtim.Sec)
			}
			// The host copy agrees (not only the kernel's cache).
			var hs unix.Stat_t
			if err := unix.Lstat(fx.fs.upperNow().path+"/m", &hs); err != nil {
				t.Fatal(err)
			}
			if hs.Mode&07777 != 0o751 || hs.Mtim.Sec != 1700000000 {
				t.Errorf("upper copy: mode %o mtime %d", hs.Mode&07777, hs.Mtim.Sec)
			}
		},
		max: map[string]uint64{"GETATTR": 0, "SETATTR": 2},
	}}
	for _, pt := range []bool{false, true} {
		for _, c := range cases {
			t.Run(fmt.Sprintf("%s/passthrough=%v", c.name, pt), func(t *testing.T) {
				fx := mountT(t, func(l string) {
					if err := os.WriteFile(l+"/lower.txt", []byte("base"), 0o644); err != nil {
						t.Fatal(err)
					}
				}, Options{Passthrough: pt})
				if c.setup != nil {
					c.setup(t, fx)
				}
				before := fx.fs.RequestCounts()
				c.run(t, fx)
				got := countsSince(fx, before)
				for op, most := range c.max {
					if got[op] > most {
						t.Errorf("%s requests: %d, want at most %d (all: %v)", op, got[op], most, got)
					}
				}
				if len(got) == 0 {
					t.Errorf("no requests counted at all")
				}
				c.check(t, fx)
			})
		}
	}
}
