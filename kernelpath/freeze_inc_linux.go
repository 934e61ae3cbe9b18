package kernelpath

import (
	"errors"
	"fmt"
	"os"
	"sort"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/layer"
)

// Incremental freeze. The live upper U accumulates every change since the
// view was mounted (a stock kernel cannot swap it). The previous checkpoint
// froze U as it was then into layer Lp (a full copy, or Lp itself a delta
// over earlier ones) and kept U's fingerprint P (path -> inode, times,
// size, mode, and for directories the overlay flags). A new checkpoint
// writes a delta layer D to be stacked on Lp so that D over Lp shows what U
// over the base shows now, copying only the entries that changed since P:
//
//   - a directory still at the path it had in P (same inode): D holds a
//     plain directory there only if something below changed;
//   - a directory moved since P (its inode was at q in P): D holds it with
//     the absolute redirect "/q", so its lower content continues at the
//     copy Lp holds at q (whatever Lp's own flags say below), and entries
//     of q in P missing now become whiteouts;
//   - any other directory is new: copied whole, with U's flags, and made
//     opaque if Lp had something at that path;
//   - a non-directory is copied when new or changed (inode, ctime, mtime,
//     size or mode differ);
//   - an entry of P missing from U now becomes a whiteout in D.
//
// The walk stats every entry of U but copies only the delta. A tracked
// freeze (freezeTracked, from the change tracker's events, track_linux.go)
// applies the same rules to the entries named by events only, so its cost
// follows the number of entries changed, not the size of U.

// incFreezer writes one delta layer.
type incFreezer struct {
	*treeCopier
	prev     map[string]entryFP
	prevDirs map[uint64]string              // inode -> path of the directories of P
	children map[string]map[string]struct{} // path -> names of its children in P
	changed  int
	// strictLinks: a non-directory with other names (not a whiteout)
	// aborts with errNeedWalk (a tracked freeze cannot see the other
	// names change).
	strictLinks bool
	// gone are the paths of P whose entry (and subtree) the delta
	// replaces or removes (tracked freeze).
	gone []string
	// todo are a tracked freeze's names: a file opened since the last
	// checkpoint is tested for writers wherever the freeze meets it.
	todo map[string]map[string]uint8
}

// lazyDir is a directory of D, created on first need.
type lazyDir struct {
	parent   *lazyDir
	name     string
	fd       int
	created  bool
	opaque   bool   // set trusted.overlay.opaque
	redirect string // set trusted.overlay.redirect
}

func (z *incFreezer) ensure(d *lazyDir) (int, error) {
	if d.created {
		return d.fd, nil
	}
	pfd, err := z.ensure(d.parent)
	if err != nil {
		return -1, err
	}
	if err := unix.Mkdirat(pfd, d.name, 0o700); err != nil {
		return -1, err
	}
	fd, err := unix.Openat(pfd, d.name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return -1, err
	}
	d.fd, d.created = fd, true
	return fd, nil
}

// newCopier opens src and dst and makes the copier of a freeze from the
// upper src into the empty layer directory dst. The caller closes both fds.
func newCopier(src, dst string, reflink bool, fstype string, tr *trackCtx, pool *tmpPool, later *finishQueue) (*treeCopier, int, error) {
	sfd, err := unix.Open(src, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		return nil, -1, fmt.Errorf("open upper: %w", err)
	}
	dfd, err := unix.Open(dst, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
	if err != nil {
		unix.Close(sfd)
		return nil, -1, fmt.Errorf("open layer: %w", err)
	}
	c := &treeCopier{reflink: reflink, dstRoot: dfd, links: map[uint64]string{}, fp: map[string]entryFP{},
		uid: uint32(os.Geteuid()), gid: uint32(os.Getegid()), umask: currentUmask(), tr: tr, later: later}
	if fstype == "xfs" {
		c.pool = pool
	}
	if fstype == "xfs" {
		c.files = newFileCopier(pool)
	}
	if !reflink || fstype != "btrfs" {
		c.small = smallFileXFS
	}
	if err := c.knowSetgid(); err != nil {
		unix.Close(sfd)
		unix.Close(dfd)
		return nil, -1, err
	}
	return c, sfd, nil
}

// freezeDelta writes into the empty directory dst the delta of the upper
// src since the fingerprint prev (by a walk of the whole upper), and
// returns src's new fingerprint and the number of entries written. tr, if
// set, watches the directories walked.
func freezeDelta(src, dst string, prev *fpIndex, reflink bool, fstype string, tr *trackCtx, pool *tmpPool, later *finishQueue) (map[string]entryFP, int, error) {
	c, sfd, err := newCopier(src, dst, reflink, fstype, tr, pool, later)
	if err != nil {
		return nil, 0, err
	}
	defer unix.Close(sfd)
	defer c.closeDir(c.dstRoot)
	defer c.files.close()
	z := &incFreezer{treeCopier: c, prev: prev.fp, prevDirs: prev.dirs, children: prev.children}
	root := &lazyDir{fd: c.dstRoot, created: true}
	if err := z.walkDir(sfd, "", "", true, root); err != nil {
		return nil, 0, err
	}
	if err := c.files.close(); err != nil {
		return nil, 0, err
	}
	return c.fp, z.changed, nil
}

// trackedDelta is the result of a tracked freeze: the delta is written,
// apply edits the fingerprint once the checkpoint is recorded.
type trackedDelta struct {
	z *incFreezer
}

// apply updates prev to the upper's fingerprint now.
func (d trackedDelta) apply(prev *fpIndex, forget func(string, uint64)) {
	for _, p := range d.z.gone {
		prev.remove(p, forget)
	}
	// Parents before children (a new directory's entries need it).
	paths := make([]string, 0, len(d.z.fp))
	for p := range d.z.fp {
		paths = append(paths, p)
	}
	sort.Slice(paths, func(i, j int) bool { return len(paths[i]) < len(paths[j]) })
	for _, p := range paths {
		prev.set(p, d.z.fp[p])
	}
}

// freezeTracked writes into the empty directory dst the delta of the upper
// src since prev like freezeDelta, but looks only at the names of todo
// (directory path -> names, the directories on the way included) and walks
// only directories new since prev. errNeedWalk when the entries seen show
// that the names may not cover every change (dst must then be emptied and
// freezeDelta run).
func freezeTracked(src, dst string, prev *fpIndex, todo map[string]map[string]uint8, reflink bool, fstype string, tr *trackCtx, pool *tmpPool, later *finishQueue) (trackedDelta, int, error) {
	c, sfd, err := newCopier(src, dst, reflink, fstype, tr, pool, later)
	if err != nil {
		return trackedDelta{}, 0, err
	}
	defer unix.Close(sfd)
	defer c.closeDir(c.dstRoot)
	defer c.files.close()
	z := &incFreezer{treeCopier: c, prev: prev.fp, prevDirs: prev.dirs, children: prev.children, strictLinks: true, todo: todo}
	root := &lazyDir{fd: c.dstRoot, created: true}
	if err := z.visit(sfd, "", root, todo); err != nil {
		return trackedDelta{}, 0, err
	}
	if err := c.files.close(); err != nil {
		return trackedDelta{}, 0, err
	}
	return trackedDelta{z}, z.changed, nil
}

// copyChanged copies entry name of upper directory ufd (view path cp, stat
// st) into the delta layer's directory d, made on first use; test has the
// copy test the file for writers still holding it open (freshDir).
func (z *incFreezer) copyChanged(ufd int, d *lazyDir, name, cp string, st *unix.Stat_t, test bool) error {
	dfd, err := z.ensure(d)
	if err != nil {
		return fmt.Errorf("/%s: %w", cp, err)
	}
	z.freshDir = test
	if err := z.copyEntryStat(ufd, dfd, name, cp, st); err != nil {
		return fmt.Errorf("/%s: %w", cp, err)
	}
	z.changed++
	return nil
}

// whiteout writes a whiteout for name (view path cp) into the delta
// layer's directory d, made on first use.
func (z *incFreezer) whiteout(d *lazyDir, name, cp string) error {
	dfd, err := z.ensure(d)
	if err != nil {
		return fmt.Errorf("/%s: %w", cp, err)
	}
	if err := unix.Mknodat(dfd, name, unix.S_IFCHR, 0); err != nil {
		return fmt.Errorf("whiteout /%s: %w", cp, err)
	}
	z.changed++
	return nil
}

// visit handles the names todo[p] of the known directory ufd at path p
// (unchanged in place since P), by the rules of walkDir.
func (z *incFreezer) visit(ufd int, p string, d *lazyDir, todo map[string]map[string]uint8) error {
	for name, flags := range todo[p] {
		cp := join(p, name)
		o, had := z.prev[cp]
		if had && o.multiLink() {
			return fmt.Errorf("%w: /%s has other names", errNeedWalk, cp)
		}
		var st unix.Stat_t
		err := unix.Fstatat(ufd, name, &st, unix.AT_SYMLINK_NOFOLLOW)
		if errors.Is(err, unix.ENOENT) {
			if !had {
				continue
			}
			z.gone = append(z.gone, cp)
			if o.isWhiteout() {
				continue
			}
			if err := z.whiteout(d, name, cp); err != nil {
				return err
			}
			continue
		}
		if err != nil {
			return fmt.Errorf("/%s: %w", cp, err)
		}
		cur := fpOf(&st)
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			if cur.multiLink() {
				z.tr.t.noteLinked(ufd, name)
				return fmt.Errorf("%w: /%s has other names", errNeedWalk, cp)
			}
			if had && o.mode&unix.S_IFMT == unix.S_IFDIR {
				z.gone = append(z.gone, cp)
			}
			z.fp[cp] = cur
			test := flags&nameOpened != 0 && st.Mode&unix.S_IFMT == unix.S_IFREG
			if had && o.same(cur) {
				if test {
					z.tr.l.check(ufd, name, cp)
				}
				continue
			}
			if err := z.copyChanged(ufd, d, name, cp, &st, test); err != nil {
				return err
			}
			continue
		}
		cfd, err := unix.Openat(ufd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("/%s: %w", cp, err)
		}
		cur.opaque, cur.redirect = dirFlags(cfd)
		cd := &lazyDir{parent: d, name: name}
		pq, known := z.prevDirs[cur.ino]
		if known && cur.opaque && !z.prev[pq].opaque {
			known = false
		}
		switch {
		case known && pq == cp:
			z.fp[cp] = cur
			if o != cur {
				_, err = z.ensure(cd)
			}
			if err == nil {
				err = z.visit(cfd, cp, cd, todo)
			}
		case known:
			err = fmt.Errorf("%w: directory /%s moved to /%s unseen", errNeedWalk, pq, cp)
		default:
			if had {
				z.gone = append(z.gone, cp)
			}
			z.fp[cp] = cur
			cd.opaque, cd.redirect = cur.opaque, cur.redirect
			if cd.redirect == "" && had {
				cd.opaque = true
			}
			if _, err = z.ensure(cd); err == nil {
				err = z.walkDir(cfd, cp, "", false, cd)
			}
			z.changed++
		}
		unix.Close(cfd)
		if err != nil {
			return err
		}
	}
	return z.finishDir(ufd, p, d)
}

func join(dir, name string) string {
	if dir == "" {
		return name
	}
	return dir + "/" + name
}

// walkDir handles the U directory ufd at path p. merge: D's directory
// merges with Lp's directory q (only changes are written, removed entries
// become whiteouts); otherwise everything below is written.
func (z *incFreezer) walkDir(ufd int, p, q string, merge bool, d *lazyDir) error {
	fresh := z.tr.enterDir(ufd, p)
	dupfd, err := dupCloexec(ufd)
	if err != nil {
		return err
	}
	dirf := os.NewFile(uintptr(dupfd), p)
	names, err := dirf.Readdirnames(-1)
	dirf.Close()
	if err != nil {
		return fmt.Errorf("read dir /%s: %w", p, err)
	}
	seen := make(map[string]bool, len(names))
	for _, name := range names {
		seen[name] = true
		cp, qp := join(p, name), join(q, name)
		var st unix.Stat_t
		if err := unix.Fstatat(ufd, name, &st, unix.AT_SYMLINK_NOFOLLOW); err != nil {
			return fmt.Errorf("/%s: %w", cp, err)
		}
		cur := fpOf(&st)
		if st.Mode&unix.S_IFMT != unix.S_IFDIR {
			if cur.multiLink() && z.tr != nil {
				z.tr.t.noteLinked(ufd, name)
			}
			if z.strictLinks && cur.multiLink() {
				return fmt.Errorf("%w: /%s has other names", errNeedWalk, cp)
			}
			z.fp[cp] = cur
			test := (fresh || z.todo[p][name]&nameOpened != 0) && st.Mode&unix.S_IFMT == unix.S_IFREG
			if merge {
				if o, ok := z.prev[qp]; ok && o.same(cur) {
					if test {
						z.tr.l.check(ufd, name, cp)
					}
					continue // unchanged: Lp has it
				}
			}
			if err := z.copyChanged(ufd, d, name, cp, &st, test); err != nil {
				return err
			}
			continue
		}
		cfd, err := unix.Openat(ufd, name, unix.O_RDONLY|unix.O_DIRECTORY|unix.O_NOFOLLOW|unix.O_CLOEXEC, 0)
		if err != nil {
			return fmt.Errorf("/%s: %w", cp, err)
		}
		cur.opaque, cur.redirect = dirFlags(cfd)
		z.fp[cp] = cur
		cd := &lazyDir{parent: d, name: name}
		// The same directory (inode) as in P, possibly moved since (its
		// redirect, pointing at its origin in the base, may have been added
		// by the move: routing lookups through Lp's copy at pq reaches the
		// same origin). Only a directory that became opaque hides what Lp
		// holds and is written as new.
		pq, known := z.prevDirs[cur.ino]
		if known && cur.opaque && !z.prev[pq].opaque {
			known = false
		}
		switch {
		case known && merge && pq == qp:
			if z.prev[pq] != cur {
				_, err = z.ensure(cd) // its own metadata changed
			}
			if err == nil {
				err = z.walkDir(cfd, cp, pq, true, cd)
			}
		case known:
			cd.redirect = "/" + pq
			if _, err = z.ensure(cd); err == nil {
				err = z.walkDir(cfd, cp, pq, true, cd)
			}
			z.changed++
		default:
			cd.opaque, cd.redirect = cur.opaque, cur.redirect
			if cd.redirect == "" && merge {
				if _, had := z.prev[qp]; had {
					cd.opaque = true
				}
			}
			if _, err = z.ensure(cd); err == nil {
				err = z.walkDir(cfd, cp, "", false, cd)
			}
			z.changed++
		}
		unix.Close(cfd)
		if err != nil {
			return err
		}
	}
	if merge {
		for name := range z.children[q] {
			if seen[name] || z.prev[join(q, name)].isWhiteout() {
				continue
			}
			if err := z.whiteout(d, name, join(p, name)); err != nil {
				return err
			}
		}
	}
	return z.finishDir(ufd, p, d)
}

// finishDir gives D's directory d (if made) the metadata and flags of the
// upper's directory ufd at path p.
func (z *incFreezer) finishDir(ufd int, p string, d *lazyDir) error {
	if !d.created {
		return nil
	}
	// The copies into d finish (and name their files) first: the
	// directory's times come after its children.
	if err := z.files.wait(); err != nil {
		return err
	}
	var st unix.Stat_t
	if err := unix.Fstat(ufd, &st); err != nil {
		return err
	}
	z.noOvl = true
	err := z.copyMeta(ufd, d.fd, &st)
	z.noOvl = false
	if err != nil {
		return fmt.Errorf("/%s: %w", p, err)
	}
	if d.opaque {
		if err := unix.Fsetxattr(d.fd, layer.XattrOpaque, []byte("y"), 0); err != nil {
			return fmt.Errorf("/%s: set opaque: %w", p, err)
		}
	}
	if d.redirect != "" {
		if err := unix.Fsetxattr(d.fd, layer.XattrRedirect, []byte(d.redirect), 0); err != nil {
			return fmt.Errorf("/%s: set redirect: %w", p, err)
		}
	}
	if d.parent != nil {
		z.closeDir(d.fd)
	}
	return nil
}
