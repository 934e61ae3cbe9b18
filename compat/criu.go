package compat

import (
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"time"
)

// DefaultCRIUPrefix is where `make deps` installs CRIU when the host has no
// CRIU >= 4 of its own.
const DefaultCRIUPrefix = "/opt/rewind/criu"

// ErrNoCRIU is returned by FindCRIU when no CRIU binary is found.
var ErrNoCRIU = errors.New("criu not found: run `make deps` (builds CRIU 4.1.1 into " + DefaultCRIUPrefix + ") or set REWIND_CRIU")

// FindCRIU returns the CRIU binary rewind uses, looked up in this order: the
// explicitly configured path (if non-empty), the REWIND_CRIU environment
// variable, the project prefix (DefaultCRIUPrefix/sbin/criu), then PATH.
// It does not check the version; see CRIUInfo.
func FindCRIU(configured string) (string, error) {
	for _, c := range []string{configured, os.Getenv("REWIND_CRIU")} {
		if c == "" {
			continue
		}
		if err := executable(c); err != nil {
			return "", fmt.Errorf("configured criu %s: %w", c, err)
		}
		return c, nil
	}
	if p := DefaultCRIUPrefix + "/sbin/criu"; executable(p) == nil {
		return p, nil
	}
	if p, err := exec.LookPath("criu"); err == nil {
		return p, nil
	}
	return "", ErrNoCRIU
}

func executable(p string) error {
	st, err := os.Stat(p)
	if err != nil {
		return err
	}
	if st.IsDir() || st.Mode()&0o111 == 0 {
		return fmt.Errorf("%s is not an executable file", p)
	}
	return nil
}

// CRIUVersionOf runs `criu --version` on bin and parses it.
func CRIUVersionOf(ctx context.Context, bin string) (CRIUVersion, error) {
	ctx, cancel := context.WithTimeout(ctx, 15*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, bin, "--version").CombinedOutput()
	if err != nil {
		return CRIUVersion{}, fmt.Errorf("%s --version: %w: %s", bin, err, out)
	}
	return ParseCRIUVersion(string(out))
}
