package kernelpath

import (
	"errors"
	"fmt"
	"os"
	"path"
	"path/filepath"
	"slices"
	"sort"
	"strings"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// errComplex aborts a compaction whose run uses a layout the merge does not
// model (a redirect path crossing another redirected, opaque or hidden
// directory). Nothing is changed then.
var errComplex = errors.New("layout too complex to merge safely")

// compactLocked merges (1) the frozen store layers under the live upper
// (the stack of the checkpoint the view was mounted from or switched to)
// into one layer, and (2) the chain of delta layers frozen from the live
// upper since into one layer, and rewrites every checkpoint record whose
// stack starts with a merged run: their content is unchanged. The live
// overlay keeps its layers (the mount record still references them, so GC
// cannot free them under it) until the next Switch.
func (f *FS) compactLocked() error {
	if f.freeze == FreezeIoctl {
		return nil // the ioctl path keeps the kernel's stack; not merged here
	}
	if len(f.layers) >= 2 {
		id, err := f.mergeRun(nil, f.layers)
		if err != nil {
			return fmt.Errorf("compact %s: %w", f.id, err)
		}
		if id != "" {
			f.layers = []string{id}
		}
	}
	if len(f.chain) >= 2 {
		id, err := f.mergeRun(f.layers, f.chain)
		if err != nil {
			return fmt.Errorf("compact %s: %w", f.id, err)
		}
		if id != "" {
			f.chain = []string{id}
		}
	}
	return nil
}

// mergeRun merges run (bottom first, stacked on below) into a new layer and
// rewrites the checkpoint records whose stack starts with below+run. It
// returns "" when the merge was skipped (errComplex).
func (f *FS) mergeRun(below, run []string) (string, error) {
	id := layer.NewID()
	tmp := filepath.Join(f.st.WorkDir(), "kp-compact-"+id)
	if err := os.Mkdir(tmp, 0o755); err != nil {
		return "", err
	}
	err := mergeLayers(f.st, run, tmp, f.freeze == FreezeReflink, f.fstype)
	if errors.Is(err, errComplex) {
		_ = os.RemoveAll(tmp)
		f.log.Info("kernelpath: compaction skipped", "mount", f.id, "reason", err)
		return "", nil
	}
	if err != nil {
		_ = os.RemoveAll(tmp)
		return "", err
	}
	size, _ := layer.DirSize(tmp)
	if err := f.st.AdoptLayer(id, tmp, layer.LayerMeta{ID: id, Created: time.Now().UTC(), Size: size}); err != nil {
		_ = os.RemoveAll(tmp)
		return "", err
	}
	prefix := append(append([]string(nil), below...), run...)
	cps, err := f.st.Checkpoints()
	if err != nil {
		return "", err
	}
	for _, c := range cps {
		if len(c.Layers) < len(prefix) || !slices.Equal(c.Layers[:len(prefix)], prefix) {
			continue
		}
		c.Layers = append(append(append([]string(nil), below...), id), c.Layers[len(prefix):]...)
		if err := f.st.SaveCheckpoint(c); err != nil {
			return "", err
		}
	}
	f.log.Info("kernelpath: compacted", "mount", f.id, "layers", len(run), "into", id)
	return id, nil
}

// merger writes one layer equivalent to a run of layers over anything
// below (overlayfs lookup semantics: whiteouts, opaque directories,
// absolute and relative redirects).
type merger struct {
	*treeCopier
	roots []int // layer root fds, topmost first
}

type msrc struct {
	k    int    // layer index (0 = topmost)
	path string // directory path inside that layer ("" = root)
}

func mergeLayers(st *layer.Store, run []string, dst string, reflink bool, fstype string) error {
	m := &merger{}
	defer func() {
		for _, fd := range m.roots {
			unix.Close(fd)
		}
	}()
	for i := len(run) - 1; i >= 0; i-- {
		fd, err := unix.Open(st.LayerPath(run[i]), unix.O_PATH|unix.O_DIRECTORY|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("open layer %s: %w", run[i], err)
		}
		m.roots = append(m.roots, fd)
	}
	dfd, err := unix.Open(dst, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return err
	}
	defer unix.Close(dfd)
	m.treeCopier = &treeCopier{reflink: reflink, dstRoot: dfd, links: map[uint64]string{}, fp: map[string]entryFP{},
		uid: uint32(os.Geteuid()), gid: uint32(os.Getegid()), umask: currentUmask(), noOvl: true}
	if !reflink || fstype != "btrfs" {
		m.small = smallFileXFS
	}
	srcs := make([]msrc, len(m.roots))
	for k := range m.roots {
		srcs[k] = msrc{k: k}
	}
	if err := m.dir(dfd, "", srcs, "", false); err != nil {
		return err
	}
	sfd, err := m.open(0, "", unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	var rs unix.Stat_t
	if err := unix.Fstat(sfd, &rs); err != nil {
		return err
	}
	return m.copyMeta(sfd, dfd, &rs)
}

// open opens p inside layer k, beneath its root, following no symlink.
func (m *merger) open(k int, p string, flags int) (int, error) {
	if p == "" {
		p = "."
	}
	return unix.Openat2(m.roots[k], p, &unix.OpenHow{
		Flags:   uint64(flags | unix.O_NOFOLLOW | unix.O_CLOEXEC),
		Resolve: unix.RESOLVE_BENEATH | unix.RESOLVE_NO_SYMLINKS | unix.RESOLVE_NO_MAGICLINKS,
	})
}

// stat looks p up in layer k.
func (m *merger) stat(k int, p string) (unix.Stat_t, bool, error) {
	var st unix.Stat_t
	fd, err := m.open(k, p, unix.O_PATH)
	if errors.Is(err, unix.ENOENT) || errors.Is(err, unix.ENOTDIR) {
		return st, false, nil
	}
	if err != nil {
		return st, false, fmt.Errorf("layer %d /%s: %w", k, p, err)
	}
	defer unix.Close(fd)
	if err := unix.Fstat(fd, &st); err != nil {
		return st, false, err
	}
	return st, true, nil
}

func (m *merger) flags(k int, p string) (bool, string, error) {
	fd, err := m.open(k, p, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return false, "", err
	}
	defer unix.Close(fd)
	o, r := dirFlags(fd)
	return o, r, nil
}

// plainDirs checks that every intermediate component of p in layer k is a
// plain directory or absent (the only case where a raw lookup of a redirect
// path matches overlayfs's); otherwise errComplex.
func (m *merger) plainDirs(k int, p string) error {
	parts := strings.Split(p, "/")
	for i := 1; i < len(parts); i++ {
		q := strings.Join(parts[:i], "/")
		st, ok, err := m.stat(k, q)
		if err != nil {
			return err
		}
		if !ok {
			return nil
		}
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			return errComplex
		}
		o, r, err := m.flags(k, q)
		if err != nil {
			return err
		}
		if o || r != "" {
			return errComplex
		}
	}
	return nil
}

func (m *merger) names(srcs []msrc) ([]string, error) {
	seen := map[string]bool{}
	var out []string
	for _, s := range srcs {
		fd, err := m.open(s.k, s.path, unix.O_RDONLY|unix.O_DIRECTORY)
		if err != nil {
			return nil, fmt.Errorf("layer %d /%s: %w", s.k, s.path, err)
		}
		d := os.NewFile(uintptr(fd), s.path)
		ns, err := d.Readdirnames(-1)
		d.Close()
		if err != nil {
			return nil, err
		}
		for _, n := range ns {
			if !seen[n] {
				seen[n] = true
				out = append(out, n)
			}
		}
	}
	sort.Strings(out)
	return out, nil
}

// lookup is the result of looking one name up through the run.
type lookup struct {
	kind     uint32 // file type found (0 = absent)
	wh       bool   // a whiteout hides the name
	fileK    int
	filePath string
	dirs     []msrc // directories merged, topmost first
	stop     bool   // descent stopped inside the run
	bpath    string // where lookups continue below the run
	abs      bool   // bpath comes from an absolute redirect
}

// step examines one candidate (layer k, path p); it returns true when the
// lookup ends there.
func (m *merger) step(r *lookup, k int, p string) (done bool, redirect string, err error) {
	st, ok, err := m.stat(k, p)
	if err != nil || !ok {
		return false, "", err
	}
	isDir := st.Mode&unix.S_IFMT == unix.S_IFDIR
	if !isDir {
		if len(r.dirs) == 0 {
			if st.Mode&unix.S_IFMT == unix.S_IFCHR && st.Rdev == 0 {
				r.wh = true
			} else {
				r.kind, r.fileK, r.filePath = st.Mode&unix.S_IFMT, k, p
			}
		} else {
			r.stop = true
		}
		return true, "", nil
	}
	r.kind = unix.S_IFDIR
	r.dirs = append(r.dirs, msrc{k: k, path: p})
	o, rd, err := m.flags(k, p)
	if err != nil {
		return false, "", err
	}
	if o {
		r.stop = true
		return true, "", nil
	}
	return false, rd, nil
}

func (m *merger) lookupName(srcs []msrc, name, bpath string) (*lookup, error) {
	r := &lookup{bpath: join(bpath, name)}
	redirect, at := "", -1
	for i, s := range srcs {
		done, rd, err := m.step(r, s.k, join(s.path, name))
		if err != nil {
			return nil, err
		}
		if done {
			return r, nil
		}
		if rd != "" {
			redirect, at = rd, i
			break
		}
	}
	if redirect == "" {
		return r, nil
	}
	if !strings.HasPrefix(redirect, "/") {
		// Relative: the same parent in lower layers, another name.
		if strings.Contains(redirect, "/") {
			return nil, errComplex
		}
		r.bpath = join(bpath, redirect)
		for _, s := range srcs[at+1:] {
			done, rd, err := m.step(r, s.k, join(s.path, redirect))
			if err != nil {
				return nil, err
			}
			if done {
				return r, nil
			}
			if rd != "" {
				return nil, errComplex
			}
		}
		return r, nil
	}
	rp := strings.TrimPrefix(path.Clean(redirect), "/")
	if rp == "" || rp == "." {
		return nil, errComplex
	}
	r.bpath, r.abs = rp, true
	for k := srcs[at].k + 1; k < len(m.roots); k++ {
		if err := m.plainDirs(k, rp); err != nil {
			return nil, err
		}
		done, rd, err := m.step(r, k, rp)
		if err != nil {
			return nil, err
		}
		if done {
			return r, nil
		}
		if rd != "" {
			return nil, errComplex
		}
	}
	return r, nil
}

// dir fills the merged directory dst (at mpath) from the directories srcs;
// bpath is where its lookups continue below the run, bstop whether they do
// not.
func (m *merger) dir(dst int, mpath string, srcs []msrc, bpath string, bstop bool) error {
	names, err := m.names(srcs)
	if err != nil {
		return err
	}
	for _, name := range names {
		rel := join(mpath, name)
		r, err := m.lookupName(srcs, name, bpath)
		if err != nil {
			return err
		}
		switch {
		case r.wh:
			if !bstop {
				if err := unix.Mknodat(dst, name, unix.S_IFCHR, 0); err != nil {
					return fmt.Errorf("/%s: whiteout: %w", rel, err)
				}
			}
		case r.kind == 0:
		case r.kind != unix.S_IFDIR:
			pfd, err := m.open(r.fileK, path.Dir(r.filePath), unix.O_RDONLY|unix.O_DIRECTORY)
			if err != nil {
				return err
			}
			err = m.copyEntry(pfd, dst, name, rel)
			unix.Close(pfd)
			if err != nil {
				return fmt.Errorf("/%s: %w", rel, err)
			}
		default:
			childStop := r.stop || (bstop && !r.abs)
			if err := unix.Mkdirat(dst, name, 0o700); err != nil {
				return fmt.Errorf("/%s: %w", rel, err)
			}
			cfd, err := unix.Openat(dst, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
			if err != nil {
				return err
			}
			err = m.dir(cfd, rel, r.dirs, r.bpath, childStop)
			if err == nil {
				err = m.dirMeta(cfd, r, name, bpath, bstop)
			}
			unix.Close(cfd)
			if err != nil {
				return err
			}
		}
	}
	return nil
}

// dirMeta copies the topmost directory's metadata and sets the flags that
// make the merged directory behave like the run.
func (m *merger) dirMeta(dfd int, r *lookup, name, parentB string, parentStop bool) error {
	top := r.dirs[0]
	sfd, err := m.open(top.k, top.path, unix.O_RDONLY|unix.O_DIRECTORY)
	if err != nil {
		return err
	}
	defer unix.Close(sfd)
	var st unix.Stat_t
	if err := unix.Fstat(sfd, &st); err != nil {
		return err
	}
	if err := m.copyMeta(sfd, dfd, &st); err != nil {
		return err
	}
	switch {
	case r.stop && (!parentStop || r.abs):
		if err := unix.Fsetxattr(dfd, layer.XattrOpaque, []byte("y"), 0); err != nil {
			return fmt.Errorf("set opaque: %w", err)
		}
	case r.stop:
	case r.abs || (r.bpath != join(parentB, name) && !parentStop):
		if err := unix.Fsetxattr(dfd, layer.XattrRedirect, []byte("/"+r.bpath), 0); err != nil {
			return fmt.Errorf("set redirect: %w", err)
		}
	}
	return nil
}
