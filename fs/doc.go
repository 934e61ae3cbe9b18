// Package fs is rewind's userspace DeltaFS: an overlay file system served
// with go-fuse v2 over the layer format of package layer, with O(1)
// checkpoints (freeze the upper, push a fresh one) and in-place switches of
// the whole layer stack (restore) without unmounting.
//
// # Why the go-fuse fs (node) API and not the raw API
//
// The node API keeps the kernel's view of the tree (Inode objects, lookup
// counts, forgets, hard-link identity by StableAttr.Ino) for us, and exposes
// exactly the notification primitives a switch needs on those nodes
// (NotifyEntry, NotifyContent). The overlay logic itself - which layer an
// entry lives in - is ours and is not tied to the kernel's node lifetime:
// every node carries its resolution (the list of layer sources, top-down)
// stamped with a generation number; a checkpoint or a switch bumps the
// generation and nodes re-resolve lazily on their next use (DeltaBox's lazy
// fd redirection). The raw API would make us re-implement node bookkeeping
// with no gain: the cost that matters (lookups across many layers, copy-up,
// kernel caching) is in the overlay logic, not in the bridge.
//
// # Semantics
//
// Lookup walks the stack top-down: a whiteout (char device 0:0) hides, an
// opaque directory (trusted.overlay.opaque=y) stops the descent, a
// redirected directory (trusted.overlay.redirect) continues in lower layers
// at the redirect path. Readdir merges and de-duplicates. Inode numbers are
// allocated per mount and keyed by (layer, backing inode), so they are
// stable for the life of the mount, across checkpoints and copy-ups.
//
// Copy-up happens on the first data or metadata change of an entry that is
// not in the writable upper: FICLONE when the store's file system supports
// it, else copy_file_range, into an O_TMPFILE linked into place, preserving
// mode, owner, times and xattrs. A file handle records the layer its host
// fd lives in; a write through a handle whose fd is in a frozen layer first
// copies the file up into the current upper and reopens it there, so a
// frozen layer is never written.
//
// Kernel caching is on (long entry/attr/negative timeouts, keep_cache,
// cached readdir); correctness across a switch comes from explicit
// invalidation of exactly the paths the layers above the common ancestor
// touch (directories that stay directories keep their dentry, so cwds and
// mounts on top survive a switch).
//
// # Round trips
//
// On a small VM a FUSE round trip costs tens of microseconds, far more
// than the work behind most requests, so the mount avoids the ones the
// kernel can do without: files are opened with FOPEN_NOFLUSH (no FLUSH
// per close; writes reach the host at once), SETATTR replies carry the
// attr timeout (no GETATTR after chmod/utimens), and the mount negotiates
// FUSE_HANDLE_KILLPRIV_V2, so the kernel asks for security.capability
// once per inode rather than before every write(2) and does not re-read
// attributes before a chown; dropping setuid/setgid bits on a write or
// truncate by a caller without CAP_FSETID is then done by the daemon
// (file capabilities are dropped by the host on every write, truncate
// and chown of the upper copy). FS.RequestCounts counts what remains, by
// opcode. What still costs a round trip on every file, all of it asked by
// the kernel (6.18): the LOOKUP before a CREATE (a new name has no
// dentry; misses are cached as negative entries, and a switch invalidates
// those of the paths it changes like any other), the parent directory's
// GETATTR after it (fuse_dir_changed invalidates the directory's mode and
// owner with the rest, and default_permissions re-reads them before the
// next permission check; without default_permissions the kernel would
// check nothing on cached dentries at all), the security.capability
// check on a new file's first write (S_NOSEC is only learned that way)
// and the one before every chown.
//
// # Checkpoint cost
//
// Checkpoint takes the write barrier, swaps a pre-created empty upper in,
// bumps the generation and appends one line to the mount's journal (the
// commit point); the checkpoint record file, its fsync and the next spare
// upper are written by a background worker. Frozen layers never change, so
// their directory listings and entries are cached in memory: re-resolving
// after a checkpoint, or looking up through hundreds of layers, costs map
// lookups rather than system calls.
//
// # Passthrough (Options.Passthrough)
//
// The kernel fixes an inode's io mode while any file is open on it, and a
// passthrough backing file cannot be re-targeted. Passthrough is therefore
// only used for files whose data is in the writable upper (and, when
// opened for writing, that are neither setuid nor setgid: a passthrough
// write never reaches the daemon, which drops those bits; such an open
// waits up to 200 ms for the RELEASE of a passthrough handle closed just
// before it, and a write through a passthrough handle that stays open
// while the file becomes setuid keeps the bit), and the
// checkpoint and switch paths move such a file's live inode into the new
// upper (copying its content into the frozen layer, resp. the target's
// content into it; the inode's other names are relinked on both sides):
// descriptors behave exactly as without passthrough, at a cost
// proportional to the size of the files held open that way.
//
// Options.PassthroughLower also passes read-only opens of files in frozen
// and lower layers through, to the layer's own file: no daemon round trip
// per read, and the host's page cache is shared by every mount of the
// layer (a fork reads a base-image file at native speed instead of
// through a cold FUSE page cache). The kernel then requires every open of
// that inode to use the same backing file, so the node is pinned to it:
// once the name resolves to another file (a copy-up by a write or a
// metadata change, a switch), an open through the pinned node fails with
// ESTALE, the kernel's open retries with LOOKUP_REVAL (do_filp_open), and
// the lookup hands out a new node for the name (same inode number, next
// generation). A descriptor opened that way keeps reading the content it
// was opened on across a copy-up and across a switch, as on overlayfs
// (the conformance exception fd-keeps-old-view); that is why it is an
// option, off by default.
package fs
