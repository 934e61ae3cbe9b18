// Package kernelpath is rewind's kernel fast path: the sandbox view is a
// native overlayfs mounted over the very layer directories of the state dir
// (STATE/layers/<id>/, the format package layer defines), so data and
// metadata I/O run at kernel speed with no FUSE round trip. *FS implements
// layer.FS, and a state dir written by this backend opens with the FUSE
// backend (package fs) and the other way round.
//
// Two ways to checkpoint and switch, chosen at Mount:
//
//   - Patched overlayfs with the layer-switch ioctl (ABI.md): Checkpoint
//     freezes the upper into a lower and pushes a fresh upper inside the
//     kernel; Switch replaces the stack in place. Open fds and cwds of live
//     processes follow (lazy redirection by a generation counter).
//   - Stock overlayfs (this host): the live upper cannot be swapped, so
//     Checkpoint copies the upper's entries changed since the previous
//     checkpoint (named by fanotify events on the upper's directories, no
//     walk of the upper; track_linux.go) into a new delta layer stacked on that checkpoint's
//     layers (a full copy of the upper every 16th time, bounding the
//     chain). Data is reflinked (FICLONE) on XFS or btrfs, so the cost
//     grows with the number of entries changed, not with their size; it is
//     copied elsewhere (FreezeMode says which). Only the reading of the
//     upper happens inside the sandbox's freeze window; the layer is
//     written after Checkpoint returns (finish_linux.go). The live mount is not
//     touched, so open fds and cwds stay valid and keep writing to the live
//     upper, which is what a checkpoint of a running sandbox needs. Switch
//     mounts a new overlay over the target stack with a fresh upper beneath
//     the old mount (MOVE_MOUNT_BENEATH) and lazily detaches the old one:
//     the view changes atomically for new lookups, but processes that still
//     hold fds or a cwd on the old mount keep seeing the old tree. That is
//     why the patched ioctl exists. The daemon makes it correct for a
//     sandbox: a clone of the new overlay becomes the root of the sandbox's
//     mount namespace (sandbox.ReplaceRoot: its /proc, /dev and other
//     mounts cloned onto it, pivot_root, the old root lazily detached), and
//     every restore re-creates the processes on it (cr's
//     RestoreOptions.Reroot: template copies re-enter their working
//     directory and reopen their files by path; criu dumps what they keep
//     of the old view, their executable and mappings, as externals); it
//     never switches under running processes. Compact merges the layers under the live upper into one
//     (overlayfs semantics: whiteouts, opaque and redirected directories)
//     and rewrites the checkpoint records that use them.
//
// btrfs subvolume snapshots were measured and rejected as the freeze
// mechanism (SelfTest measures them again on every btrfs host, for
// `rewind doctor`):
//
//   - overlayfs needs its workdir in the upper's subvolume: copy-up and
//     whiteouts rename from the workdir into the upper, and btrfs refuses
//     renames across subvolumes (EXDEV, measured). The upper can therefore
//     not be a subvolume's root, and a snapshot's root cannot be a layer
//     (STATE/layers/<id>/ is the layer's root) without changing the
//     shared layer format;
//   - overlayfs treats every subvolume of one btrfs as one file system
//     and reports the real inode numbers, which collide across subvolumes
//     (st_dev/st_ino duplicates break tar, cp -a, du and find's loop
//     detection);
//   - a snapshot is O(1) in the entries but commits a btrfs transaction
//     with a device flush: 2-6 ms p50 on a loop image here (0.7 ms with
//     nobarrier), about what the reflink delta costs at 100 entries
//     (1.6-2.8 ms); it would win from a few hundred changed entries on
//     (the 1000-entry delta costs 17-28 ms), were it not for the two
//     points above.
//
// All layers therefore live in one directory tree.
//
// Layers are mounted with the new mount API (fsopen/fsconfig with one
// "lowerdir+" per layer), so deep stacks (up to overlayfs's 500 layers)
// never hit the page-sized limit of a mount option string.
package kernelpath

import (
	"errors"
	"log/slog"
	"time"
)

// Options configures Mount. MountID, From and Lowers mean what they mean
// for the FUSE backend (fs.Options).
type Options struct {
	// MountID is unique per live mount in the store ("" = random).
	MountID string
	// From is the checkpoint to start from ("" = fresh view).
	From string
	// Lowers are read-only base directories, topmost first (overlayfs
	// lowerdir order). Ignored when From is set: the checkpoint records
	// its own.
	Lowers []string
	// Freeze forces the stock-kernel freeze mode: "" (auto), FreezeReflink
	// or FreezeCopy. Tests and benchmarks use it.
	Freeze string
	// SyncCheckpoint makes Checkpoint sync the state dir's file system and
	// the record before returning (power-loss durability). By default the
	// record is rename-atomic (a process crash never loses it) and synced
	// in the background.
	SyncCheckpoint bool
	// NoTrack disables the change tracking of the upper (fanotify): every
	// incremental stock-kernel checkpoint then walks the whole upper.
	// Benchmarks and tests compare the two.
	NoTrack bool
	// NoIoctl disables the patched-kernel layer-switch ioctl even when the
	// probe finds it.
	NoIoctl bool
	// Logger receives operational logs (default slog.Default()).
	Logger *slog.Logger
}

// Freeze modes reported by (*FS).FreezeMode.
const (
	// FreezeIoctl: the patched kernel's layer-switch ioctl.
	FreezeIoctl = "ioctl"
	// FreezeReflink: entries of the upper are reflinked (FICLONE) into the
	// frozen layer; data is shared, only metadata is written.
	FreezeReflink = "reflink"
	// FreezeCopy: entries are copied (copy_file_range); the state dir's
	// file system has no reflink, so cost grows with the data changed.
	FreezeCopy = "copy"
)

// ErrIoctlAbsent is returned (wrapped) by ProbeSwitchIoctl on a kernel
// without the layer-switch ioctl.
var ErrIoctlAbsent = errors.New("overlayfs layer-switch ioctl absent (stock kernel)")

// ErrUnsupported is returned on platforms without overlayfs.
var ErrUnsupported = errors.New("kernelpath: native overlayfs is Linux-only")

// Report is the result of SelfTest: what the kernel path can do on this
// host and how fast, for `rewind doctor` and the backend choice.
type Report struct {
	// FSType is the state dir's file system ("xfs", "btrfs", "ext4", ...).
	FSType string `json:"fs_type"`
	// Freeze is the checkpoint mode the kernel path would use.
	Freeze string `json:"freeze"`
	// Ioctl reports whether the layer-switch ioctl is present.
	Ioctl bool `json:"ioctl"`
	// Entries is the size of the delta checkpointed by the self-test.
	Entries int `json:"entries"`
	// Checkpoint and Switch are the median latencies measured.
	Checkpoint time.Duration `json:"checkpoint_ns"`
	Switch     time.Duration `json:"switch_ns"`
	// Snapshot is, on btrfs, the median cost of a read-only subvolume
	// snapshot after an Entries-file delta: the alternative freeze, which
	// the kernel path measures but does not use (see the package doc).
	Snapshot time.Duration `json:"btrfs_snapshot_ns,omitempty"`
	// LiveFDsFollow reports whether open fds of live processes follow a
	// Switch (true only with the ioctl).
	LiveFDsFollow bool `json:"live_fds_follow"`
	// Detail explains the result in one line.
	Detail string `json:"detail"`
}

// DefaultStoreConfig is where `rewind init-store` persists the state dir's
// loop mount; the daemon reads it at start and calls EnsureStore.
const DefaultStoreConfig = "/etc/rewind/store.json"

// MinImageSize is the smallest image init-store creates (mkfs.xfs needs
// about 300 MiB).
const MinImageSize = 512 << 20

// StoreImage is what `rewind init-store` asks for.
type StoreImage struct {
	// Image is the image file (created sparse if absent).
	Image string
	// FS is "xfs" (made with reflink=1) or "btrfs".
	FS string
	// Size is the image size in bytes (used only when creating it).
	Size int64
	// StateDir is where the image is mounted (the daemon's state dir).
	StateDir string
	// ConfigPath is where the config is written ("" = don't write).
	ConfigPath string
}

// StoreConfig is the persisted store config (JSON, version 1):
//
//	{"version":1,"state_dir":"/var/lib/rewind","image":"/var/lib/rewind.img","fs":"xfs","created":"..."}
type StoreConfig struct {
	Version  int       `json:"version"`
	StateDir string    `json:"state_dir"`
	Image    string    `json:"image"`
	FS       string    `json:"fs"`
	Created  time.Time `json:"created"`
}
