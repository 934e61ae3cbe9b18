package main

import (
	"encoding/json"
	"fmt"
	"strings"
	"text/tabwriter"

	"github.com/rewind-sandbox/rewind/compat"
	"github.com/spf13/cobra"
)

func newDoctorCmd() *cobra.Command {
	var (
		asJSON   bool
		stateDir string
		criuPath string
		noLoop   bool
	)
	cmd := &cobra.Command{
		Use:   "doctor",
		Short: "Say what this host supports and which backends rewind will use",
		Long: `doctor probes the host — FUSE, overlayfs, the state directory's file system,
eBPF, CRIU, namespaces, cgroup freezing, dirty-page tracking — and prints one
line per capability (ok, missing or degraded, with the reason) and the backend
chosen for each layer. It leaves nothing mounted or loaded.`,
		Example: "  sudo rewind doctor\n  sudo rewind doctor --json --state /var/lib/rewind",
		Args:    cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if stateDir == "" {
				stateDir = stateDirFromEnv()
			}
			r := compat.Probe(cmd.Context(), compat.Options{StateDir: stateDir, CRIUPath: criuPath, SkipLoopXFS: noLoop})
			out := cmd.OutOrStdout()
			if asJSON {
				enc := json.NewEncoder(out)
				enc.SetIndent("", "  ")
				return enc.Encode(r)
			}
			fmt.Fprintf(out, "kernel %s, state dir %s (probed in %.0f ms)\n\n", r.Kernel, r.StateDir, r.ElapsedMS)
			tw := tabwriter.NewWriter(out, 2, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "CAPABILITY\tSTATUS\tDETAIL")
			for _, c := range r.Checks {
				fmt.Fprintf(tw, "%s/%s\t%s\t%s\n", c.Group, c.Name, strings.ToUpper(string(c.Status)), c.Detail)
			}
			tw.Flush()
			fmt.Fprintln(out)
			fmt.Fprintf(out, "chosen: fs = %s (%s)\n", r.Chosen.FS.Backend, r.Chosen.FS.Reason)
			fmt.Fprintf(out, "        cr = %s (%s)\n", r.Chosen.CR.Backend, r.Chosen.CR.Reason)
			fmt.Fprintf(out, "        probe = %s (%s)\n", r.Chosen.Probe.Backend, r.Chosen.Probe.Reason)
			return nil
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the report as JSON")
	cmd.Flags().StringVar(&stateDir, "state", "", "state directory whose file system is probed (default $REWIND_STATE or "+compat.DefaultStateDir+")")
	cmd.Flags().StringVar(&criuPath, "criu", "", "CRIU binary to use (default: $REWIND_CRIU, "+compat.DefaultCRIUPrefix+"/sbin/criu, then PATH)")
	cmd.Flags().BoolVar(&noLoop, "no-loop", false, "skip the loop-mounted XFS reflink self-test")
	return cmd
}
