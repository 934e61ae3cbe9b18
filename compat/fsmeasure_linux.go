package compat

import (
	"errors"
	"fmt"
	"log/slog"
	"os"
	"path/filepath"
	"sort"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/layer"
)

// Sizes of the --fs auto self-test.
const (
	selfTestEntries = kernelpath.SelfTestEntries // files rewritten before each checkpoint
	selfTestIOFiles = 100                        // files of the I/O sample
)

// ChooseFS picks the file-system backend for sandboxes created with --fs
// auto, as the daemon does at start and `rewind doctor` shows: it gathers
// the facts (layer-switch ioctl, the state dir's file system) and, where
// the kernel path can run (a state dir off the host's root file system),
// runs the same short self-test on a scratch kernel-path view and a
// scratch FUSE view on stateDir's file system (checkpoints of a 100-entry
// delta, switches, an I/O sample of small files); DecideFS decides. The
// reason gives the numbers. It takes well under a second and leaves
// nothing mounted.
func ChooseFS(stateDir string) Choice {
	return DecideFS(measureFS(existingParent(stateDir)))
}

func measureFS(dir string) FSInputs {
	in := FSInputs{Entries: selfTestEntries, IOFiles: selfTestIOFiles}
	var sfs unix.Statfs_t
	if err := unix.Statfs(dir, &sfs); err == nil {
		in.FSType = fsTypeName(int64(sfs.Type))
	}
	switch err := kernelpath.ProbeSwitchIoctl(dir); {
	case err == nil:
		in.Ioctl = true
	case !errors.Is(err, kernelpath.ErrIoctlAbsent):
		in.IoctlErr = errnoDetail(err)
		return in
	}
	if onRootFS(dir) {
		in.OnRootFS = true
		return in
	}
	in.Measured = true
	tmp, err := os.MkdirTemp(dir, ".rewind-fs-selftest-")
	if err != nil {
		in.KernelErr = err.Error()
		return in
	}
	defer os.RemoveAll(tmp)
	quiet := slog.New(slog.DiscardHandler)
	in.Kernel, err = sampleBackend(tmp, "kernel", func(st *layer.Store, mp string) (selfTestView, error) {
		v, err := kernelpath.Mount(st, mp, kernelpath.Options{MountID: "selftest", Logger: quiet})
		if err != nil {
			return nil, err
		}
		in.Freeze, in.LiveFDsFollow = v.FreezeMode(), v.FreezeMode() == kernelpath.FreezeIoctl
		return trackedView{v, &in.Tracked}, nil
	})
	if err != nil {
		in.KernelErr = errnoDetail(err)
		return in
	}
	in.FUSE, err = sampleBackend(tmp, "fuse", func(st *layer.Store, mp string) (selfTestView, error) {
		return fs.Mount(st, mp, fs.Options{MountID: "selftest"})
	})
	if err != nil {
		in.FUSEErr = errnoDetail(err)
	}
	return in
}

// selfTestView is what the self-test needs of a backend's view.
type selfTestView interface {
	Mountpoint() string
	Checkpoint() (string, error)
	Switch(id string) error
	Unmount() error
}

// trackedView records, at unmount, whether the kernel path's last
// checkpoint was found by its change tracker.
type trackedView struct {
	*kernelpath.FS
	tracked *bool
}

func (v trackedView) Unmount() error {
	*v.tracked = v.FS.Tracked()
	return v.FS.Unmount()
}

// sampleBackend mounts a scratch view of backend name in a store under
// tmp and measures it: the I/O sample (median of 3), checkpoints after a
// selfTestEntries-file delta (median of 5, after one untimed checkpoint
// that freezes the I/O sample's files), switches between the last two
// checkpoints (median of 4).
func sampleBackend(tmp, name string, mount func(*layer.Store, string) (selfTestView, error)) (FSSample, error) {
	var s FSSample
	st, err := layer.OpenStore(filepath.Join(tmp, name+"-state"))
	if err != nil {
		return s, err
	}
	mp := filepath.Join(tmp, name+"-mnt")
	if err := os.Mkdir(mp, 0o755); err != nil {
		return s, err
	}
	v, err := mount(st, mp)
	if err != nil {
		return s, fmt.Errorf("%s mount: %w", name, err)
	}
	defer v.Unmount()
	var ios, cks, sws []time.Duration
	for run := range 3 {
		t0 := time.Now()
		if err := ioSample(filepath.Join(mp, "io"+strconv.Itoa(run)), selfTestIOFiles); err != nil {
			return s, fmt.Errorf("%s I/O: %w", name, err)
		}
		ios = append(ios, time.Since(t0))
	}
	var ids []string
	for run := range 6 {
		// The same files rewritten before each checkpoint, as an agent's
		// edits do (not timed).
		for i := range selfTestEntries {
			if err := os.WriteFile(filepath.Join(mp, "f"+strconv.Itoa(i)), []byte("rewind self-test "+strconv.Itoa(run)+"\n"), 0o644); err != nil {
				return s, fmt.Errorf("%s write: %w", name, err)
			}
		}
		t0 := time.Now()
		id, err := v.Checkpoint()
		if err != nil {
			return s, fmt.Errorf("%s checkpoint: %w", name, err)
		}
		if run > 0 {
			cks = append(cks, time.Since(t0))
		}
		ids = append(ids, id)
	}
	for i := range 4 {
		t0 := time.Now()
		if err := v.Switch(ids[len(ids)-1-i%2]); err != nil {
			return s, fmt.Errorf("%s switch: %w", name, err)
		}
		sws = append(sws, time.Since(t0))
	}
	if b, err := os.ReadFile(filepath.Join(mp, "f0")); err != nil || string(b) != "rewind self-test 4\n" {
		return s, fmt.Errorf("%s: content wrong after a switch (%q, %v)", name, b, err)
	}
	s.Checkpoint, s.Switch, s.IO = median(cks), median(sws), median(ios)
	return s, nil
}

// ioSample creates and writes n 1 KiB files in the new directory dir, then
// stats and reads them all.
func ioSample(dir string, n int) error {
	if err := os.Mkdir(dir, 0o755); err != nil {
		return err
	}
	data := make([]byte, 1024)
	for i := range n {
		if err := os.WriteFile(filepath.Join(dir, strconv.Itoa(i)), data, 0o644); err != nil {
			return err
		}
	}
	for i := range n {
		var st unix.Stat_t
		if err := unix.Lstat(filepath.Join(dir, strconv.Itoa(i)), &st); err != nil {
			return err
		}
	}
	for i := range n {
		if _, err := os.ReadFile(filepath.Join(dir, strconv.Itoa(i))); err != nil {
			return err
		}
	}
	return nil
}

func median(ds []time.Duration) time.Duration {
	s := append([]time.Duration(nil), ds...)
	sort.Slice(s, func(i, j int) bool { return s[i] < s[j] })
	return s[len(s)/2]
}
