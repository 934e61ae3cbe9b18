package conformance

// Exception is a documented, legitimate difference of one path from the
// reference semantics. A workload step opts into it explicitly with
// "except": {"<path>": "<exception>"}; the runner then compares that path
// against a variant of the reference model that reproduces the documented
// behaviour at that step only. The digest itself is never weakened.
type Exception struct {
	// Paths are the paths ("kernel", "fuse") the exception applies to.
	Paths []string
	// Summary explains the kernel or implementation behaviour.
	Summary string
}

// Names of the exceptions.
const (
	// ExHardlinkCopyUp: see Exceptions.
	ExHardlinkCopyUp = "hardlink-copyup"
	// ExFDKeepsOldView: see Exceptions.
	ExFDKeepsOldView = "fd-keeps-old-view"
	// ExUnlinkLowerNlink: see Exceptions.
	ExUnlinkLowerNlink = "unlink-lower-nlink"
)

// Exceptions lists every exception a workload may name.
var Exceptions = map[string]Exception{
	ExHardlinkCopyUp: {
		Paths: []string{"kernel"},
		Summary: "native overlayfs (index=off) breaks a hard link when one name of a file in a " +
			"lower layer is copied up: the written name becomes a new inode with one link, the other " +
			"names keep the lower inode (whose link count still includes the lost name). The FUSE " +
			"backend copies up every name of the link group and keeps them linked. On the kernel path " +
			"(stock kernel) files live in lower layers after a restore or fork; links made since " +
			"the last restore are in the writable upper and stay linked across checkpoints.",
	},
	ExFDKeepsOldView: {
		Paths: []string{"kernel"},
		Summary: "on a stock kernel (no layer-switch ioctl) a restore mounts a new overlay beneath " +
			"the old one and detaches the old one lazily: a file descriptor opened before the restore " +
			"keeps reading and writing the OLD view, and its writes never appear in the restored " +
			"tree. The FUSE backend (and the patched kernel) redirect such descriptors to the same " +
			"path in the new view. rewind's restore re-creates the processes, so no live descriptor " +
			"survives a real restore; the difference only shows when the host keeps one open.",
	},
	ExUnlinkLowerNlink: {
		Paths: []string{"kernel"},
		Summary: "removing one name of a hard-linked file that lives in a lower layer writes a " +
			"whiteout; the lower inode keeps its link count, so the remaining names still report " +
			"the removed name in st_nlink (overlayfs semantics). A plain directory and the FUSE " +
			"backend decrement it.",
	},
}
