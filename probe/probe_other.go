//go:build !linux

package probe

import "github.com/rewind-sandbox/rewind/effect"

// OpenEBPF is not supported outside Linux.
func OpenEBPF(Options) (Probe, error) { return nil, ErrUnsupported }

// NewUserspace is not supported outside Linux.
func NewUserspace(Options) (Probe, error) { return nil, ErrUnsupported }

// CheckEBPF reports that eBPF is unsupported outside Linux.
func CheckEBPF() error { return ErrUnsupported }

// CgroupID is not supported outside Linux.
func CgroupID(string) (uint64, error) { return 0, ErrUnsupported }

// DirSource is not supported outside Linux: it reports no effects.
type DirSource struct{}

// NewDirSource returns a DirSource that reports no effects.
func NewDirSource(string) *DirSource { return &DirSource{} }

// TakeFSEffects implements FSSource.
func (*DirSource) TakeFSEffects() effect.FS { return effect.FS{} }

// Files keeps nothing outside Linux.
type Files struct{}

// NewFiles returns an empty Files.
func NewFiles() *Files { return &Files{} }

// Close does nothing.
func (*Files) Close() error { return nil }
