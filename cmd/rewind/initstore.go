package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"strconv"
	"strings"

	"github.com/spf13/cobra"

	"github.com/rewind-sandbox/rewind/compat"
	"github.com/rewind-sandbox/rewind/kernelpath"
)

func newInitStoreCmd() *cobra.Command {
	var (
		xfsImage, btrfsImage string
		size, stateDir, cfg  string
		asJSON               bool
	)
	cmd := &cobra.Command{
		Use:   "init-store",
		Short: "Give rewind a reflink-capable state dir on a loop-mounted XFS or btrfs image",
		Long: `init-store creates a file-system image (XFS with reflink=1, or btrfs) if it does
not exist, mounts it on the state directory through a loop device, checks that
reflink works there, and records the mount in the store config, which the
daemon reads at start to mount it again (for example after a reboot).

With a reflink-capable state dir, the kernel path checkpoints by reflinking the
changed entries (cost independent of file sizes) and overlayfs copy-up shares
extents instead of copying data. Running it again is harmless: an existing
image is never reformatted.`,
		Example: `  sudo rewind init-store --xfs-image /var/lib/rewind.img --size 20G
  sudo rewind init-store --btrfs-image /srv/rewind.img --size 50G --state /srv/rewind-state`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			if stateDir == "" {
				stateDir = stateDirFromEnv()
			}
			opts := kernelpath.StoreImage{StateDir: stateDir, ConfigPath: cfg}
			switch {
			case xfsImage != "" && btrfsImage != "":
				return errors.New("give either --xfs-image or --btrfs-image, not both")
			case xfsImage != "":
				opts.Image, opts.FS = xfsImage, "xfs"
			case btrfsImage != "":
				opts.Image, opts.FS = btrfsImage, "btrfs"
			default:
				return errors.New("--xfs-image PATH or --btrfs-image PATH is required")
			}
			n, err := parseSize(size)
			if err != nil {
				return fmt.Errorf("--size: %w", err)
			}
			opts.Size = n
			c, err := kernelpath.InitStore(opts)
			if err != nil {
				return err
			}
			out := cmd.OutOrStdout()
			if asJSON {
				return json.NewEncoder(out).Encode(c)
			}
			fmt.Fprintf(out, "state dir %s: %s image %s mounted, reflink ok; config %s\n", c.StateDir, c.FS, c.Image, cfg)
			return nil
		},
	}
	cmd.Flags().StringVar(&xfsImage, "xfs-image", "", "XFS image file to create (reflink=1) or reuse")
	cmd.Flags().StringVar(&btrfsImage, "btrfs-image", "", "btrfs image file to create or reuse")
	cmd.Flags().StringVar(&size, "size", "10G", "image size when creating it (bytes, or with K/M/G/T suffix)")
	cmd.Flags().StringVar(&stateDir, "state", "", "state directory to mount the image on, which must be empty (default $REWIND_STATE or "+compat.DefaultStateDir+")")
	cmd.Flags().StringVar(&cfg, "config", kernelpath.DefaultStoreConfig, "store config file the daemon reads at start")
	cmd.Flags().BoolVar(&asJSON, "json", false, "print the store config as JSON")
	return cmd
}

// parseSize parses "512M", "20G", "1T" or a byte count.
func parseSize(s string) (int64, error) {
	s = strings.TrimSpace(strings.ToUpper(s))
	s = strings.TrimSuffix(strings.TrimSuffix(s, "B"), "I")
	mult := int64(1)
	if s != "" {
		switch s[len(s)-1] {
		case 'K':
			mult = 1 << 10
		case 'M':
			mult = 1 << 20
		case 'G':
			mult = 1 << 30
		case 'T':
			mult = 1 << 40
		}
		if mult != 1 {
			s = s[:len(s)-1]
		}
	}
	n, err := strconv.ParseInt(s, 10, 64)
	if err != nil || n <= 0 {
		return 0, fmt.Errorf("invalid size %q", s)
	}
	return n * mult, nil
}
