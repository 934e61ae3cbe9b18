package conformance

import (
	"fmt"
	"log/slog"
	"os"
	"os/exec"
	"path/filepath"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/fs"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"github.com/rewind-sandbox/rewind/layer"
)

// target is one implementation the workload runs on: the reference model
// or a file-system path.
type target interface {
	name() string
	ops() *opState
	checkpoint(label string) error
	restore(label string, s Step) error
	fork(label, view string) error
	setView(view string) error
	// compact merges layers without changing any checkpoint's content.
	compact() error
	// applies reports whether exception ex changes this target's
	// behaviour (a model variant reproduces it; a real path exhibits it).
	applies(ex string) bool
	close() error
}

// hiddenDir holds, in a model variant, the extra links that reproduce a
// lower inode's link count (ExHardlinkCopyUp). It is excluded from the
// model's digest and never exists in a real path.
const hiddenDir = ".conformance-hidden"

// model is the reference: a plain directory per view, a full copy per
// checkpoint label. A variant (exceptions non-empty) reproduces the
// documented behaviour of one path at the steps that name it.
type model struct {
	label   string
	dir     string
	views   map[string]*opState
	cur     string
	saved   map[string]string
	forPath string          // path whose exceptions this variant reproduces ("" = canonical)
	exc     map[string]bool // exceptions reproduced
	nsave   int
}

func newModel(dir, forPath string, exc map[string]bool) (*model, error) {
	m := &model{label: "model", dir: dir, views: map[string]*opState{}, cur: "main", saved: map[string]string{}, forPath: forPath, exc: exc}
	if forPath != "" {
		m.label = "model/" + forPath
	}
	live := filepath.Join(dir, "view-main")
	if err := os.MkdirAll(live, 0o755); err != nil {
		return nil, fmt.Errorf("model: %w", err)
	}
	m.views["main"] = &opState{root: live, fds: map[string]*heldFD{}}
	return m, nil
}

func (m *model) name() string  { return m.label }
func (m *model) ops() *opState { return m.views[m.cur] }
func (m *model) applies(ex string) bool {
	return m.exc[ex]
}

// copyTree copies src's content into dst (which must exist) preserving
// modes, owners, xattrs, hard links, sparse holes and special files.
func copyTree(src, dst string) error {
	out, err := exec.Command("cp", "-a", "--sparse=always", "--", src+"/.", dst).CombinedOutput()
	if err != nil {
		return fmt.Errorf("cp -a %s: %v: %s", src, err, out)
	}
	return nil
}

func clearDir(dir string) error {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	for _, e := range ents {
		if err := os.RemoveAll(filepath.Join(dir, e.Name())); err != nil {
			return err
		}
	}
	return nil
}

func (m *model) checkpoint(label string) error {
	m.nsave++
	dst := filepath.Join(m.dir, fmt.Sprintf("ckpt-%d", m.nsave))
	if err := os.Mkdir(dst, 0o755); err != nil {
		return err
	}
	if err := copyTree(m.ops().root, dst); err != nil {
		return err
	}
	if old, ok := m.saved[label]; ok {
		_ = os.RemoveAll(old)
	}
	m.saved[label] = dst
	return nil
}

func (m *model) restore(label string, s Step) error {
	o := m.ops()
	if err := clearDir(o.root); err != nil {
		return fmt.Errorf("model restore: %w", err)
	}
	if err := copyTree(m.saved[label], o.root); err != nil {
		return fmt.Errorf("model restore: %w", err)
	}
	if !(m.exc[ExFDKeepsOldView] && s.Except[m.forPath] == ExFDKeepsOldView) {
		o.reopenFDs()
	}
	return nil
}

func (m *model) fork(label, view string) error {
	if _, ok := m.views[view]; ok {
		return fmt.Errorf("view %q exists", view)
	}
	root := filepath.Join(m.dir, "view-"+view)
	if err := os.Mkdir(root, 0o755); err != nil {
		return err
	}
	if err := copyTree(m.saved[label], root); err != nil {
		return err
	}
	m.views[view] = &opState{root: root, fds: map[string]*heldFD{}}
	m.cur = view
	return nil
}

func (m *model) compact() error { return nil }

func (m *model) setView(view string) error {
	if _, ok := m.views[view]; !ok {
		return fmt.Errorf("no view %q", view)
	}
	m.cur = view
	return nil
}

func (m *model) close() error {
	for _, v := range m.views {
		v.closeFDs()
	}
	return nil
}

// beforeStep lets a model variant reproduce an exception named by s.
func (m *model) beforeStep(s Step) error {
	ex := s.Except[m.forPath]
	if m.forPath == "" || !m.exc[ex] || (ex != ExHardlinkCopyUp && ex != ExUnlinkLowerNlink) {
		return nil
	}
	// ExHardlinkCopyUp: break the link of s.Path: the name gets a private
	// copy; the old inode keeps its link count through a hidden name. For
	// rm, only the
	// hidden name (ExUnlinkLowerNlink): removing one name of a lower
	// inode leaves the other names' link count unchanged.
	o := m.ops()
	p := filepath.Join(o.root, s.Path)
	var st unix.Stat_t
	if err := unix.Lstat(p, &st); err != nil || st.Mode&unix.S_IFMT != unix.S_IFREG || st.Nlink < 2 {
		return nil
	}
	hidden := filepath.Join(o.root, hiddenDir)
	if err := os.MkdirAll(hidden, 0o700); err != nil {
		return err
	}
	m.nsave++
	if err := os.Link(p, filepath.Join(hidden, fmt.Sprintf("l%d", m.nsave))); err != nil {
		return err
	}
	if ex == ExUnlinkLowerNlink {
		return nil
	}
	tmp := filepath.Join(hidden, fmt.Sprintf("c%d", m.nsave))
	if out, err := exec.Command("cp", "-a", "--sparse=always", "--", p, tmp).CombinedOutput(); err != nil {
		return fmt.Errorf("cp: %v: %s", err, out)
	}
	return os.Rename(tmp, p)
}

// mountFunc mounts a view of a layer store.
type mountFunc func(st *layer.Store, mp, mountID, from string) (layer.FS, error)

// fsView is one mounted view of a file-system path.
type fsView struct {
	fs  layer.FS
	ops *opState
}

// fsTarget runs a workload on one rewind file-system path (FUSE or
// kernel) over its own layer store.
type fsTarget struct {
	label  string
	dir    string
	store  *layer.Store
	mount  mountFunc
	views  map[string]*fsView
	cur    string
	labels map[string]string // label -> checkpoint id
	exc    map[string]bool
	nmount int
}

func newFSTarget(label, dir string, mount mountFunc, exc map[string]bool) (*fsTarget, error) {
	st, err := layer.OpenStore(filepath.Join(dir, "state"))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", label, err)
	}
	t := &fsTarget{label: label, dir: dir, store: st, mount: mount, views: map[string]*fsView{}, cur: "main", labels: map[string]string{}, exc: exc}
	v, err := t.mountView("")
	if err != nil {
		return nil, err
	}
	t.views["main"] = v
	return t, nil
}

func (t *fsTarget) mountView(from string) (*fsView, error) {
	t.nmount++
	mp := filepath.Join(t.dir, fmt.Sprintf("mnt-%d", t.nmount))
	if err := os.Mkdir(mp, 0o755); err != nil {
		return nil, fmt.Errorf("%s: %w", t.label, err)
	}
	f, err := t.mount(t.store, mp, fmt.Sprintf("conf-%d", t.nmount), from)
	if err != nil {
		return nil, fmt.Errorf("%s: mount: %w", t.label, err)
	}
	return &fsView{fs: f, ops: &opState{root: mp, fds: map[string]*heldFD{}}}, nil
}

func (t *fsTarget) name() string           { return t.label }
func (t *fsTarget) ops() *opState          { return t.views[t.cur].ops }
func (t *fsTarget) applies(ex string) bool { return t.exc[ex] }

func (t *fsTarget) checkpoint(label string) error {
	id, err := t.views[t.cur].fs.Checkpoint()
	if err != nil {
		return err
	}
	t.labels[label] = id
	return nil
}

func (t *fsTarget) restore(label string, _ Step) error {
	id := t.labels[label]
	v := t.views[t.cur]
	c, err := t.store.Checkpoint(id)
	if err != nil {
		return err
	}
	if c.Mount == v.fs.MountID() {
		return v.fs.Switch(id)
	}
	// A checkpoint of another view: replace this view by a mount of it
	// (what the daemon does for a restore across a fork).
	v.ops.closeFDs()
	if err := v.fs.Unmount(); err != nil {
		return err
	}
	nv, err := t.mountView(id)
	if err != nil {
		return err
	}
	t.views[t.cur] = nv
	return nil
}

func (t *fsTarget) fork(label, view string) error {
	if _, ok := t.views[view]; ok {
		return fmt.Errorf("view %q exists", view)
	}
	v, err := t.mountView(t.labels[label])
	if err != nil {
		return err
	}
	t.views[view] = v
	t.cur = view
	return nil
}

func (t *fsTarget) compact() error { return t.views[t.cur].fs.Compact() }

func (t *fsTarget) setView(view string) error {
	if _, ok := t.views[view]; !ok {
		return fmt.Errorf("no view %q", view)
	}
	t.cur = view
	return nil
}

func (t *fsTarget) close() error {
	var first error
	for _, v := range t.views {
		v.ops.closeFDs()
		if err := v.fs.Unmount(); err != nil && first == nil {
			first = fmt.Errorf("%s: unmount: %w", t.label, err)
			_ = unix.Unmount(v.fs.Mountpoint(), unix.MNT_DETACH)
		}
	}
	return first
}

// FUSE and kernel mount functions.

func fuseMount(log *slog.Logger) mountFunc {
	return func(st *layer.Store, mp, id, from string) (layer.FS, error) {
		return fs.Mount(st, mp, fs.Options{MountID: id, From: from, NoOpen: true, Logger: log})
	}
}

func kernelMount(log *slog.Logger) mountFunc {
	return func(st *layer.Store, mp, id, from string) (layer.FS, error) {
		return kernelpath.Mount(st, mp, kernelpath.Options{MountID: id, From: from, Logger: log})
	}
}
