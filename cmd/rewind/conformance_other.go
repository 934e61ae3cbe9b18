//go:build !linux

package main

import (
	"fmt"

	"github.com/spf13/cobra"
)

func newConformanceCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "conformance",
		Short:   "Check that every rewind path reaches identical state (Linux only)",
		Example: "  sudo rewind conformance run",
		RunE: func(*cobra.Command, []string) error {
			return fmt.Errorf("conformance needs Linux (FUSE, overlayfs, loop devices)")
		},
	}
}
