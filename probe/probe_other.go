//go:build !linux

package probe

// OpenEBPF is not supported outside Linux.
func OpenEBPF(Options) (Probe, error) { return nil, ErrUnsupported }

// NewUserspace is not supported outside Linux.
func NewUserspace(Options) (Probe, error) { return nil, ErrUnsupported }

// CheckEBPF reports that eBPF is unsupported outside Linux.
func CheckEBPF() error { return ErrUnsupported }

// CgroupID is not supported outside Linux.
func CgroupID(string) (uint64, error) { return 0, ErrUnsupported }
