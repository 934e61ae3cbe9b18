package main

import (
	"crypto/sha256"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strings"
	"text/tabwriter"
	"time"

	"github.com/spf13/cobra"
)

// fsRunDir holds one symlink per FUSE/kernel mount served by `rewind fs
// mount`, named after the mountpoint and pointing at the control socket in
// the state directory (root-only).
const fsRunDir = "/run/rewind/fs"

// fsRequest is one control request (one JSON object per connection).
type fsRequest struct {
	Op string `json:"op"` // checkpoint, restore, ls, compact, umount, status
	ID string `json:"id,omitempty"`
}

// fsResponse answers a control request.
type fsResponse struct {
	Error       string         `json:"error,omitempty"`
	ID          string         `json:"id,omitempty"`
	ElapsedUS   int64          `json:"elapsed_us,omitempty"`
	Mount       string         `json:"mount,omitempty"`
	Base        string         `json:"base,omitempty"`
	Depth       int            `json:"depth,omitempty"`
	Checkpoints []fsCheckpoint `json:"checkpoints,omitempty"`
}

type fsCheckpoint struct {
	ID      string    `json:"id"`
	Parent  string    `json:"parent,omitempty"`
	Created time.Time `json:"created"`
	Layers  int       `json:"layers"`
	Current bool      `json:"current,omitempty"`
}

func fsLinkFor(mountpoint string) (string, error) {
	abs, err := filepath.Abs(mountpoint)
	if err != nil {
		return "", err
	}
	h := sha256.Sum256([]byte(filepath.Clean(abs)))
	return filepath.Join(fsRunDir, hex.EncodeToString(h[:12])+".sock"), nil
}

// fsCall sends one request to the server of mountpoint.
func fsCall(mountpoint string, req fsRequest) (fsResponse, error) {
	var resp fsResponse
	link, err := fsLinkFor(mountpoint)
	if err != nil {
		return resp, err
	}
	conn, err := net.DialTimeout("unix", link, 5*time.Second)
	if err != nil {
		return resp, fmt.Errorf("%s is not a rewind fs mount (or its server is gone): %w", mountpoint, errors.Unwrap(err))
	}
	defer conn.Close()
	_ = conn.SetDeadline(time.Now().Add(10 * time.Minute))
	if err := json.NewEncoder(conn).Encode(req); err != nil {
		return resp, fmt.Errorf("%s: send request: %w", mountpoint, err)
	}
	if err := json.NewDecoder(conn).Decode(&resp); err != nil {
		return resp, fmt.Errorf("%s: read response: %w", mountpoint, err)
	}
	if resp.Error != "" {
		return resp, errors.New(resp.Error)
	}
	return resp, nil
}

func newFSCmd() *cobra.Command {
	cmd := &cobra.Command{
		Use:   "fs",
		Short: "DeltaFS: mount a layered view, checkpoint and restore it in place",
		Example: `  rewind fs mount --state /var/lib/rewind/fs --lower /srv/rootfs /mnt/sbx
  id=$(rewind fs checkpoint /mnt/sbx)
  rewind fs restore /mnt/sbx "$id"
  rewind fs umount /mnt/sbx`,
	}
	cmd.AddCommand(newFSMountCmd(), newFSCheckpointCmd(), newFSRestoreCmd(), newFSLsCmd(),
		newFSCompactCmd(), newFSUmountCmd())
	return cmd
}

type fsMountOpts struct {
	state      string
	lowers     []string
	backend    string
	id         string
	from       string
	foreground bool
	debug      bool
}

func newFSMountCmd() *cobra.Command {
	var o fsMountOpts
	cmd := &cobra.Command{
		Use:   "mount --state DIR [--lower DIR]... [--backend auto|fuse|kernel] MOUNTPOINT",
		Short: "Mount a view of a layer store; returns once the mount is ready",
		Long: `Mounts a view of the layer store in --state at MOUNTPOINT and serves it in the background
(--foreground to stay attached). --lower directories are read-only base layers, topmost
first, like overlayfs's lowerdir. --from starts from a checkpoint (a fork: a new upper over
the checkpoint's layers). Re-mounting a store with the --id of a crashed mount resumes it.
The control socket lives in the state directory (root only), never inside the mount.`,
		Example: `  rewind fs mount --state /var/lib/rewind/fs --lower /srv/rootfs /mnt/sbx
  rewind fs mount --state /var/lib/rewind/fs --from 4f2a9c01d3e5b7a8 --id fork1 /mnt/fork1`,
		Args: cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if o.state == "" {
				return errors.New("fs mount: --state is required")
			}
			switch o.backend {
			case "auto", "fuse", "kernel":
			default:
				return fmt.Errorf("fs mount: --backend must be auto, fuse or kernel, not %q", o.backend)
			}
			if resp, err := fsCall(args[0], fsRequest{Op: "status"}); err == nil {
				// A second mount would sit on it, and take its control link:
				// the first could then be neither reached nor unmounted.
				return fmt.Errorf("fs mount: %s is a rewind fs mount already (id %s): rewind fs umount it first", args[0], resp.Mount)
			}
			if o.foreground {
				return fsServe(cmd, o, args[0])
			}
			return fsMountDetached(cmd, o, args[0])
		},
	}
	f := cmd.Flags()
	f.StringVar(&o.state, "state", "", "state directory (layer store)")
	f.StringArrayVar(&o.lowers, "lower", nil, "read-only base directory (repeatable, topmost first)")
	f.StringVar(&o.backend, "backend", "auto", "auto, fuse or kernel (auto = fuse)")
	f.StringVar(&o.id, "id", "main", "mount id in the store")
	f.StringVar(&o.from, "from", "", "start from this checkpoint id (fork)")
	f.BoolVar(&o.foreground, "foreground", false, "serve in the foreground")
	f.BoolVar(&o.debug, "debug", false, "log every FUSE request")
	return cmd
}

func printFSResult(cmd *cobra.Command, asJSON bool, resp fsResponse) error {
	if asJSON {
		return json.NewEncoder(cmd.OutOrStdout()).Encode(map[string]any{"id": resp.ID, "elapsed_us": resp.ElapsedUS})
	}
	fmt.Fprintln(cmd.OutOrStdout(), resp.ID)
	return nil
}

func newFSCheckpointCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "checkpoint MOUNTPOINT",
		Short:   "Freeze the view as a new checkpoint and print its id",
		Example: "  rewind fs checkpoint /mnt/sbx\n  rewind fs checkpoint --json /mnt/sbx",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := fsCall(args[0], fsRequest{Op: "checkpoint"})
			if err != nil {
				return fmt.Errorf("fs checkpoint: %w", err)
			}
			return printFSResult(cmd, asJSON, resp)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print {id, elapsed_us} (time measured inside the server)")
	return cmd
}

func newFSRestoreCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "restore MOUNTPOINT ID",
		Short:   "Switch the view to checkpoint ID in place (un-checkpointed changes are dropped)",
		Example: "  rewind fs restore /mnt/sbx 4f2a9c01d3e5b7a8",
		Args:    cobra.ExactArgs(2),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := fsCall(args[0], fsRequest{Op: "restore", ID: args[1]})
			if err != nil {
				return fmt.Errorf("fs restore: %w", err)
			}
			resp.ID = args[1]
			return printFSResult(cmd, asJSON, resp)
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print {id, elapsed_us} (time measured inside the server)")
	return cmd
}

func newFSLsCmd() *cobra.Command {
	var asJSON bool
	cmd := &cobra.Command{
		Use:     "ls MOUNTPOINT",
		Short:   "List the checkpoints of the mount (* marks the current base)",
		Example: "  rewind fs ls /mnt/sbx\n  rewind fs ls --json /mnt/sbx",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := fsCall(args[0], fsRequest{Op: "ls"})
			if err != nil {
				return fmt.Errorf("fs ls: %w", err)
			}
			if asJSON {
				return json.NewEncoder(cmd.OutOrStdout()).Encode(resp.Checkpoints)
			}
			tw := tabwriter.NewWriter(cmd.OutOrStdout(), 0, 4, 2, ' ', 0)
			fmt.Fprintln(tw, "ID\tPARENT\tCREATED\tLAYERS")
			for _, c := range resp.Checkpoints {
				mark := " "
				if c.Current {
					mark = "*"
				}
				fmt.Fprintf(tw, "%s%s\t%s\t%s\t%d\n", mark, c.ID, c.Parent, c.Created.Format(time.RFC3339), c.Layers)
			}
			return tw.Flush()
		},
	}
	cmd.Flags().BoolVar(&asJSON, "json", false, "print JSON")
	return cmd
}

func newFSCompactCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "compact MOUNTPOINT",
		Short:   "Merge the frozen layers under the view into one (checkpoint contents unchanged)",
		Example: "  rewind fs compact /mnt/sbx",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			resp, err := fsCall(args[0], fsRequest{Op: "compact"})
			if err != nil {
				return fmt.Errorf("fs compact: %w", err)
			}
			fmt.Fprintf(cmd.OutOrStdout(), "depth %d (%d µs)\n", resp.Depth, resp.ElapsedUS)
			return nil
		},
	}
}

func newFSUmountCmd() *cobra.Command {
	return &cobra.Command{
		Use:     "umount MOUNTPOINT",
		Short:   "Unmount the view and stop its server (checkpoints stay in the store)",
		Example: "  rewind fs umount /mnt/sbx",
		Args:    cobra.ExactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			if _, err := fsCall(args[0], fsRequest{Op: "umount"}); err != nil {
				return fmt.Errorf("fs umount: %w", err)
			}
			link, _ := fsLinkFor(args[0])
			deadline := time.Now().Add(30 * time.Second)
			for time.Now().Before(deadline) {
				// The link itself (its socket goes when the server stops
				// listening): the server removes it once the view is
				// unmounted.
				if _, err := os.Lstat(link); os.IsNotExist(err) {
					return nil
				}
				time.Sleep(20 * time.Millisecond)
			}
			return fmt.Errorf("fs umount: %s is still mounted after 30s: does a process still use it (its cwd, open files)? Its server unmounts it once nothing does", args[0])
		},
	}
}

func lastLine(b []byte) string {
	s := strings.TrimSpace(string(b))
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		s = s[i+1:]
	}
	return s
}
