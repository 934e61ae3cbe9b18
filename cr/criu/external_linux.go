package criu

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ExternalFile is the file, in an image directory, that lists the files of
// the dumped processes that were on a mount outside the namespace they
// were dumped in (criu "file[MNT:INO]" externals) with their paths there.
const ExternalFile = "external.json"

// Externals finds the files processes pids (host pids) hold on mounts
// that are not in the mount namespace of nsInit: executable, file
// mappings, descriptors, working directory and root. They are what a
// process keeps of a root mount that was replaced under it (a stock-kernel
// native overlay's switch): criu cannot dump them (it looks every file's
// mount up in the namespace), so Dump declares them external and Restore
// hands criu the file at the same path in the sandbox's current root. The
// result maps criu's key ("file[MNT:INO]", hexadecimal) to the path.
func Externals(nsInit int, pids []int) (map[string]string, error) {
	mi, err := os.ReadFile("/proc/" + strconv.Itoa(nsInit) + "/mountinfo")
	if err != nil {
		return nil, fmt.Errorf("externals: %w", err)
	}
	inNS := map[uint64]bool{}
	for _, line := range strings.Split(string(mi), "\n") {
		if f := strings.Fields(line); len(f) > 0 {
			if id, err := strconv.ParseUint(f[0], 10, 64); err == nil {
				inNS[id] = true
			}
		}
	}
	out := map[string]string{}
	add := func(link string) {
		var stx unix.Statx_t
		if unix.Statx(unix.AT_FDCWD, link, 0, unix.STATX_MNT_ID|unix.STATX_INO|unix.STATX_TYPE, &stx) != nil || stx.Mask&unix.STATX_MNT_ID == 0 || inNS[stx.Mnt_id] {
			return
		}
		switch stx.Mode & unix.S_IFMT {
		case unix.S_IFREG, unix.S_IFDIR:
		default:
			return // pipes, sockets, anonymous inodes: not files of a mount
		}
		p, err := os.Readlink(link)
		if err != nil || !strings.HasPrefix(p, "/") || strings.HasSuffix(p, " (deleted)") {
			return
		}
		out[fmt.Sprintf("file[%x:%x]", stx.Mnt_id, stx.Ino)] = p
	}
	for _, pid := range pids {
		base := "/proc/" + strconv.Itoa(pid)
		for _, l := range []string{"exe", "cwd", "root"} {
			add(base + "/" + l)
		}
		for _, d := range []string{"map_files", "fd"} {
			ents, err := os.ReadDir(base + "/" + d)
			if err != nil {
				continue
			}
			for _, e := range ents {
				add(base + "/" + d + "/" + e.Name())
			}
		}
	}
	return out, nil
}

// writeExternals records ext in the image directory (nothing when empty).
func writeExternals(dir string, ext map[string]string) error {
	if len(ext) == 0 {
		return nil
	}
	b, err := json.Marshal(ext)
	if err != nil {
		return err
	}
	return os.WriteFile(filepath.Join(dir, ExternalFile), b, 0o600)
}

// openExternals opens, for the restore of the image in dir, each external
// file it lists at its path beneath the root of nsInit's sandbox (O_PATH,
// no symlink followed: as for every path of an image, see ErrImagePath).
func openExternals(dir string, nsInit int) (map[string]*os.File, error) {
	b, err := os.ReadFile(filepath.Join(dir, ExternalFile))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	var ext map[string]string
	if err := json.Unmarshal(b, &ext); err != nil {
		return nil, fmt.Errorf("%s: %w", ExternalFile, err)
	}
	root, err := unix.Open("/proc/"+strconv.Itoa(nsInit)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, fmt.Errorf("open sandbox root: %w", err)
	}
	defer unix.Close(root)
	out := map[string]*os.File{}
	for key, p := range ext {
		fd, err := unix.Openat2(root, p, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
		})
		if err != nil {
			for _, f := range out {
				f.Close()
			}
			if errors.Is(err, unix.ELOOP) {
				return nil, fmt.Errorf("%w: %s", ErrImagePath, p)
			}
			return nil, fmt.Errorf("external file %s: %w", p, err)
		}
		out[key] = os.NewFile(uintptr(fd), p)
	}
	return out, nil
}
