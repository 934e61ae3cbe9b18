package daemon

import (
	"debug/buildinfo"
	"fmt"
	"os"
	"path/filepath"
	"runtime/debug"

	"golang.org/x/sys/unix"
)

// selfInit is the init the daemon falls back to: its own binary.
const selfInit = "/proc/self/exe"

// resolveInit returns the binary the daemon runs as every sandbox's init:
// path when set (it must be a usable init, see checkInit); else InitName
// beside the daemon's executable when it is usable and from the same
// build; else the daemon's own binary. why says why a found InitName was
// not taken ("" when it was, or when there was none).
func resolveInit(path string) (init, why string, err error) {
	exe, err := os.Executable()
	if err != nil {
		exe = ""
	}
	return resolveInitBeside(path, exe)
}

// resolveInitBeside is resolveInit for a daemon whose executable is exe
// ("": unknown).
func resolveInitBeside(path, exe string) (init, why string, err error) {
	if path != "" {
		if err := checkInit(path); err != nil {
			return "", "", fmt.Errorf("init %s: %w", path, err)
		}
		return path, "", nil
	}
	if exe == "" {
		return selfInit, "", nil
	}
	cand := filepath.Join(filepath.Dir(exe), InitName)
	if _, err := os.Lstat(cand); err != nil {
		return selfInit, "", nil
	}
	if err := checkInit(cand); err != nil {
		return selfInit, err.Error(), nil
	}
	return cand, "", nil
}

// checkInit checks that path is a regular file only its owner, root or
// the daemon's user, can write, and that it was built from the same
// module, revision and Go version as the running daemon (the init and the
// daemon speak a private protocol).
func checkInit(path string) error {
	var st unix.Stat_t
	if err := unix.Stat(path, &st); err != nil {
		return err
	}
	if st.Mode&unix.S_IFMT != unix.S_IFREG || st.Mode&0o111 == 0 {
		return fmt.Errorf("not an executable file")
	}
	if st.Mode&0o022 != 0 || (st.Uid != 0 && int(st.Uid) != os.Geteuid()) {
		return fmt.Errorf("writable by others than root and the daemon's user")
	}
	bi, err := buildinfo.ReadFile(path)
	if err != nil {
		return fmt.Errorf("no Go build information: %w", err)
	}
	self, ok := debug.ReadBuildInfo()
	if !ok {
		return fmt.Errorf("the daemon has no build information to compare")
	}
	if got, want := buildKey(bi), buildKey(self); got != want {
		return fmt.Errorf("another build (%s) than the daemon's (%s)", got, want)
	}
	return nil
}

// buildKey identifies a build of this module: Go version, module version
// and the VCS state it was built from.
func buildKey(bi *debug.BuildInfo) string {
	k := bi.GoVersion + " " + bi.Main.Path + "@" + bi.Main.Version
	for _, s := range bi.Settings {
		switch s.Key {
		case "vcs.revision", "vcs.time", "vcs.modified":
			k += " " + s.Key + "=" + s.Value
		}
	}
	return k
}
