package criu

import (
	"debug/elf"
	"fmt"
	"os"
	"path/filepath"
	"runtime"
	"strconv"
	"strings"
)

// criu runs inside a sandbox's mount namespace, where every path is the
// sandbox's: exec'd there, a dynamically linked criu would get its program
// interpreter and shared libraries (libc, gnutls, ...) from the sandbox's
// own, agent-writable file system, and run that code as root with every
// capability. So the host's loader and library directories are opened on
// the host side and handed in as descriptors, and criu is started as
// `<loader> --inhibit-cache --library-path <dirs> <criu>`: nothing criu
// executes comes from the sandbox. (It also spares every restore into a new
// sandbox reading ten MiB of libraries through that sandbox's new mount.)

// hostLibs is the host's loader and library directories for criu.
type hostLibs struct {
	ld   *os.File
	dirs []*os.File
}

// hostLibDirs are the library directories tried, in order.
func hostLibDirs(bin string) []string {
	triplet := map[string]string{"amd64": "x86_64-linux-gnu", "arm64": "aarch64-linux-gnu"}[runtime.GOARCH]
	var dirs []string
	// A criu installed under a prefix (scripts/deps.sh) may bring its own.
	if i := strings.LastIndex(bin, "/sbin/"); i > 0 {
		dirs = append(dirs, bin[:i]+"/lib", bin[:i]+"/lib64")
		if triplet != "" {
			dirs = append(dirs, bin[:i]+"/lib/"+triplet)
		}
	}
	if triplet != "" {
		dirs = append(dirs, "/lib/"+triplet, "/usr/lib/"+triplet)
	}
	return append(dirs, "/lib64", "/usr/lib64", "/lib", "/usr/lib", "/usr/local/lib")
}

// openHostLibs opens the program interpreter of bin and the host's library
// directories. A static bin needs none: it returns nil.
func openHostLibs(bin string) (*hostLibs, error) {
	f, err := elf.Open(bin)
	if err != nil {
		return nil, fmt.Errorf("read %s: %w", bin, err)
	}
	interp := ""
	for _, p := range f.Progs {
		if p.Type == elf.PT_INTERP {
			b := make([]byte, p.Filesz)
			if _, err := p.ReadAt(b, 0); err != nil {
				f.Close()
				return nil, fmt.Errorf("read %s interpreter: %w", bin, err)
			}
			interp = strings.TrimRight(string(b), "\x00")
		}
	}
	f.Close()
	if interp == "" {
		return nil, nil
	}
	h := &hostLibs{}
	if h.ld, err = os.Open(interp); err != nil {
		return nil, fmt.Errorf("criu's loader: %w", err)
	}
	seen := map[string]bool{}
	for _, d := range hostLibDirs(bin) {
		st, err := os.Stat(d)
		if err != nil || !st.IsDir() {
			continue
		}
		// Skip a directory reached twice (/lib -> usr/lib symlinks).
		if real, err := filepath.EvalSymlinks(d); err == nil {
			if seen[real] {
				continue
			}
			seen[real] = true
		}
		df, err := os.Open(d)
		if err != nil {
			continue
		}
		h.dirs = append(h.dirs, df)
	}
	if len(h.dirs) == 0 {
		h.close()
		return nil, fmt.Errorf("no host library directory for %s", bin)
	}
	return h, nil
}

func (h *hostLibs) close() {
	if h == nil {
		return
	}
	if h.ld != nil {
		h.ld.Close()
	}
	for _, d := range h.dirs {
		d.Close()
	}
}

// files are the descriptors criu inherits after the binary (fd 3) and the
// image directory (fd 4), in this order: fd 5 is the loader.
func (h *hostLibs) files() []*os.File {
	if h == nil {
		return nil
	}
	return append([]*os.File{h.ld}, h.dirs...)
}

// argv is the command line prefix that runs the binary at fd 3 with the
// host's loader and libraries, as seen from inside any mount namespace.
func (h *hostLibs) argv() []string {
	if h == nil {
		return []string{"/proc/self/fd/3"}
	}
	paths := make([]string, len(h.dirs))
	for i := range h.dirs {
		paths[i] = "/proc/self/fd/" + strconv.Itoa(6+i)
	}
	return []string{"/proc/self/fd/5", "--inhibit-cache", "--library-path", strings.Join(paths, ":"), "--argv0", "criu", "/proc/self/fd/3"}
}
