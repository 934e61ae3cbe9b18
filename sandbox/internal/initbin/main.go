//go:build linux

// Command initbin is a minimal program that can serve as a sandbox init
// (it imports package sandbox). Tests build it without cgo to exercise the
// init path that changes every thread's credentials in place.
package main

import (
	"fmt"
	"os"

	"github.com/rewind-sandbox/rewind/sandbox"
)

func main() {
	sandbox.MaybeRunInit()
	fmt.Fprintln(os.Stderr, "initbin: only useful as a sandbox init")
	os.Exit(2)
}
