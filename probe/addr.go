package probe

import (
	"net/netip"
	"strconv"
)

// isLoopbackOrUnspec reports whether a 4- or 16-byte address is loopback,
// unspecified (which connects to the local host) or v4-mapped loopback.
func isLoopbackOrUnspec(ip []byte) bool {
	a, ok := netip.AddrFromSlice(ip)
	if !ok {
		return true
	}
	a = a.Unmap()
	return a.IsLoopback() || a.IsUnspecified()
}

// joinHostPort formats a 4- or 16-byte address and a port.
func joinHostPort(ip []byte, port uint16) string {
	a, ok := netip.AddrFromSlice(ip)
	if !ok {
		return "?:" + strconv.Itoa(int(port))
	}
	return netip.AddrPortFrom(a.Unmap(), port).String()
}
