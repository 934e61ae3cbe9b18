package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func newDemoCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "demo",
		Short:   "Run a scripted coding-agent trajectory with a turn after every step, restores and a fork",
		Example: "  rewind demo",
		Args:    cobra.NoArgs,
		RunE: func(*cobra.Command, []string) error {
			return errors.New("demo: not in this build yet")
		},
	}
}
