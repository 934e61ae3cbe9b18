// Package sandbox runs a sandbox's processes: new PID, mount, UTS, IPC and
// (by default) network namespaces, a root directory switched with
// pivot_root, cgroups for freezing (v1 freezer), for eBPF cgroup ids (v2)
// and for limits (v1 pids, memory), and a small rewind init as the
// namespace's PID 1 that spawns commands on the daemon's request, reaps
// every child and reports exits.
//
// # Process model
//
// Start re-executes the current binary (the init runs from this package's
// init function, selected by an environment variable) in new namespaces.
// The init builds the mount namespace as full root — the root bind-mounted
// on itself, its own /proc (kernel interfaces masked or read-only), a
// minimal /dev (null, zero, full, random, urandom, tty, a private devpts,
// /dev/shm), a private tmpfs on /run/rewind, Config.Binds, Config.Tmpfs and
// Config.Hide mounts — pivots into the root and detaches the host's mounts.
// Its main thread then drops to a Docker-like capability set (no
// CAP_SYS_ADMIN, CAP_SYS_PTRACE, CAP_MKNOD, CAP_DAC_READ_SEARCH, ...) and
// forks every sandbox process, so PID 1 is no more privileged than what it
// runs. The daemon talks to the init over a SOCK_SEQPACKET socket; file
// descriptors travel with SCM_RIGHTS. Nothing the daemon inherited leaks
// in, and sandbox processes start with default signal dispositions and an
// empty signal mask, whatever the daemon inherited.
//
// # Driving a sandbox
//
// Exec runs a one-shot command and returns its exit code. StartSession
// starts a long-lived process (bash, python -i) whose stdin the daemon
// writes and whose merged stdout/stderr it buffers; Session.Send writes a
// line and returns the answer once the output is idle or matches a regexp.
// Freeze and Thaw stop and resume the whole tree atomically; Processes
// lists it with host pids; KillProcesses and Close end it (Close also
// reaps processes the daemon still ptrace-attaches and removes every
// cgroup).
//
// # Restored processes
//
// The checkpoint/restore engine creates processes itself (template fork by
// ptrace injection, CRIU restore) and gives them fresh stdio: NewChannels
// makes the pipes; Channels.ChildFiles hands the child ends to CRIU
// (--inherit-fd), Channels.InitFDs parks them in the init so that injected
// code can open /proc/1/fd/N; AdoptSession makes the new process the
// session's. CommandContext runs a host command (criu) inside the
// sandbox's namespaces and cgroups, where CRIU dumps and restores a
// session's process tree without namespace images.
//
// # Fast start
//
// Spares keeps inits started ahead of time, in their namespaces and
// cgroups, so that a start (a fork of a checkpoint into a new sandbox)
// only pays the mounts. A spare's mount namespace starts as a copy of the
// host's; a waiting spare leaves it for a small tmpfs of its own and
// detaches the copy, so it holds none of the host's mounts (whatever the
// host unmounts meanwhile, a FUSE view, a loop-mounted file system, is
// gone, and its loop device can detach). Its setup brings the sandbox's
// root and the sources of Config.Binds as detached mount trees (open_tree)
// cloned by the caller at the start.
//
// Every program that starts sandboxes must import this package (any
// binary that does can serve as the init); calling MaybeRunInit first
// thing in main or TestMain is harmless and documents it.
package sandbox
