package bench

import (
	"context"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"golang.org/x/sys/unix"
)

// Baselines are the state managers users would otherwise use. Each keeps
// the repository in a directory on the host and runs the agent's commands
// in a persistent bash there. A restore that cannot bring processes back
// restarts the shell in $R (cwd, variables and background jobs are lost):
// that is what those tools do, and the crash checks count it.

// dirBase holds what every directory baseline shares.
type dirBase struct {
	name string
	root string // private temp dir
	repo string // $R
	sh   *shell
	n    int
}

func (d *dirBase) Name() string { return d.name }

func (d *dirBase) init(parent string) error {
	root, err := os.MkdirTemp(parent, "rewind-bench-"+d.name+"-")
	if err != nil {
		return err
	}
	d.root = root
	return os.MkdirAll(filepath.Join(root, "snaps"), 0o755)
}

func (d *dirBase) startShell(ctx context.Context) error {
	sh, err := startShell(d.repo, d.repo)
	if err != nil {
		return err
	}
	d.sh = sh
	return nil
}

func (d *dirBase) Run(ctx context.Context, cmd string) error {
	out, code, err := d.sh.run(ctx, cmd)
	if err != nil {
		return err
	}
	_ = out
	_ = code // agent commands may fail (tests, kills); only the shell must live
	return nil
}

func (d *dirBase) Digest(ctx context.Context) (string, error) {
	out, _, err := d.sh.run(ctx, digestScript)
	return strings.TrimSpace(out), err
}

func (d *dirBase) Usage() Usage { return Usage{DiskBytes: duBytes(filepath.Join(d.root, "snaps"))} }

func (d *dirBase) closeBase() error {
	d.sh.kill()
	return os.RemoveAll(d.root)
}

func (d *dirBase) runSetup(ctx context.Context, setup []string) error {
	for _, c := range setup {
		out, code, err := d.sh.run(ctx, c)
		if err != nil {
			return err
		}
		if code != 0 {
			return fmt.Errorf("setup %q exited %d: %s", c, code, out)
		}
	}
	return nil
}

func run(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %v: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// duBytes sums the allocated size of every file under dir (hard links
// and reflinked extents counted once per file: an upper bound for reflinks).
func duBytes(dir string) int64 {
	var n int64
	seen := map[uint64]bool{}
	_ = filepath.WalkDir(dir, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			return nil
		}
		var st unix.Stat_t
		if unix.Lstat(p, &st) == nil && !seen[st.Ino] {
			seen[st.Ino] = true
			n += st.Blocks * 512
		}
		return nil
	})
	return n
}

// copyBaseline snapshots the repository by copying it: `cp -a`, `cp -a
// --reflink=always` (on a reflink-capable dir) or a tarball.
type copyBaseline struct {
	dirBase
	mode   string // "cp", "reflink", "tar"
	parent string
}

// NewCopyBaseline returns the directory-copy baselines: mode "cp" (cp -a),
// "reflink" (cp --reflink=always; parent must be on XFS or btrfs) or "tar".
func NewCopyBaseline(mode, parent string) Manager {
	names := map[string]string{"cp": "cp-a", "reflink": "cp-reflink", "tar": "tarball"}
	return &copyBaseline{dirBase: dirBase{name: names[mode]}, mode: mode, parent: parent}
}

func (c *copyBaseline) Start(ctx context.Context, setup []string) error {
	if err := c.init(c.parent); err != nil {
		return err
	}
	c.repo = filepath.Join(c.root, "repo")
	if err := os.Mkdir(c.repo, 0o755); err != nil {
		return err
	}
	if err := c.startShell(ctx); err != nil {
		return err
	}
	return c.runSetup(ctx, setup)
}

func (c *copyBaseline) snap(id string) string { return filepath.Join(c.root, "snaps", id) }

func (c *copyBaseline) Checkpoint(ctx context.Context) (string, Cost, error) {
	c.n++
	id := strconv.Itoa(c.n)
	start := time.Now()
	var err error
	switch c.mode {
	case "cp":
		err = run("cp", "-a", c.repo, c.snap(id))
	case "reflink":
		err = run("cp", "-a", "--reflink=always", c.repo, c.snap(id))
	case "tar":
		err = run("tar", "-C", c.repo, "-cf", c.snap(id)+".tar", ".")
	}
	d := time.Since(start)
	return id, Cost{Visible: d, Frozen: d, Decision: "full"}, err
}

func (c *copyBaseline) Restore(ctx context.Context, id string) (Cost, error) {
	start := time.Now()
	c.sh.kill()
	if err := os.RemoveAll(c.repo); err != nil {
		return Cost{}, err
	}
	var err error
	switch c.mode {
	case "cp":
		err = run("cp", "-a", c.snap(id), c.repo)
	case "reflink":
		err = run("cp", "-a", "--reflink=always", c.snap(id), c.repo)
	case "tar":
		if err = os.Mkdir(c.repo, 0o755); err == nil {
			err = run("tar", "-C", c.repo, "-xf", c.snap(id)+".tar")
		}
	}
	if err == nil {
		err = c.startShell(ctx)
	}
	return Cost{Visible: time.Since(start), Decision: "full"}, err
}

func (c *copyBaseline) Close() error { return c.closeBase() }

// overlayBaseline is native overlayfs with a remount per checkpoint: the
// upper is frozen into a new lower layer and a fresh upper mounted. Running
// processes would keep the old mount (their writes would land in a frozen
// layer), so the shell restarts at every checkpoint and restore.
type overlayBaseline struct {
	dirBase
	parent string
	stacks map[string][]string // checkpoint id -> lower layers, top first
	cur    []string
	upper  string
}

// NewOverlayBaseline returns the native overlayfs remount baseline.
func NewOverlayBaseline(parent string) Manager {
	return &overlayBaseline{dirBase: dirBase{name: "overlay-remount"}, parent: parent, stacks: map[string][]string{}}
}

func (o *overlayBaseline) Start(ctx context.Context, setup []string) error {
	if err := o.init(o.parent); err != nil {
		return err
	}
	o.repo = filepath.Join(o.root, "repo")
	for _, d := range []string{o.repo, filepath.Join(o.root, "layers"), filepath.Join(o.root, "work"), filepath.Join(o.root, "empty")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := o.mount(nil); err != nil {
		return err
	}
	if err := o.startShell(ctx); err != nil {
		return err
	}
	return o.runSetup(ctx, setup)
}

// mount mounts lowers (top first) plus a fresh upper at repo.
func (o *overlayBaseline) mount(lowers []string) error {
	o.n++
	o.upper = filepath.Join(o.root, "layers", strconv.Itoa(o.n))
	work := filepath.Join(o.root, "work", strconv.Itoa(o.n))
	for _, d := range []string{o.upper, work} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if len(lowers) == 0 {
		lowers = []string{filepath.Join(o.root, "empty")}
	}
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen overlay: %w", err)
	}
	defer unix.Close(fd)
	for _, l := range lowers {
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			return fmt.Errorf("overlay lowerdir+ %s: %w", l, err)
		}
	}
	if err := unix.FsconfigSetString(fd, "upperdir", o.upper); err != nil {
		return err
	}
	if err := unix.FsconfigSetString(fd, "workdir", work); err != nil {
		return err
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return fmt.Errorf("overlay create: %w", err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("fsmount: %w", err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, o.repo, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		return fmt.Errorf("move_mount: %w", err)
	}
	o.cur = lowers
	return nil
}

func (o *overlayBaseline) Checkpoint(ctx context.Context) (string, Cost, error) {
	start := time.Now()
	o.sh.kill()
	if err := unix.Unmount(o.repo, 0); err != nil {
		return "", Cost{}, fmt.Errorf("umount: %w", err)
	}
	frozen := append([]string{o.upper}, o.cur...)
	if o.cur[0] == filepath.Join(o.root, "empty") {
		frozen = []string{o.upper}
	}
	id := strconv.Itoa(len(o.stacks) + 1)
	o.stacks[id] = frozen
	err := o.mount(frozen)
	if err == nil {
		err = o.startShell(ctx)
	}
	d := time.Since(start)
	return id, Cost{Visible: d, Frozen: d, Decision: "full"}, err
}

func (o *overlayBaseline) Restore(ctx context.Context, id string) (Cost, error) {
	start := time.Now()
	o.sh.kill()
	if err := unix.Unmount(o.repo, 0); err != nil {
		return Cost{}, fmt.Errorf("umount: %w", err)
	}
	err := o.mount(o.stacks[id])
	if err == nil {
		err = o.startShell(ctx)
	}
	return Cost{Visible: time.Since(start), Decision: "full"}, err
}

func (o *overlayBaseline) Usage() Usage {
	return Usage{DiskBytes: duBytes(filepath.Join(o.root, "layers"))}
}

func (o *overlayBaseline) Close() error {
	o.sh.kill()
	_ = unix.Unmount(o.repo, unix.MNT_DETACH)
	return os.RemoveAll(o.root)
}

// fuseOverlayBaseline is fuse-overlayfs over an empty base with the upper
// copied (cp -a) at every checkpoint and copied back on restore.
type fuseOverlayBaseline struct {
	dirBase
	parent string
	upper  string
}

// NewFuseOverlayBaseline returns the fuse-overlayfs + copy baseline.
func NewFuseOverlayBaseline(parent string) Manager {
	return &fuseOverlayBaseline{dirBase: dirBase{name: "fuse-overlayfs-copy"}, parent: parent}
}

func (f *fuseOverlayBaseline) Start(ctx context.Context, setup []string) error {
	if _, err := exec.LookPath("fuse-overlayfs"); err != nil {
		return fmt.Errorf("fuse-overlayfs not installed (make deps)")
	}
	if err := f.init(f.parent); err != nil {
		return err
	}
	f.repo = filepath.Join(f.root, "repo")
	f.upper = filepath.Join(f.root, "upper")
	for _, d := range []string{f.repo, f.upper, filepath.Join(f.root, "lower"), filepath.Join(f.root, "work")} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return err
		}
	}
	if err := f.mount(); err != nil {
		return err
	}
	if err := f.startShell(ctx); err != nil {
		return err
	}
	return f.runSetup(ctx, setup)
}

func (f *fuseOverlayBaseline) mount() error {
	opts := fmt.Sprintf("lowerdir=%s,upperdir=%s,workdir=%s", filepath.Join(f.root, "lower"), f.upper, filepath.Join(f.root, "work"))
	return run("fuse-overlayfs", "-o", opts, f.repo)
}

func (f *fuseOverlayBaseline) Checkpoint(ctx context.Context) (string, Cost, error) {
	f.n++
	id := strconv.Itoa(f.n)
	start := time.Now()
	err := run("cp", "-a", f.upper, filepath.Join(f.root, "snaps", id))
	d := time.Since(start)
	return id, Cost{Visible: d, Frozen: d, Decision: "full"}, err
}

func (f *fuseOverlayBaseline) Restore(ctx context.Context, id string) (Cost, error) {
	start := time.Now()
	f.sh.kill()
	if err := run("fusermount3", "-u", f.repo); err != nil {
		_ = unix.Unmount(f.repo, unix.MNT_DETACH)
	}
	_ = os.RemoveAll(filepath.Join(f.root, "work"))
	_ = os.MkdirAll(filepath.Join(f.root, "work"), 0o755)
	err := os.RemoveAll(f.upper)
	if err == nil {
		err = run("cp", "-a", filepath.Join(f.root, "snaps", id), f.upper)
	}
	if err == nil {
		err = f.mount()
	}
	if err == nil {
		err = f.startShell(ctx)
	}
	return Cost{Visible: time.Since(start), Decision: "full"}, err
}

func (f *fuseOverlayBaseline) Close() error {
	f.sh.kill()
	if err := run("fusermount3", "-u", f.repo); err != nil {
		_ = unix.Unmount(f.repo, unix.MNT_DETACH)
	}
	return os.RemoveAll(f.root)
}
