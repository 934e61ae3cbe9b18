// Package layer defines rewind's on-disk layer format and the layer store
// shared by the FUSE backend (package fs) and the kernel path.
//
// A layer is a directory STATE/layers/<id>/ in overlayfs's own format, so a
// native overlayfs can mount the very same directories:
//
//   - a whiteout is a character device 0:0;
//   - an opaque directory carries the xattr trusted.overlay.opaque="y";
//   - a renamed directory carries trusted.overlay.redirect with the absolute
//     path (from the layer root) where its lower content lives, as overlayfs
//     writes it with redirect_dir=on.
//
// Modes, owners, times and xattrs are stored natively on the entries.
//
// A stack is an ordered list of frozen layers plus one writable upper. A
// frozen layer never changes. A checkpoint is a record id -> stack, written
// crash-safely (temp file, fsync, rename) under STATE/meta/checkpoints. Live
// mounts are recorded under STATE/meta/mounts so that garbage collection
// never frees a layer a mount still uses and a crashed mount can be resumed.
package layer

import (
	"github.com/rewind-sandbox/rewind/effect"
)

// Overlayfs xattrs used by the layer format.
const (
	XattrOpaque   = "trusted.overlay.opaque"
	XattrRedirect = "trusted.overlay.redirect"
	// XattrPrefixOverlay is the prefix reserved by overlayfs: such xattrs
	// are never shown to, nor settable from, inside a mount.
	XattrPrefixOverlay = "trusted.overlay."
)

// FS is a mounted rewind file system: the interface both backends (FUSE in
// package fs, native overlayfs in the kernel path) implement.
type FS interface {
	// MountID is the id of this mount in its store.
	MountID() string
	// Mountpoint is where the view is mounted.
	Mountpoint() string
	// Checkpoint freezes the writable upper as a new layer, pushes a fresh
	// upper and returns the new checkpoint's id. Its cost does not depend on
	// the number of files.
	Checkpoint() (string, error)
	// Switch makes the view equal to checkpoint id (of this mount) plus a
	// fresh upper, without unmounting. On error the view is unchanged.
	Switch(id string) error
	// Compact merges runs of frozen layers into single layers without
	// changing any checkpoint's content.
	Compact() error
	// TakeFSEffects returns the file-system effects observed since the
	// previous call and resets the counters.
	TakeFSEffects() effect.FS
	// Unmount unmounts the view and releases the mount's record.
	Unmount() error
}
