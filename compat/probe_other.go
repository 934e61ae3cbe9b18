//go:build !linux

package compat

import (
	"context"
	"runtime"
)

// DefaultStateDir is the daemon's default state directory.
const DefaultStateDir = "/var/lib/rewind"

func probeHost(_ context.Context, opts Options) *Report {
	return &Report{
		StateDir: opts.StateDir,
		Checks: []Check{{Group: "kernel", Name: "linux", Status: Missing,
			Detail: "rewind needs Linux (namespaces, FUSE, overlayfs, CRIU); this is " + runtime.GOOS}},
	}
}

// ChooseFS picks FUSE off Linux (where no backend works).
func ChooseFS(string) Choice {
	return Choice{Backend: "fuse", Reason: "rewind needs Linux; this is " + runtime.GOOS}
}
