package kernelpath

import (
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"github.com/rewind-sandbox/rewind/layer"
)

// SelfTestEntries is the delta size the self-test checkpoints.
const SelfTestEntries = 100

// SelfTest measures the kernel path on the file system of stateDir: it
// mounts a scratch overlay in a temporary store under stateDir, writes a
// SelfTestEntries-entry delta, and times checkpoints and switches (median of
// a few runs). Everything is unmounted and removed before it returns. It
// takes well under a second on XFS or btrfs.
func SelfTest(stateDir string) (Report, error) {
	var r Report
	r.FSType = fsType(stateDir)
	r.Ioctl = ProbeSwitchIoctl(stateDir) == nil
	tmp, err := os.MkdirTemp(stateDir, ".kernelpath-selftest-")
	if err != nil {
		return r, fmt.Errorf("kernelpath self-test: %w", err)
	}
	defer os.RemoveAll(tmp)
	st, err := layer.OpenStore(filepath.Join(tmp, "state"))
	if err != nil {
		return r, fmt.Errorf("kernelpath self-test: %w", err)
	}
	mp := filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		return r, fmt.Errorf("kernelpath self-test: %w", err)
	}
	f, err := Mount(st, mp, Options{MountID: "selftest", Logger: slog.New(slog.DiscardHandler)})
	if err != nil {
		return r, fmt.Errorf("kernelpath self-test: %w", err)
	}
	defer f.Unmount()
	r.Freeze = f.FreezeMode()
	r.LiveFDsFollow = r.Freeze == FreezeIoctl
	r.Entries = SelfTestEntries
	const runs = 5
	var cks, sws []time.Duration
	var ids []string
	for run := range runs {
		// A fresh SelfTestEntries-entry delta before every checkpoint (not
		// timed): the same files rewritten, as an agent's edits do.
		for i := range SelfTestEntries {
			if err := os.WriteFile(filepath.Join(mp, "f"+strconv.Itoa(i)), []byte("rewind self-test "+strconv.Itoa(run)+"\n"), 0o644); err != nil {
				return r, fmt.Errorf("kernelpath self-test: write: %w", err)
			}
		}
		t0 := time.Now()
		id, err := f.Checkpoint()
		if err != nil {
			return r, fmt.Errorf("kernelpath self-test: %w", err)
		}
		cks = append(cks, time.Since(t0))
		ids = append(ids, id)
	}
	for i := range runs {
		t0 := time.Now()
		if err := f.Switch(ids[i]); err != nil {
			return r, fmt.Errorf("kernelpath self-test: %w", err)
		}
		sws = append(sws, time.Since(t0))
	}
	if _, err := os.Stat(filepath.Join(mp, "f0")); err != nil {
		return r, fmt.Errorf("kernelpath self-test: content lost across switch: %w", err)
	}
	r.Checkpoint, r.Switch = median(cks), median(sws)
	snap := ""
	if r.FSType == "btrfs" && r.Freeze != FreezeIoctl {
		if d, err := measureBtrfsSnapshot(tmp, SelfTestEntries, 3); err != nil {
			snap = fmt.Sprintf("; btrfs snapshot not measured: %v", err)
		} else {
			r.Snapshot = d
			verdict := "slower than"
			if d < r.Checkpoint {
				verdict = "faster than"
			}
			snap = fmt.Sprintf("; a btrfs read-only snapshot after the same delta takes %v (%s the reflink delta; one transaction commit with a device flush), but is not used: overlayfs's workdir must share the upper's subvolume (cross-subvolume renames fail with EXDEV) and inode numbers collide across subvolumes", d.Round(time.Microsecond), verdict)
		}
	}
	how := map[string]string{
		FreezeIoctl:   "patched overlayfs: layer-switch ioctl, live fds follow",
		FreezeReflink: "stock overlayfs: checkpoint reflinks the upper's entries, switch remounts (live fds stay on the old view; the daemon re-creates the processes on the new one)",
		FreezeCopy:    "stock overlayfs on a file system without reflink: checkpoint copies changed data, switch remounts (the daemon re-creates the processes on the new view)",
	}[r.Freeze]
	r.Detail = fmt.Sprintf("%s on %s: checkpoint of %d entries %v, switch %v (median of %d)%s", how, r.FSType, SelfTestEntries, r.Checkpoint.Round(time.Microsecond), r.Switch.Round(time.Microsecond), runs, snap)
	return r, nil
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
