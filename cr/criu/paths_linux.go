package criu

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrImagePath is returned by Restore when a file the image names is now
// reached through a symlink of the sandbox.
//
// CRIU opens the files of a restored process by the paths it recorded at
// dump time, inside the sandbox's mount namespace, following symlinks,
// while its own descriptors include the image directory (a directory of
// the host): a symlink of the sandbox to /proc/self/fd/N/.. would lead it
// out. A path the kernel reported for an open file (d_path) never passes a
// symlink, so one that does now was changed by the sandbox after the dump
// (say, a file renamed over a symlink made before the checkpoint's
// barrier): the restore is refused before criu runs.
var ErrImagePath = errors.New("a file of the image is now reached through a symlink of the sandbox")

// checkImagePaths checks every regular-file path of the image in dir
// against the root of the sandbox of nsInit (see ErrImagePath). Paths that
// no longer exist are left to criu.
func checkImagePaths(dir string, nsInit int) error {
	b, err := os.ReadFile(filepath.Join(dir, "files.img"))
	if errors.Is(err, os.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("read files of image: %w", err)
	}
	bad := func(why string) error { return fmt.Errorf("files of image %s: %s", dir, why) }
	ents, err := ImageEntries(b, 0)
	if err != nil {
		return bad(err.Error())
	}
	var names []string
	for _, raw := range ents {
		reg, usk, err := fileNames(raw)
		if err != nil {
			return bad(err.Error())
		}
		if strings.HasPrefix(reg, "/") {
			names = append(names, reg)
		}
		if len(usk) > 0 && usk[0] == '/' {
			// A socket's directory, where criu binds it again.
			names = append(names, filepath.Dir(string(usk)))
		}
	}
	if len(names) == 0 {
		return nil
	}
	root, err := unix.Open("/proc/"+strconv.Itoa(nsInit)+"/root", unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("open sandbox root: %w", err)
	}
	defer unix.Close(root)
	for _, name := range names {
		fd, err := unix.Openat2(root, name, &unix.OpenHow{
			Flags:   unix.O_PATH | unix.O_NOFOLLOW | unix.O_CLOEXEC,
			Resolve: unix.RESOLVE_IN_ROOT | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
		})
		if err == nil {
			var st unix.Stat_t
			serr := unix.Fstat(fd, &st)
			unix.Close(fd)
			if serr == nil && st.Mode&unix.S_IFMT == unix.S_IFLNK {
				return fmt.Errorf("%w: %s", ErrImagePath, name)
			}
			continue
		}
		if errors.Is(err, unix.ELOOP) {
			return fmt.Errorf("%w: %s", ErrImagePath, name)
		}
	}
	return nil
}
