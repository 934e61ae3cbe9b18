// Package probe observes what one agent turn did to a sandbox's operating
// system state and produces an effect.Report for the policy.
//
// # Model
//
// A Probe serves many sandboxes. For each turn the caller opens a window with
// Begin(Target) and closes it with End(), which returns the report. The
// Target names the sandbox's cgroup v2 directory (the eBPF filter key and the
// process list), the host pid of its init, and its file-system effect source
// (the fs layer). Turns are numbered per sandbox by the probe.
//
// # Backends
//
// The eBPF backend (OpenEBPF) loads programs written with cilium/ebpf's asm
// package — no clang at build time — and attaches them once, for the whole
// host, to raw tracepoints, which need neither tracefs nor fentry/kprobes
// (both unavailable on the target hosts): sched_process_exec,
// sched_process_fork, signal_generate, inet_sock_set_state and (Linux >= 6.3)
// sock_send_length. None of these is on the path of an ordinary syscall, so
// a syscall-heavy workload pays nothing measurable. Each program first looks
// the current task's cgroup v2 id up in a hash map holding one counter block
// per open window; tasks of other cgroups cost one map lookup. Counters are
// exact (atomic adds in the map). Paths, exec file names and remote addresses
// go through a ring buffer, at most 32 of each kind per window (the report
// keeps effect.MaxSamples); a sample the ring buffer cannot take is counted
// in LostEvents. End reads and deletes the window's counters, flushes the
// ring buffer and reads /proc.
//
// A sixth program, on raw_syscalls sys_exit, counts file-system syscalls
// and mmap/munmap/brk. It hooks every syscall of the host (5-9% of the CPU
// time of find(1), see probebench), so it is attached only once a window is
// opened without an FSSource, and stays attached until Close. With the fs
// layer (the daemon's case) it is never attached.
//
// The userspace backend (NewUserspace) needs no eBPF: it compares /proc
// snapshots of the cgroup's processes taken at Begin and at End, counts
// forks and execs with the proc connector, and reads file-system effects
// from Target.FS.
//
// Both backends share the snapshot comparison, so they agree on the fields
// it fills. A snapshot reads the cgroup's cgroup.procs and each process's
// stat and schedstat (cwd and argv[0] only of a process that ran); with
// Target.Files those stay open from one snapshot of the sandbox to the
// next and are read again with one pread each.
//
// # Fields and who fills them
//
//	field                        eBPF                                userspace
//	FS.*                         Target.FS if set; else syscall      Target.FS; if nil, LostEvents=1
//	                             counts (see below), BytesWritten=0
//	Proc.Forked                  every fork/clone (not threads)      every fork by a sandbox process (proc
//	                                                                 connector); without it, new processes
//	                                                                 alive at End
//	Proc.Execs, ExecSamples      every successful exec               every exec (proc connector; comm and
//	                             (Argv0 = executed file name)        argv[0] read from /proc, empty if the
//	                                                                 process is already gone); without it,
//	                                                                 new or re-exec'd processes at End
//	Proc.Exited                  snapshot: alive at Begin, gone at End (both)
//	Proc.Alive                   snapshot: processes in the cgroup at End (both)
//	Proc.NewLongLived, LongLived snapshot: alive at End, born in the turn (both)
//	Proc.CwdChanges              snapshot: alive at both ends, cwd differs (both)
//	Proc.SignalsSent             signals sent to another process     0 (invisible)
//	                             (kill, tgkill, sigqueue...; not SIGCHLD
//	                             or other kernel-generated ones)
//	Mem.PagesWritten, PerProc    snapshot estimate (both, Exact=false): see below
//	Mem.Mmaps/Munmaps/Brks       syscall counts, only while the      0 (invisible)
//	                             sys_exit hook is attached
//	Net.RemoteConnects, Remotes  TCP connects (SYN_SENT) to a        sockets held at End, not at Begin, with a
//	                             non-loopback address                non-loopback peer (tcp/udp, v4/v6)
//	Net.Listens                  TCP sockets entering LISTEN         LISTEN sockets held at End, not at Begin
//	Net.BytesSent                bytes sent on inet sockets          0 (invisible)
//	LostEvents                   ring-buffer samples dropped         1 when Target.FS is nil, else 0
//
// Legitimate differences: the userspace backend sees sockets only when
// alive at the snapshots, so a short-lived remote connection is invisible
// to it; the eBPF backend counts every TCP connect (but not UDP datagrams).
// The userspace backend learns of forks and execs from the proc connector
// (NETLINK_CONNECTOR, host-wide, attributed to the sandbox by following
// forks from its known processes, or by /proc/PID/cgroup for a process
// spawned into the cgroup from outside, which it may miss if the process is
// gone before its exec is read); without the connector it sees only
// processes alive at End, so a one-shot cat leaves Forked/Execs at 0. A policy that wants both
// backends to agree must decide skip on FSChanged(), NetChanged(),
// NewLongLived, Exited, CwdChanges and Mem.PagesWritten, which are computed
// identically (FS from the same source) — not on Forked or Execs, which for
// a one-shot command run in the sandbox are >= 1 under eBPF. Forked also
// counts rewind's own forks in the sandbox's cgroup: a turn right after a
// full checkpoint sees the template copies made in the background (spares,
// shell digests), 1 to 5 of them, born and gone within the window.
//
// # Memory estimate
//
// Exact written-page sets need userfaultfd write-protection (async mode)
// registered in each target process: PAGEMAP_SCAN reports PAGE_IS_WRITTEN
// only for such ranges. Registering it in a non-cooperating process means
// injecting userfaultfd(2) and UFFDIO_REGISTER (ptrace), and the uffd must
// stay open in the target, which breaks checkpointing: CRIU 4.1.1 refuses to
// dump it ("Can't dump file 3 of that type [600] (anon
// anon_inode:[userfaultfd])", checked on this kernel), and a template fork
// loses the registration in the child. The probes therefore estimate: a
// process alive at both ends counts its minor-fault delta, and at least 1
// page if it ran at all (schedstat: its threads were scheduled in or used
// CPU time), because rewriting an already dirty page costs no fault; a
// process born in the turn counts all its minor faults. The sandbox's init
// (Target.InitPID) is excluded: its memory is rewind's. Mem.Exact is
// therefore false.
//
// # eBPF file-system counts without an FSSource
//
// Successful open/openat/openat2/creat with O_WRONLY, O_RDWR, O_CREAT or
// O_TRUNC count as Created (O_CREAT) or Modified, except paths under /dev/,
// /proc/ and /sys/; mkdir, mknod, symlink, link count as Created; unlink,
// rmdir as Deleted; rename* as Renamed; truncate, ftruncate, fallocate as
// Modified; chmod, chown, utimes, xattr calls as MetaChanged. Writes through
// a file descriptor opened before the window are not seen, hence the fs
// layer (Target.FS) is preferred whenever it is present.
//
// # Limits
//
// No tracefs is needed: every program is a raw tracepoint (BPF_RAW_TRACEPOINT_OPEN).
//
// Processes in cgroups nested below Target.CgroupV2Dir are listed by the
// snapshots but not matched by the eBPF filter (it compares the task's own
// cgroup id). Events between End and the next Begin belong to no turn.
// Syscall numbers and struct pt_regs offsets are those of x86_64.
package probe
