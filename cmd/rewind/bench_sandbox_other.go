//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newBenchSandboxCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "sandbox",
		Short:   "Sandbox latency benchmarks (Linux only)",
		Example: "  sudo rewind bench sandbox",
		RunE:    func(*cobra.Command, []string) error { return errors.New("sandboxes need Linux") },
	}
}
