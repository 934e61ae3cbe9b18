package kernelpath

import (
	"bufio"
	"encoding/json"
	"errors"
	"fmt"
	"github.com/rewind-sandbox/rewind/internal/mountinfo"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"time"

	"github.com/rewind-sandbox/rewind/layer"
)

// InitStore creates (if absent) a file-system image with reflink, mounts it
// on the state dir through a loop device and writes the store config the
// daemon reads at start (EnsureStore). It is idempotent: an existing image
// is not reformatted, and a state dir already mounted from the image is
// left as is.
func InitStore(opts StoreImage) (StoreConfig, error) {
	var cfg StoreConfig
	switch opts.FS {
	case "xfs", "btrfs":
	default:
		return cfg, fmt.Errorf("init-store: file system %q: want xfs or btrfs", opts.FS)
	}
	if opts.Image == "" || opts.StateDir == "" {
		return cfg, errors.New("init-store: image path and state dir are required")
	}
	img, err := filepath.Abs(opts.Image)
	if err != nil {
		return cfg, fmt.Errorf("init-store: %w", err)
	}
	state, err := filepath.Abs(opts.StateDir)
	if err != nil {
		return cfg, fmt.Errorf("init-store: %w", err)
	}
	cfg = StoreConfig{Version: 1, StateDir: state, Image: img, FS: opts.FS, Created: time.Now().UTC()}
	// What EnsureStore would refuse is refused before an image is made.
	if src, ok := mountedFrom(state); ok && src != img {
		return cfg, fmt.Errorf("init-store: state dir %s is already a mount point of %s, not of %s", state, src, img)
	} else if !ok {
		if ents, err := os.ReadDir(state); err == nil && len(ents) > 0 {
			return cfg, fmt.Errorf("init-store: state dir %s is not empty: mounting the image there would hide its content; move it away or pick another --state", state)
		}
	}
	if _, err := os.Stat(img); errors.Is(err, os.ErrNotExist) {
		if opts.Size < MinImageSize {
			return cfg, fmt.Errorf("init-store: --size %d is below the minimum of %d bytes (512M)", opts.Size, int64(MinImageSize))
		}
		if err := makeImage(img, opts.FS, opts.Size); err != nil {
			return cfg, fmt.Errorf("init-store: %w", err)
		}
	} else if err != nil {
		return cfg, fmt.Errorf("init-store: %w", err)
	}
	if err := EnsureStore(cfg); err != nil {
		return cfg, fmt.Errorf("init-store: %w", err)
	}
	if !probeReflink(state) {
		return cfg, fmt.Errorf("init-store: %s mounted on %s but reflink (FICLONE) does not work there", img, state)
	}
	// The daemon's layer store lives in STATE/layers (its state manager
	// keeps STATE/meta).
	if _, err := layer.OpenStore(filepath.Join(state, "layers")); err != nil {
		return cfg, fmt.Errorf("init-store: %w", err)
	}
	if opts.ConfigPath != "" {
		if err := SaveStoreConfig(opts.ConfigPath, cfg); err != nil {
			return cfg, fmt.Errorf("init-store: %w", err)
		}
	}
	return cfg, nil
}

func makeImage(img, fs string, size int64) error {
	mkfs := mkfsCommand(fs)
	if _, err := exec.LookPath(mkfs[0]); err != nil {
		return fmt.Errorf("%s not found: install %s", mkfs[0], map[string]string{"xfs": "xfsprogs", "btrfs": "btrfs-progs"}[fs])
	}
	if err := os.MkdirAll(filepath.Dir(img), 0o700); err != nil {
		return err
	}
	f, err := os.OpenFile(img, os.O_WRONLY|os.O_CREATE|os.O_EXCL, 0o600)
	if err != nil {
		return err
	}
	err = f.Truncate(size)
	if cerr := f.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		var out []byte
		out, err = exec.Command(mkfs[0], append(mkfs[1:], img)...).CombinedOutput()
		if err != nil {
			err = fmt.Errorf("%s: %v: %s", mkfs[0], err, firstLine(out))
		}
	}
	if err != nil {
		_ = os.Remove(img)
		return fmt.Errorf("make %s image %s: %w", fs, img, err)
	}
	return nil
}

// mkfsCommand is the mkfs command line (without the image) for a store
// image. XFS gets reflink and a copy-on-write extent size hint of one block
// (the default, 32 blocks, makes a 1-byte write into a shared file cost
// 128 KiB; measured: 124 KiB vs 4 KiB); directories pass the hint on.
func mkfsCommand(fs string) []string {
	return map[string][]string{
		"xfs":   {"mkfs.xfs", "-q", "-f", "-m", "reflink=1", "-d", "cowextsize=1"},
		"btrfs": {"mkfs.btrfs", "-q", "-f"},
	}[fs]
}

// EnsureStore mounts cfg.Image on cfg.StateDir through a loop device unless
// it is mounted there already. The daemon calls it at start.
func EnsureStore(cfg StoreConfig) error {
	if cfg.Image == "" || cfg.StateDir == "" {
		return errors.New("store config: image and state_dir are required")
	}
	if src, ok := mountedFrom(cfg.StateDir); ok {
		if src == cfg.Image {
			return nil
		}
		return fmt.Errorf("state dir %s is already a mount point of %s, not of %s", cfg.StateDir, src, cfg.Image)
	}
	if err := os.MkdirAll(cfg.StateDir, 0o700); err != nil {
		return fmt.Errorf("state dir: %w", err)
	}
	if ents, err := os.ReadDir(cfg.StateDir); err != nil {
		return fmt.Errorf("state dir: %w", err)
	} else if len(ents) > 0 {
		return fmt.Errorf("state dir %s is not empty: mounting the image there would hide its content; move it away or pick another --state", cfg.StateDir)
	}
	if out, err := exec.Command("mount", "-t", cfg.FS, "-o", "loop", cfg.Image, cfg.StateDir).CombinedOutput(); err != nil {
		return fmt.Errorf("mount %s on %s: %v: %s", cfg.Image, cfg.StateDir, err, firstLine(out))
	}
	return nil
}

// mountedFrom returns the backing image (or device) of the mount at dir,
// if dir is a mount point.
func mountedFrom(dir string) (string, bool) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return "", false
	}
	defer f.Close()
	var src string
	found := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		fields := strings.Fields(sc.Text())
		if len(fields) < 10 || mountinfo.Unescape(fields[4]) != dir {
			continue
		}
		for i, x := range fields {
			if x == "-" && i+2 < len(fields) {
				src, found = fields[i+2], true // the last mount on dir wins
			}
		}
	}
	if !found {
		return "", false
	}
	if dev, ok := strings.CutPrefix(src, "/dev/"); ok && strings.HasPrefix(dev, "loop") {
		if b, err := os.ReadFile("/sys/block/" + dev + "/loop/backing_file"); err == nil {
			return strings.TrimSpace(string(b)), true
		}
	}
	return src, true
}

func firstLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.IndexByte(s, '\n'); i >= 0 {
		s = s[:i]
	}
	return s
}

// LoadStoreConfig reads a store config written by InitStore.
func LoadStoreConfig(path string) (StoreConfig, error) {
	var cfg StoreConfig
	b, err := os.ReadFile(path)
	if err != nil {
		return cfg, fmt.Errorf("store config: %w", err)
	}
	if err := json.Unmarshal(b, &cfg); err != nil {
		return cfg, fmt.Errorf("store config %s: %w", path, err)
	}
	if cfg.Version != 1 {
		return cfg, fmt.Errorf("store config %s: unknown version %d", path, cfg.Version)
	}
	return cfg, nil
}

// SaveStoreConfig writes cfg to path durably (root-only permissions).
func SaveStoreConfig(path string, cfg StoreConfig) error {
	b, err := json.MarshalIndent(cfg, "", "  ")
	if err != nil {
		return err
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return fmt.Errorf("store config: %w", err)
	}
	if err := layer.WriteFileAtomic(path, append(b, '\n'), true); err != nil {
		return fmt.Errorf("store config %s: %w", path, err)
	}
	return nil
}
