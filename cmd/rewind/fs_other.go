//go:build !linux

package main

import (
	"errors"

	"github.com/spf13/cobra"
)

func fsMountDetached(*cobra.Command, fsMountOpts, string) error {
	return errors.New("fs mount: only supported on Linux")
}

func fsServe(*cobra.Command, fsMountOpts, string) error {
	return errors.New("fs mount: only supported on Linux")
}
