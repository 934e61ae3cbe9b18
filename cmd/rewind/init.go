//go:build linux

package main

import "github.com/rewind-sandbox/rewind/sandbox"

// A sandbox's PID 1 is this binary re-executed by sandbox.Start (selected by
// an environment variable, not by a command): it takes over here, before
// cobra parses anything, and never returns.
func init() { sandbox.MaybeRunInit() }
