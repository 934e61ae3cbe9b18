package client

import (
	"errors"
	"net"
	"syscall"

	"golang.org/x/sys/unix"
)

// idleAlive reports whether an idle connection is still open and quiet:
// a non-blocking peek sees neither an end of file (the daemon closed it)
// nor bytes nobody asked for.
func idleAlive(c net.Conn) bool {
	sc, ok := c.(syscall.Conn)
	if !ok {
		return true
	}
	rc, err := sc.SyscallConn()
	if err != nil {
		return false
	}
	alive := false
	var buf [1]byte
	err = rc.Read(func(fd uintptr) bool {
		_, _, rerr := unix.Recvfrom(int(fd), buf[:], unix.MSG_PEEK|unix.MSG_DONTWAIT)
		alive = errors.Is(rerr, unix.EAGAIN)
		return true
	})
	return err == nil && alive
}
