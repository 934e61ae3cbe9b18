package sandbox

import (
	"fmt"
	"os"
	"path/filepath"
)

// MinimalRoot prepares dir as a small root file system for tests and
// tools: empty writable tmp, root, proc, dev and run directories, the
// host's merged-/usr symlinks (bin -> usr/bin, ...), and returns the binds
// that complete it (the host's /usr and /etc, and /bin, /lib... where they
// are real directories), read-only. The binds exist only inside the
// sandbox's mount namespace.
func MinimalRoot(dir string) ([]Bind, error) {
	for _, d := range []string{"tmp", "root", "proc", "dev", "run", "usr", "etc"} {
		if err := os.MkdirAll(filepath.Join(dir, d), 0o755); err != nil {
			return nil, fmt.Errorf("minimal root: %w", err)
		}
	}
	if err := os.Chmod(filepath.Join(dir, "tmp"), 0o1777); err != nil {
		return nil, fmt.Errorf("minimal root: %w", err)
	}
	binds := []Bind{{Source: "/usr", Target: "/usr", ReadOnly: true}, {Source: "/etc", Target: "/etc", ReadOnly: true}}
	for _, d := range []string{"bin", "sbin", "lib", "lib64", "lib32", "libx32"} {
		fi, err := os.Lstat("/" + d)
		if err != nil {
			continue
		}
		switch {
		case fi.Mode()&os.ModeSymlink != 0:
			target, err := os.Readlink("/" + d)
			if err != nil {
				return nil, fmt.Errorf("minimal root: %w", err)
			}
			if err := os.Symlink(target, filepath.Join(dir, d)); err != nil && !os.IsExist(err) {
				return nil, fmt.Errorf("minimal root: %w", err)
			}
		case fi.IsDir():
			binds = append(binds, Bind{Source: "/" + d, Target: "/" + d, ReadOnly: true})
		}
	}
	return binds, nil
}
