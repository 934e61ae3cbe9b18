//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newBenchCRCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "cr",
		Short:   "Process checkpoint/restore benchmarks (Linux only)",
		Example: "  sudo rewind bench cr",
		RunE:    func(*cobra.Command, []string) error { return errors.New("process checkpoint/restore needs Linux") },
	}
}
