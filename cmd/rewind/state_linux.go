package main

import (
	"os/exec"
	"syscall"
)

// detach makes the started daemon its own session leader, so it outlives
// the CLI and its terminal.
func detach(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setsid: true}
}
