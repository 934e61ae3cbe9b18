package fs

import "github.com/rewind-sandbox/rewind/layer"

// inheritRootMeta gives the upper of st the root attributes of the layer
// below it (st.top[1]; nothing to do without one): the view's root
// attributes are its upper's root directory's, as in overlayfs, so an upper
// pushed by a checkpoint or a switch, or made for a new mount over lowers,
// must carry them (layer.CopyRootAttrs). The caller holds f.mu for writing
// (or owns st alone).
//
// A store layer below never changes once frozen: its attributes are read
// once (rootAttrs), and an upper given them already — a switch keeps an
// upper that received nothing, not even a change of its root — is not
// written again. An external lower (the host's directory) is read every
// time.
func inheritRootMeta(st *stack) error {
	if len(st.top) < 2 {
		return nil
	}
	from, up := st.top[1], st.upper
	if from.id == "" {
		up.rootFrom.Store(nil)
		return layer.CopyRootAttrs(from.path, up.path)
	}
	if up.rootFrom.Load() == from {
		return nil
	}
	a, err := from.rootAttrs()
	if err != nil {
		return err
	}
	up.rootFrom.Store(nil)
	if err := a.Apply(up.path); err != nil {
		return err
	}
	up.rootFrom.Store(from)
	return nil
}

// rootAttrs returns the root attributes of frozen store layer l, read on
// first use.
func (l *layerDir) rootAttrs() (layer.RootAttrs, error) {
	l.rootMu.Lock()
	defer l.rootMu.Unlock()
	if l.rootRead {
		return l.root, nil
	}
	a, err := layer.ReadRootAttrs(l.path)
	if err != nil {
		return a, err
	}
	l.root, l.rootRead = a, true
	return a, nil
}
