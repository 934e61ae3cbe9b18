// Package sandbox runs a sandbox's processes: new PID, mount, UTS, IPC and
// (by default) network namespaces, a root directory switched with
// pivot_root, cgroups for freezing (v1 freezer) and for eBPF cgroup ids (v2),
// and a small rewind init as the namespace's PID 1 that spawns commands on
// the daemon's request, reaps every child and reports exits.
//
// The daemon drives a sandbox through one-shot Exec and long-lived sessions
// (Session.Send writes a line and returns what the process answered). The
// checkpoint/restore engine creates processes itself and hands them fresh
// stdio with NewChannels and AdoptSession.
//
// Every program that starts sandboxes must call MaybeRunInit at the very
// beginning of its main (or TestMain): the sandbox init is the same binary
// re-executed.
package sandbox
