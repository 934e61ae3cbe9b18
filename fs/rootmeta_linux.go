package fs

import "github.com/rewind-sandbox/rewind/layer"

// inheritRootMeta gives the upper of st the root attributes of the layer
// below it (st.top[1]; nothing to do without one): the view's root
// attributes are its upper's root directory's, as in overlayfs, so an upper
// pushed by a checkpoint or a switch, or made for a new mount over lowers,
// must carry them (layer.CopyRootAttrs). The caller holds f.mu for writing
// (or owns st alone).
func inheritRootMeta(st *stack) error {
	if len(st.top) < 2 {
		return nil
	}
	return layer.CopyRootAttrs(st.top[1].path, st.upper.path)
}
