//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newBenchMCTSCmd() *cobra.Command {
	return &cobra.Command{Use: "mcts", Short: "Replay tree-search trajectories (Linux only)",
		RunE: func(*cobra.Command, []string) error { return errors.New("rewind bench mcts needs Linux") }}
}

func newBenchFanoutCmd() *cobra.Command {
	return &cobra.Command{Use: "fanout", Short: "Fork fan-out benchmark (Linux only)",
		RunE: func(*cobra.Command, []string) error { return errors.New("rewind bench fanout needs Linux") }}
}
