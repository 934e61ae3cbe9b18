//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newBenchFSCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "fs",
		Short:   "DeltaFS benchmarks (Linux only)",
		Example: "  rewind bench fs",
		RunE:    func(*cobra.Command, []string) error { return errors.New("bench fs: only supported on Linux") },
	}
}
