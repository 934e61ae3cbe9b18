package fs

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strconv"
	"time"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/pause"
)

// WaitIdle waits until the mount's FUSE connection has no request waiting
// or in flight (fusectl's connections/<minor>/waiting is 0), or ctx ends.
//
// A writer killed with dirty pages of a shared file mapping leaves their
// write-back to the kernel, and sync(2)/syncfs(2) on this kernel do not
// wait for a FUSE mount's write-back to complete (the server is not
// trusted to answer): the WRITE requests can still be queued when syncfs
// returns, and would land in whatever view the mount shows when the
// server reads them. A caller that is about to switch the view after
// killing every writer calls syncfs, then WaitIdle.
func (f *FS) WaitIdle(ctx context.Context) error {
	if f.dev == 0 {
		return nil
	}
	p := filepath.Join("/sys/fs/fuse/connections", strconv.FormatUint(uint64(unix.Minor(f.dev)), 10), "waiting")
	buf := make([]byte, 32)
	for delay := 20 * time.Microsecond; ; {
		fd, err := unix.Open(p, unix.O_RDONLY|unix.O_CLOEXEC, 0)
		if err != nil {
			if os.IsNotExist(err) {
				return nil // fusectl not mounted: nothing to wait with
			}
			return fmt.Errorf("wait for %s's requests: %w", f.mountpoint, err)
		}
		n, err := unix.Read(fd, buf)
		unix.Close(fd)
		if err != nil {
			return fmt.Errorf("wait for %s's requests: %w", f.mountpoint, err)
		}
		if w, err := strconv.Atoi(string(bytes.TrimSpace(buf[:n]))); err != nil || w == 0 {
			return nil
		}
		if err := ctx.Err(); err != nil {
			return fmt.Errorf("wait for %s's requests: %w", f.mountpoint, err)
		}
		pause.For(delay)
		delay = min(2*delay, time.Millisecond)
	}
}
