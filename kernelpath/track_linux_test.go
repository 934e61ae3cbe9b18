package kernelpath

import (
	"flag"
	"fmt"
	"math/rand/v2"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

var (
	trackRounds    = flag.Int("kp.track-rounds", 150, "checkpoints per run of the tracked-delta test")
	trackSeed      = flag.Uint64("kp.track-seed", 1, "seed of the tracked-delta test")
	trackNoEffects = flag.Bool("kp.track-no-effects", false, "skip the effect reports in the tracked-delta test")
)

// TestTrackedDeltaMatchesWalk applies random operation sequences to a view
// (renames of files and directories, hard links, chmod and utimes only,
// truncates, unlink and recreate, writes through shared mappings kept open
// across checkpoints, nested new directories, whiteouts over a base) and
// before every checkpoint writes the delta the full walk would write
// against the same previous checkpoint into a scratch layer. The
// checkpoint's own delta (from the tracker's events) must be identical to
// it, entry for entry (types, modes, owners, sizes, contents, link counts,
// targets, user xattrs, overlay flags), and so must the fingerprint and its
// index. Before most checkpoints the effect report (TakeFSEffects) is
// compared with the walk's the same way. Rounds without directory renames
// or hard links must not have needed the walk (but for a directory whose
// inode number a removed one had: the walk's index is by inode, so that
// looks like a move, and the tracker walks rather than disagree; and a
// file the tracker takes for a hard link, which it cannot always tell from
// a copy-up: it walks then).
func TestTrackedDeltaMatchesWalk(t *testing.T) {
	cases := []struct {
		name, fs string
		lower    bool
	}{
		{"xfs", "xfs", false},
		{"btrfs", "btrfs", false},
		{"xfs-lower", "xfs", true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			st := newStore(t, tc.fs)
			var lowers []string
			if tc.lower {
				base := filepath.Join(filepath.Dir(st.Dir()), "base")
				makeBase(t, base, *trackSeed)
				lowers = []string{base}
			}
			f := mountKP(t, st, Options{MountID: "track", Lowers: lowers})
			if f.track == nil {
				t.Fatal("no change tracker on this mount")
			}
			r := &trackRun{t: t, f: f, st: st, rng: rand.New(rand.NewPCG(*trackSeed, 0x7ac)), maps: map[string][]byte{}}
			defer r.unmapAll()
			for _, d := range []string{"a", "b", "a/c", "b/d"} {
				r.op("mkdir", func() error { return os.MkdirAll(r.p(d), 0o755) })
				for i := range 5 {
					r.op("write", func() error { return os.WriteFile(r.p(d+"/f"+fmt.Sprint(i)), []byte("seed "+d), 0o644) })
				}
			}
			if _, err := f.Checkpoint(); err != nil {
				t.Fatal(err)
			}
			tracked, walked := 0, map[string]int{}
			for round := range *trackRounds {
				r.dirRenamed, r.linked = false, false
				if round%40 == 39 {
					r.switchBack()
				}
				for range 1 + r.rng.IntN(10) {
					r.step()
				}
				how := r.checkpoint(round)
				if how == "tracked" {
					tracked++
				} else {
					walked[how]++
				}
			}
			t.Logf("%d checkpoints tracked, walked: %v", tracked, walked)
			if tracked < *trackRounds/2 {
				t.Errorf("only %d of %d checkpoints tracked", tracked, *trackRounds)
			}
		})
	}
}

type trackRun struct {
	t          *testing.T
	f          *FS
	st         *layer.Store
	rng        *rand.Rand
	maps       map[string][]byte // path -> a shared writable mapping kept
	dirRenamed bool
	linked     bool
	faulty     bool // a fault was injected: a walk is expected
	everLinked bool // a hard link was made: events for its file walk from then on
	// What happened since the last effect report.
	takeRenamed, takeLinked bool
	n                       int
	ids                     []string
}

func (r *trackRun) p(rel string) string { return filepath.Join(r.f.Mountpoint(), rel) }

func (r *trackRun) op(desc string, fn func() error) {
	err := fn() // errors (ENOENT, ENOTEMPTY, ...) are part of the game
	if os.Getenv("KP_TRACE") != "" {
		r.t.Logf("%s: %v", desc, err)
	}
}

var trackDirs = []string{"", "a", "b", "a/c", "b/d", "n", "n/m"}
var trackNames = []string{"f0", "f1", "f2", "f3", "a", "b", "c", "n", "x"}

func (r *trackRun) path() string {
	d, n := trackDirs[r.rng.IntN(len(trackDirs))], trackNames[r.rng.IntN(len(trackNames))]
	if d == "" {
		return n
	}
	return d + "/" + n
}

func (r *trackRun) step() {
	p, q := r.path(), r.path()
	data := []byte(strings.Repeat(string(rune('a'+r.rng.IntN(26))), r.rng.IntN(20000)))
	switch k := r.rng.IntN(100); {
	case k < 15:
		r.op("write "+p, func() error { return os.WriteFile(r.p(p), data, 0o644) })
	case k < 20:
		r.op("append "+p, func() error {
			fh, err := os.OpenFile(r.p(p), os.O_WRONLY|os.O_APPEND|unix.O_NONBLOCK, 0)
			if err != nil {
				return err
			}
			_, err = fh.Write(data[:min(len(data), 50)])
			fh.Close()
			return err
		})
	case k < 25:
		r.op("truncate "+p, func() error { return unix.Truncate(r.p(p), int64(r.rng.IntN(9000))) })
	case k < 30:
		m := []uint32{0o644, 0o600, 0o755, 0o700}[r.rng.IntN(4)]
		r.op("chmod", func() error { return unix.Fchmodat(unix.AT_FDCWD, r.p(p), m, 0) })
	case k < 35:
		ts := time.Unix(int64(1e9+r.rng.IntN(1e6)), 0)
		r.op("utimes", func() error { return os.Chtimes(r.p(p), ts, ts) })
	case k < 38:
		r.op("setxattr", func() error { return unix.Lsetxattr(r.p(p), "user.k", []byte(fmt.Sprint(r.rng.IntN(99))), 0) })
	case k < 45:
		r.op("mkdir", func() error { return unix.Mkdir(r.p(p), 0o755) })
	case k < 48:
		// A nested new tree in one go (its inner directories are
		// created before the tracker can watch them).
		r.op("mkdir -p", func() error {
			if err := os.MkdirAll(r.p(p+"/x/y"), 0o755); err != nil {
				return err
			}
			return os.WriteFile(r.p(p+"/x/y/f0"), data, 0o644)
		})
	case k < 55:
		r.op("unlink", func() error { return unix.Unlink(r.p(p)) })
	case k < 58:
		r.op("rmdir", func() error { return unix.Rmdir(r.p(p)) })
	case k < 60:
		r.op("rm -rf", func() error { return os.RemoveAll(r.p(p)) })
	case k < 70:
		var s unix.Stat_t
		isDir := unix.Lstat(r.p(p), &s) == nil && s.Mode&unix.S_IFMT == unix.S_IFDIR
		if unix.Rename(r.p(p), r.p(q)) == nil && isDir {
			r.dirRenamed, r.takeRenamed = true, true
		}
	case k < 74:
		if unix.Link(r.p(p), r.p(q)) == nil {
			r.linked, r.takeLinked, r.everLinked = true, true, true
		}
	case k < 77:
		r.op("link+unlink", func() error {
			// Both in directories the last checkpoint saw (watched).
			dir := trackDirs[r.rng.IntN(5)]
			if err := unix.Link(r.p(p), r.p(filepath.Join(dir, "tmp-link"))); err != nil {
				return err
			}
			r.linked, r.takeLinked, r.everLinked = true, true, true
			return unix.Unlink(r.p(filepath.Join(dir, "tmp-link")))
		})
	case k < 82:
		r.op("unlink+recreate "+p, func() error {
			if err := unix.Unlink(r.p(p)); err != nil {
				return err
			}
			return os.WriteFile(r.p(p), data, 0o600)
		})
	case k < 85:
		r.op("symlink", func() error { return unix.Symlink("../"+q, r.p(p)) })
	case k < 90:
		r.op("rename-over "+p, func() error {
			if err := os.WriteFile(r.p(p+".tmp"), data, 0o644); err != nil {
				return err
			}
			return unix.Rename(r.p(p+".tmp"), r.p(p))
		})
	case k < 95:
		r.mmapWrite(p)
	default:
		if len(r.maps) > 0 && r.rng.IntN(2) == 0 {
			r.unmapAll()
		}
	}
}

// mmapWrite stores a byte through a shared writable mapping of p, made
// now (and kept across checkpoints, its fd closed) or kept from before.
func (r *trackRun) mmapWrite(p string) {
	for _, m := range r.maps {
		m[r.rng.IntN(len(m))] = byte('A' + r.rng.IntN(26))
		return
	}
	fh, err := os.OpenFile(r.p(p), os.O_RDWR, 0)
	if err != nil {
		return
	}
	defer fh.Close()
	var s unix.Stat_t
	if unix.Fstat(int(fh.Fd()), &s) != nil || s.Mode&unix.S_IFMT != unix.S_IFREG || s.Size == 0 || s.Nlink != 1 {
		return
	}
	m, err := unix.Mmap(int(fh.Fd()), 0, int(min(s.Size, 4096)), unix.PROT_READ|unix.PROT_WRITE, unix.MAP_SHARED)
	if err != nil {
		r.t.Fatalf("mmap %s: %v", p, err)
	}
	m[0] = 'M'
	r.maps[p] = m
}

func (r *trackRun) unmapAll() {
	for p, m := range r.maps {
		_ = unix.Munmap(m)
		delete(r.maps, p)
	}
}

func (r *trackRun) switchBack() {
	if len(r.ids) == 0 {
		return
	}
	r.unmapAll()
	if err := r.f.Switch(r.ids[r.rng.IntN(len(r.ids))]); err != nil {
		r.t.Fatalf("switch: %v", err)
	}
	if _, err := r.f.Checkpoint(); err != nil { // a full freeze of the new upper
		r.t.Fatal(err)
	}
}

// checkpoint writes the walk's delta, checkpoints and compares.
func (r *trackRun) checkpoint(round int) string {
	t, f := r.t, r.f
	r.n++
	scratch := filepath.Join(filepath.Dir(r.st.Dir()), fmt.Sprintf("walk-%d", r.n))
	if err := os.Mkdir(scratch, 0o755); err != nil {
		t.Fatal(err)
	}
	defer os.RemoveAll(scratch)
	if err := f.Flush(); err != nil {
		t.Fatal(err)
	}
	prevMulti := anyMultiLink(f.ckpt.fp) || f.taken != nil && anyMultiLink(f.taken.fp)
	if r.rng.IntN(3) != 0 && !*trackNoEffects {
		r.effects(round, prevMulti)
	}
	wfp, _, err := freezeDelta(f.Upper(), scratch, f.ckpt, f.freeze == FreezeReflink, f.fstype, nil, nil, nil)
	if err != nil {
		t.Fatalf("round %d: walk: %v", round, err)
	}
	id, err := f.Checkpoint()
	if err != nil {
		t.Fatalf("round %d: checkpoint: %v", round, err)
	}
	if err := f.Flush(); err != nil {
		t.Fatalf("round %d: checkpoint's layer: %v", round, err)
	}
	r.ids = append(r.ids, id)
	rec, err := r.st.Checkpoint(id)
	if err != nil {
		t.Fatal(err)
	}
	got, want := layerDump(t, r.st.LayerPath(rec.Layers[len(rec.Layers)-1])), layerDump(t, scratch)
	// A full freeze (the 16th delta of a chain whose merge was skipped)
	// is no delta: only the fingerprints compare.
	if f.lastFreeze != "full" && got != want {
		t.Fatalf("round %d (%s): tracked delta differs from the walk's\n--- tracked\n%s\n--- walk\n%s", round, f.lastFreeze, got, want)
	}
	if g, w := normFP(f.ckpt.fp), normFP(wfp); !reflect.DeepEqual(g, w) {
		t.Fatalf("round %d (%s): fingerprint differs from the walk's:\n%s", round, f.lastFreeze, fpDiff(g, w))
	}
	x := newIndex(wfp)
	if !reflect.DeepEqual(x.dirs, f.ckpt.dirs) {
		t.Fatalf("round %d (%s): directory index differs from the walk's:\n%v\n%v", round, f.lastFreeze, f.ckpt.dirs, x.dirs)
	}
	if g, w := nonEmpty(f.ckpt.children), nonEmpty(x.children); !reflect.DeepEqual(g, w) {
		t.Fatalf("round %d (%s): children index differs from the walk's:\n%v\n%v", round, f.lastFreeze, g, w)
	}
	if f.lastFreeze != "full" && !r.faulty && !r.dirRenamed && !r.linked && !prevMulti && !anyMultiLink(wfp) && f.lastFreeze != "tracked" &&
		!(r.everLinked && strings.Contains(f.lastFreeze, "other names")) && !strings.Contains(f.lastFreeze, "unseen") &&
		!strings.Contains(f.lastFreeze, "link(2)") {
		t.Errorf("round %d: no directory renamed, no hard links, yet the checkpoint walked (%s)", round, f.lastFreeze)
	}
	how := f.lastFreeze
	if i := strings.Index(how, " /"); i >= 0 {
		how = how[:i] // "walk: ... /path" -> the reason
	}
	return how
}

// noFlags drops the overlay flags of directories (an effect report's own
// walk does not read them; a baseline taken from a checkpoint has them).
func noFlags(fp map[string]entryFP) map[string]entryFP {
	for p, e := range fp {
		e.opaque, e.redirect = false, ""
		fp[p] = e
	}
	return fp
}

func nonEmpty(m map[string]map[string]struct{}) map[string]map[string]struct{} {
	out := map[string]map[string]struct{}{}
	for k, v := range m {
		if len(v) > 0 {
			out[k] = v
		}
	}
	return out
}

// effects compares the tracked effect report with the walk's against the
// same baseline.
func (r *trackRun) effects(round int, prevMulti bool) {
	t, f := r.t, r.f
	cur, err := fingerprintTree(f.Upper())
	if err != nil {
		t.Fatal(err)
	}
	want := f.effectsOf(cur, f.baseline())
	want.UpperNonEmpty = !sameFP(cur, f.ckpt.fp)
	got := f.TakeFSEffects()
	if !reflect.DeepEqual(got, want) {
		t.Fatalf("round %d (%s): effects differ from the walk's:\n%+v\n%+v", round, f.lastEffects, got, want)
	}
	if g, w := noFlags(normFP(f.taken.fp)), normFP(cur); !reflect.DeepEqual(g, w) {
		t.Fatalf("round %d (%s): effect baseline differs from the walk's:\n%s", round, f.lastEffects, fpDiff(g, w))
	}
	if !r.faulty && !r.takeRenamed && !r.takeLinked && !prevMulti && !anyMultiLink(cur) && f.lastEffects != "tracked" &&
		!(r.everLinked && strings.Contains(f.lastEffects, "other names")) && !strings.Contains(f.lastEffects, "no walk yet") &&
		!strings.Contains(f.lastEffects, "unseen") && !strings.Contains(f.lastEffects, "link(2)") {
		t.Errorf("round %d: no directory renamed, no hard links, yet the effect report walked (%s)", round, f.lastEffects)
	}
	r.takeRenamed, r.takeLinked = false, false
}

func anyMultiLink(fp map[string]entryFP) bool {
	for _, e := range fp {
		if e.multiLink() {
			return true
		}
	}
	return false
}

// normFP drops what the walk and the tracker may see differently without
// a change of content: the shared whiteout inode's fields.
func normFP(fp map[string]entryFP) map[string]entryFP {
	out := make(map[string]entryFP, len(fp))
	for p, e := range fp {
		if e.isWhiteout() {
			e = entryFP{mode: e.mode}
		}
		out[p] = e
	}
	return out
}

func fpDiff(a, b map[string]entryFP) string {
	var out []string
	for p, x := range a {
		if y, ok := b[p]; !ok || x != y {
			out = append(out, fmt.Sprintf("%s: tracked %+v walk %+v (in walk: %v)", p, x, y, ok))
		}
	}
	for p, y := range b {
		if _, ok := a[p]; !ok {
			out = append(out, fmt.Sprintf("%s: only in walk %+v", p, y))
		}
	}
	sort.Strings(out)
	return strings.Join(out, "\n")
}

// layerDump is treeDump plus the overlay flags of every directory.
func layerDump(t *testing.T, root string) string {
	lines := strings.Split(treeDump(t, root), "\n")
	for i, l := range lines {
		rel, _, _ := strings.Cut(l, " ")
		p := filepath.Join(root, rel)
		for _, x := range []string{layer.XattrOpaque, layer.XattrRedirect} {
			b := make([]byte, 4096)
			if n, err := unix.Lgetxattr(p, x, b); err == nil {
				lines[i] += " " + x + "=" + string(b[:n])
			}
		}
	}
	return strings.Join(lines, "\n")
}

// TestTrackerFallsBackToWalk: each fault makes that checkpoint walk the
// upper (and write the walk's delta), and the next one is tracked again.
func TestTrackerFallsBackToWalk(t *testing.T) {
	cases := []struct {
		name   string
		fault  func(r *trackRun)
		reason string
	}{
		{"queue overflow", func(r *trackRun) { r.f.track.event(unix.FAN_Q_OVERFLOW, false, nil) }, "overflow"},
		{"unknown directory handle", func(r *trackRun) {
			rec := make([]byte, 32)
			rec[0] = unix.FAN_EVENT_INFO_TYPE_DFID_NAME
			rec[2] = 32
			rec[12], rec[16] = 8, 1 // handle_bytes, handle_type
			copy(rec[20:], "\xde\xad\xbe\xef\x01\x02\x03\x04x\x00")
			r.f.track.event(unix.FAN_CREATE, false, rec)
		}, "unknown directory"},
		{"directory renamed", func(r *trackRun) {
			if err := os.Rename(r.p("a/c"), r.p("b/c2")); err != nil {
				r.t.Fatal(err)
			}
		}, "renamed"},
		{"hard link", func(r *trackRun) {
			if err := os.Link(r.p("a/f0"), r.p("b/l0")); err != nil {
				r.t.Fatal(err)
			}
		}, "other names"},
		{"unlink of a hard link", func(r *trackRun) {
			if err := os.Remove(r.p("b/l0")); err != nil {
				r.t.Fatal(err)
			}
		}, "other names"},
		{"hard link whose first name is replaced", func(r *trackRun) {
			writeFile(r.t, r.p("b/h0"), "h")
			if _, err := r.f.Checkpoint(); err != nil {
				r.t.Fatal(err)
			}
			if err := os.Link(r.p("b/h0"), r.p("a/h1")); err != nil {
				r.t.Fatal(err)
			}
			writeFile(r.t, r.p("b/h0.new"), "other")
			if err := os.Rename(r.p("b/h0.new"), r.p("b/h0")); err != nil {
				r.t.Fatal(err)
			}
		}, "link"},
		{"write through the surviving name", func(r *trackRun) {
			writeFile(r.t, r.p("a/h1"), "changed through the second name")
		}, "other names"},
		{"mark failure", func(r *trackRun) {
			r.f.track.failMark = "n"
			if err := os.MkdirAll(r.p("n/m"), 0o755); err != nil {
				r.t.Fatal(err)
			}
		}, ""}, // this checkpoint walks n (new); the next one must walk
	}
	st := newStore(t, "xfs")
	f := mountKP(t, st, Options{MountID: "faults"})
	r := &trackRun{t: t, f: f, st: st, rng: rand.New(rand.NewPCG(1, 2)), maps: map[string][]byte{}}
	for _, d := range []string{"a", "b", "a/c"} {
		if err := os.MkdirAll(r.p(d), 0o755); err != nil {
			t.Fatal(err)
		}
		writeFile(t, r.p(d+"/f0"), "x")
	}
	if _, err := f.Checkpoint(); err != nil {
		t.Fatal(err)
	}
	r.faulty = true
	for i, tc := range cases {
		writeFile(t, r.p("a/f1"), tc.name)
		tc.fault(r)
		r.checkpoint(i)
		f.track.failMark = ""
		if tc.reason != "" && !strings.Contains(f.lastFreeze, tc.reason) {
			t.Errorf("%s: checkpoint %q, want a walk (%s)", tc.name, f.lastFreeze, tc.reason)
		}
		writeFile(t, r.p("a/f2"), tc.name)
		r.checkpoint(i)
		want := "tracked"
		if tc.name == "mark failure" {
			want = "walk: tracked freeze needs the full walk: watch /n"
		}
		if !strings.HasPrefix(f.lastFreeze, want) {
			t.Errorf("%s: next checkpoint %q, want %q", tc.name, f.lastFreeze, want)
		}
	}
	writeFile(t, r.p("a/f2"), "after")
	r.checkpoint(len(cases))
	if f.lastFreeze != "tracked" {
		t.Errorf("after the faults: %q", f.lastFreeze)
	}
}
