package probebench

import (
	"bufio"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"sort"
	"strings"
	"syscall"
	"time"

	"github.com/cilium/ebpf"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/probe"
)

// Run measures one backend.
func Run(o Options) (*Result, error) {
	if len(o.Workload) == 0 {
		o.Workload = []string{"find", "/usr", "-xdev"}
	}
	if o.Rounds <= 0 {
		o.Rounds = 7
	}
	if o.Turns <= 0 {
		o.Turns = 200
	}
	if o.CgroupParent == "" {
		o.CgroupParent = "/sys/fs/cgroup/unified"
	}
	b := make([]byte, 6)
	rand.Read(b)
	cg := filepath.Join(o.CgroupParent, "rewind-bench-"+hex.EncodeToString(b))
	if err := os.Mkdir(cg, 0o755); err != nil {
		return nil, fmt.Errorf("create bench cgroup: %w", err)
	}
	defer removeCgroup(cg)
	res := &Result{Backend: o.Backend, Workload: strings.Join(o.Workload, " "), Rounds: o.Rounds, Turns: o.Turns, NoFSSource: o.NoFSSource}
	tg := probe.Target{Sandbox: "bench", CgroupV2Dir: cg, FS: nopFS{}}
	if o.NoFSSource {
		tg.FS = nil
	}

	// Warm the page cache so that the first round is not an outlier.
	if _, _, err := runIn(cg, o.Workload); err != nil {
		return nil, err
	}
	var off, on, offWall, onWall []time.Duration
	for i := 0; i < o.Rounds; i++ {
		d, wall, err := runIn(cg, o.Workload)
		if err != nil {
			return nil, err
		}
		off, offWall = append(off, d), append(offWall, wall)
		p, err := probe.Open(probe.Options{Backend: o.Backend})
		if err != nil {
			return nil, err
		}
		w, err := p.Begin(tg)
		if err != nil {
			p.Close()
			return nil, err
		}
		d, wall, err = runIn(cg, o.Workload)
		if err != nil {
			p.Close()
			return nil, err
		}
		on, onWall = append(on, d), append(onWall, wall)
		if _, err := w.End(); err != nil {
			p.Close()
			return nil, err
		}
		p.Close()
	}
	res.OffMS, res.OnMS = ms(median(off)), ms(median(on))
	res.OverheadPct = (res.OnMS - res.OffMS) / res.OffMS * 100
	res.OffWallMS, res.OnWallMS = ms(median(offWall)), ms(median(onWall))
	res.OffMinMS, res.OnMinMS = ms(pct(off, 0)), ms(pct(on, 0))
	res.OverheadMinPct = (res.OnMinMS - res.OffMinMS) / res.OffMinMS * 100
	if o.Backend == probe.BackendEBPF {
		if err := progStats(cg, o.Workload, tg, res); err != nil {
			return nil, err
		}
	}

	// Latency: a persistent bash and python3 in the cgroup, one command per
	// turn, End timed from the command's completion.
	p, err := probe.Open(probe.Options{Backend: o.Backend})
	if err != nil {
		return nil, err
	}
	defer p.Close()
	sh, err := startBash(cg)
	if err != nil {
		return nil, err
	}
	defer sh.close()
	var ends, begins []time.Duration
	for i := 0; i < o.Turns; i++ {
		t0 := time.Now()
		w, err := p.Begin(tg)
		if err != nil {
			return nil, err
		}
		begins = append(begins, time.Since(t0))
		if err := sh.run("x=$((x+1))"); err != nil {
			return nil, err
		}
		t1 := time.Now()
		r, err := w.End()
		if err != nil {
			return nil, err
		}
		ends = append(ends, time.Since(t1))
		if r.Proc.Alive == 0 {
			return nil, errors.New("latency bench: the shell is not in the cgroup")
		}
	}
	res.EndP50US, res.EndP99US = us(pct(ends, 0.5)), us(pct(ends, 0.99))
	res.BeginP50US = us(pct(begins, 0.5))
	return res, nil
}

// progStats runs the workload once more with BPF run-time statistics on
// and records what rewind's programs cost.
func progStats(cg string, workload []string, tg probe.Target, res *Result) error {
	stats, err := ebpf.EnableStats(0) // BPF_STATS_RUN_TIME
	if err != nil {
		return fmt.Errorf("enable BPF statistics: %w", err)
	}
	defer stats.Close()
	others := rwProgIDs(nil)
	p, err := probe.Open(probe.Options{Backend: probe.BackendEBPF})
	if err != nil {
		return err
	}
	defer p.Close()
	w, err := p.Begin(tg)
	if err != nil {
		return err
	}
	ours := rwProgIDs(others)
	t0, n0 := progStatsOf(ours)
	if _, _, err := runIn(cg, workload); err != nil {
		return err
	}
	t1, n1 := progStatsOf(ours)
	if _, err := w.End(); err != nil {
		return err
	}
	res.ProgMS, res.ProgRuns = ms(t1-t0), n1-n0
	res.ProgPct = res.ProgMS / res.OffMS * 100
	return nil
}

// rwProgIDs lists the ids of the rw_* programs on the host, leaving out
// those in skip.
func rwProgIDs(skip map[ebpf.ProgramID]bool) map[ebpf.ProgramID]bool {
	out := map[ebpf.ProgramID]bool{}
	var id ebpf.ProgramID
	for {
		next, err := ebpf.ProgramGetNextID(id)
		if err != nil {
			return out
		}
		id = next
		if skip[id] {
			continue
		}
		prog, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue
		}
		if info, err := prog.Info(); err == nil && strings.HasPrefix(info.Name, "rw_") {
			out[id] = true
		}
		prog.Close()
	}
}

// progStatsOf sums run time and count of the given programs.
func progStatsOf(ids map[ebpf.ProgramID]bool) (time.Duration, uint64) {
	var total time.Duration
	var runs uint64
	for id := range ids {
		prog, err := ebpf.NewProgramFromID(id)
		if err != nil {
			continue
		}
		if st, err := prog.Stats(); err == nil {
			total += st.Runtime
			runs += st.RunCount
		}
		prog.Close()
	}
	return total, runs
}

type nopFS struct{}

func (nopFS) TakeFSEffects() effect.FS { return effect.FS{} }

func ms(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e6 }
func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1e3 }

func median(l []time.Duration) time.Duration { return pct(l, 0.5) }

func pct(l []time.Duration, p float64) time.Duration {
	s := append([]time.Duration(nil), l...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	i := int(p*float64(len(s))+0.5) - 1
	return s[max(0, min(i, len(s)-1))]
}

func cgroupFD(cg string) (int, error) {
	return syscall.Open(cg, syscall.O_RDONLY|syscall.O_DIRECTORY|syscall.O_CLOEXEC, 0)
}

// runIn runs the workload in the cgroup and returns its CPU and wall time.
func runIn(cg string, args []string) (cpu, wall time.Duration, err error) {
	fd, err := cgroupFD(cg)
	if err != nil {
		return 0, 0, err
	}
	defer syscall.Close(fd)
	cmd := exec.Command(args[0], args[1:]...)
	cmd.Stdout = io.Discard
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	t0 := time.Now()
	if err := cmd.Run(); err != nil {
		var ee *exec.ExitError
		if !errors.As(err, &ee) { // find may meet unreadable dirs: fine
			return 0, 0, fmt.Errorf("run %v: %w", args, err)
		}
	}
	wall = time.Since(t0)
	return cmd.ProcessState.UserTime() + cmd.ProcessState.SystemTime(), wall, nil
}

type bash struct {
	cmd *exec.Cmd
	in  io.WriteCloser
	out *bufio.Reader
	n   int
}

func startBash(cg string) (*bash, error) {
	fd, err := cgroupFD(cg)
	if err != nil {
		return nil, err
	}
	defer syscall.Close(fd)
	cmd := exec.Command("bash", "--norc", "--noprofile")
	cmd.SysProcAttr = &syscall.SysProcAttr{UseCgroupFD: true, CgroupFD: fd}
	in, err := cmd.StdinPipe()
	if err != nil {
		return nil, err
	}
	out, err := cmd.StdoutPipe()
	if err != nil {
		return nil, err
	}
	if err := cmd.Start(); err != nil {
		return nil, fmt.Errorf("start bash: %w", err)
	}
	return &bash{cmd: cmd, in: in, out: bufio.NewReader(out)}, nil
}

func (b *bash) run(line string) error {
	b.n++
	marker := fmt.Sprintf("__B%d__", b.n)
	if _, err := fmt.Fprintf(b.in, "%s\necho %s\n", line, marker); err != nil {
		return err
	}
	for {
		l, err := b.out.ReadString('\n')
		if err != nil {
			return fmt.Errorf("bench shell: %w", err)
		}
		if strings.TrimSpace(l) == marker {
			return nil
		}
	}
}

func (b *bash) close() {
	b.in.Close()
	b.cmd.Process.Kill()
	b.cmd.Wait()
}

func removeCgroup(cg string) {
	for i := 0; i < 200; i++ {
		os.WriteFile(filepath.Join(cg, "cgroup.kill"), []byte("1"), 0)
		if err := os.Remove(cg); err == nil || os.IsNotExist(err) {
			return
		}
		time.Sleep(10 * time.Millisecond)
	}
}
