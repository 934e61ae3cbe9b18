// Package tree takes a canonical snapshot of a directory tree — paths, types,
// modes, owners, sizes, content hashes, symlink targets, xattrs, hard-link
// groups and (optionally) times — and compares two snapshots. The conformance
// suite, the fs differential tests and the kernel-path tests use it to decide
// whether two paths reached identical state.
//
// A snapshot never follows a symlink: entries are opened with O_NOFOLLOW
// relative to their parent directory, so a hostile tree cannot make it read
// outside the root.
package tree

import (
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"sort"
	"strings"
)

// Entry describes one path of a tree.
type Entry struct {
	// Path is slash-separated and relative to the root ("" for the root).
	Path string
	// Type is one of "dir", "file", "symlink", "fifo", "socket", "chardev",
	// "blockdev".
	Type string
	// Mode holds the permission bits, setuid, setgid and sticky.
	Mode     uint32
	UID, GID uint32
	// Size is the byte size of regular files and symlink targets.
	Size int64
	// Hash is the SHA-256 of a regular file's content, hex-encoded.
	Hash string
	// Target is a symlink's target.
	Target string
	// Rdev is the device number of character and block devices.
	Rdev uint64
	// Xattrs holds the extended attributes selected by Options.XattrPrefixes.
	Xattrs map[string]string
	// Nlink is the link count of non-directories (0 when ignored).
	Nlink uint64
	// LinkGroup is the smallest path of the hard-link group of a regular file
	// with Nlink > 1 within the tree, so linked-ness is compared by structure,
	// not by inode number.
	LinkGroup string
	// MtimeNS is the modification time in nanoseconds (0 unless
	// Options.Times).
	MtimeNS int64
}

// Options selects what a snapshot records.
type Options struct {
	// XattrPrefixes selects the xattrs recorded (default: "user.").
	XattrPrefixes []string
	// IgnoreNlink leaves Nlink and LinkGroup empty.
	IgnoreNlink bool
	// Times records modification times of non-directories.
	Times bool
	// Exclude lists relative paths (and everything below them) to skip.
	Exclude []string
	// IgnoreRoot leaves the root directory itself out (mount points often
	// differ in mode and owner).
	IgnoreRoot bool
}

// Snapshot is a canonical, sorted list of entries.
type Snapshot []Entry

// String renders one entry on one line.
func (e Entry) String() string {
	var b strings.Builder
	fmt.Fprintf(&b, "%q %s %04o %d:%d", e.Path, e.Type, e.Mode, e.UID, e.GID)
	switch e.Type {
	case "file":
		fmt.Fprintf(&b, " size=%d sha256=%s", e.Size, e.Hash)
	case "symlink":
		fmt.Fprintf(&b, " -> %q", e.Target)
	case "chardev", "blockdev":
		fmt.Fprintf(&b, " rdev=%d", e.Rdev)
	}
	if e.Nlink > 1 {
		fmt.Fprintf(&b, " nlink=%d group=%q", e.Nlink, e.LinkGroup)
	}
	if e.MtimeNS != 0 {
		fmt.Fprintf(&b, " mtime=%d", e.MtimeNS)
	}
	if len(e.Xattrs) > 0 {
		keys := make([]string, 0, len(e.Xattrs))
		for k := range e.Xattrs {
			keys = append(keys, k)
		}
		sort.Strings(keys)
		for _, k := range keys {
			fmt.Fprintf(&b, " %s=%q", k, e.Xattrs[k])
		}
	}
	return b.String()
}

// Digest returns a SHA-256 over the canonical rendering of every entry.
func (s Snapshot) Digest() string {
	h := sha256.New()
	s.WriteTo(h)
	return hex.EncodeToString(h.Sum(nil))
}

// WriteTo writes the canonical rendering, one entry per line.
func (s Snapshot) WriteTo(w io.Writer) (int64, error) {
	var n int64
	for _, e := range s {
		m, err := io.WriteString(w, e.String()+"\n")
		n += int64(m)
		if err != nil {
			return n, err
		}
	}
	return n, nil
}

// Diff lists the differences between want and got, at most max lines
// (max <= 0: all), each naming the path.
func Diff(want, got Snapshot, max int) []string {
	var out []string
	add := func(s string) bool {
		out = append(out, s)
		return max > 0 && len(out) >= max
	}
	i, j := 0, 0
	for i < len(want) || j < len(got) {
		switch {
		case j >= len(got) || (i < len(want) && want[i].Path < got[j].Path):
			if add("missing: " + want[i].String()) {
				return out
			}
			i++
		case i >= len(want) || got[j].Path < want[i].Path:
			if add("extra:   " + got[j].String()) {
				return out
			}
			j++
		default:
			if a, b := want[i].String(), got[j].String(); a != b {
				if add("differs: want " + a + "\n         got  " + b) {
					return out
				}
			}
			i++
			j++
		}
	}
	return out
}

// Equal reports whether two snapshots are identical.
func Equal(a, b Snapshot) bool { return len(Diff(a, b, 1)) == 0 }
