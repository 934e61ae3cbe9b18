//go:build linux

// Command rewind-init is the sandbox init: the daemon runs it as every
// sandbox's PID 1 when it finds it beside its own binary, from the same
// build (see daemon.Config.InitPath). It holds package sandbox and nothing
// else, so it starts in a fraction of the time the full rewind binary
// takes, whose package initialisation alone is some 15 ms (cobra,
// prometheus, cilium/ebpf, wazero). Without it the daemon runs its own
// binary as the init.
//
// The init reads no CPU limit of its cgroup: the Go runtime would keep the
// cgroup's files open for its periodic GOMAXPROCS update, descriptors on
// the host's cgroup hierarchy that a process of the sandbox has no
// business reaching (the init is also not dumpable: see package sandbox).
//
//go:debug containermaxprocs=0
//go:debug updatemaxprocs=0
package main

import (
	"fmt"
	"os"

	"github.com/rewind-sandbox/rewind/sandbox"
)

func main() {
	sandbox.MaybeRunInit()
	fmt.Fprintln(os.Stderr, "rewind-init: the sandbox init of the rewind daemon; it does nothing on its own")
	os.Exit(2)
}
