//go:build !linux

package probebench

import "github.com/rewind-sandbox/rewind/probe"

// Run is not supported outside Linux.
func Run(Options) (*Result, error) { return nil, probe.ErrUnsupported }
