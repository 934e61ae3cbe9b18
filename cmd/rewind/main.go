// Command rewind is the CLI and daemon of rewind: millisecond checkpoint,
// restore and fork of AI-agent sandboxes.
package main

import (
	"errors"
	"fmt"
	"os"
	"runtime"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/api"
)

// version is set at build time with -ldflags "-X main.version=...".
var version = "dev"

func newRootCmd() *cobra.Command {
	root := &cobra.Command{
		Use:           "rewind",
		Short:         "Checkpoint, restore and fork AI-agent sandboxes in milliseconds",
		SilenceUsage:  true,
		SilenceErrors: true,
	}
	root.AddCommand(newVersionCmd())
	root.AddCommand(newDoctorCmd())
	root.AddCommand(newInitStoreCmd())
	root.AddCommand(newStateCmds()...)
	root.AddCommand(newPolicyCmd())
	root.AddCommand(newProbeCmd())
	root.AddCommand(newFSCmd())
	root.AddCommand(newConformanceCmd())
	// Each area registers its command tree here, one line each.
	return root
}

func newVersionCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "version",
		Short:   "Print rewind's version",
		Example: "  rewind version\n  rewind version --json",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if asJSON {
				return printJSON(cmd.OutOrStdout(), map[string]string{"version": version, "go": runtime.Version(), "api": api.Version})
			}
			fmt.Fprintln(cmd.OutOrStdout(), "rewind", version)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON for scripts: this binary's version, its Go version and the API version it speaks")
	return cmd
}

// exitError carries a process exit code through cobra without printing a
// second error line.
type exitError struct{ code int }

func (e exitError) Error() string { return fmt.Sprintf("exit status %d", e.code) }

func main() {
	if err := newRootCmd().Execute(); err != nil {
		var ee exitError
		if errors.As(err, &ee) {
			os.Exit(ee.code)
		}
		fmt.Fprintln(os.Stderr, "rewind:", err)
		os.Exit(1)
	}
}
