// Package cr is rewind's process checkpoint/restore engine.
//
// A checkpoint of a sandbox's processes is, on the fast path, a set of
// templates: stopped copies of every process, made by injecting
// clone(CLONE_PARENT|SIGCHLD) into the running process with ptrace (see
// cr/inject), so each template is a sibling of its process and a child of
// the sandbox's init. Templates share all pages with the live process until
// either writes (copy-on-write); they stay ptrace-stopped, attached to the
// engine's tracer thread, with /dev/null as stdio. Each template, and each
// copy made from one, leads its own session and process group (setsid by
// injection): none keeps the pid of the process it copies allocated as a
// session or group id, which a CRIU restore of that exact pid would meet
// as "File exists", and CRIU can always dump it again.
//
// Templates cannot be hidden from the sandbox: a process cannot leave its
// PID namespace, so the agent sees them and, being root there, can signal
// them. What it cannot do is change them: a template is made undumpable
// while every process of the sandbox is still held, so without
// CAP_SYS_PTRACE (which sandboxes never have) no agent process can open its
// /proc/PID/mem, environ, maps or descriptors, write it with
// process_vm_writev, or attach (the engine's tracer is attached anyway);
// signals other than SIGKILL are absorbed by the tracer. A killed template
// or spare is noticed when it is next forked, and the restore falls back to
// the image (or fails, saying so, if there is none). Copies get the
// original's dumpable flag back just before they run.
//
// A restore forks the templates again (the copies are made before the old
// processes are killed, so the page-table copy does not compete with their
// teardown, and a failed fork leaves them running), sends SIGKILL to the
// live processes and, while they die, gives the copies their own sessions
// and fresh stdio opened inside them from paths the caller supplies; once
// the old processes are exiting it runs the caller's file-system switch and
// releases the copies. All the ptrace work of one restore is one hand-over
// to the tracer thread. With Config.Warm a pre-forked, pre-faulted spare of
// each template waits ready (async-warm): a restore then needs no fork and
// the restored process meets no copy-on-write faults.
//
// A forked copy shares its template's open file descriptions, and so their
// offsets, with the original, which reads on after the checkpoint. So each
// copy (restored process, spare, copy dumped for the image) reopens, by
// path, the regular files and directories the template held, at the
// offsets they had at the checkpoint: those on every mount but a pseudo
// file system's (procfs, sysfs, cgroups...), whose files are left shared.
// Files deleted since they were opened stay shared too. A copy that a
// restore runs reopens the files of the sandbox's view (its root mount)
// only once the view has been switched to the checkpoint's: before, they
// would be the live view's files, which the switch leaves behind. A
// template's shell digest reports the checkpoint's offsets, not the shared
// descriptions' current ones.
//
// Forks copy page tables, so their cost grows with the 4 KiB pages mapped.
// Unless Config.NoCollapse, after a checkpoint the engine asks the kernel in
// the background (process_madvise MADV_COLLAPSE, 2 MiB at a time under the
// sandbox's lock) to map the dense anonymous memory of the checkpointed
// processes, then of their templates, with transparent huge pages, and
// spares are warmed the same way: later template forks, restores and kills
// then handle one entry per 2 MiB (a 200 MB heap's checkpoint is frozen for
// about 1 ms instead of 7). Sparse ranges are left alone (collapse_linux.go).
//
// With Config.ImagesDir every template checkpoint also gets a CRIU image,
// written in the background from a stopped copy of each template (the agent
// never waits), with a checkpoint.json describing it. The pool of templates
// is bounded by count and private dirty memory; a template is evicted only
// once its image exists (or the checkpoint was hinted unreachable). A
// template miss restores the template from the image (optionally with
// lazy pages) and forks it; images also restore into other sandboxes and
// after a daemon restart (LoadImages).
//
// Multi-threaded processes and process trees cannot be rebuilt by template
// fork; their checkpoints take the CRIU path (Mode "criu"): every process is
// stopped, dumped with --leave-running, and restored with exact pids, trees
// and fresh stdio passed as inherited pipes. CRIU runs inside the sandbox's
// namespaces and cgroups (cr/criu), as root with every capability, so it is
// kept from everything of the sandbox's it would use for itself: no
// configuration file, plugin, program or kernel-feature cache of the
// sandbox is read or run (cr/criu's kdat_linux.go says how), a restore
// whose image names a file now reached through a symlink of the sandbox is
// refused (criu.ErrImagePath), and a CRIU that blocks is killed when its
// context ends.
//
// Terminals have no CRIU path: a pseudo-terminal slave whose master is the
// daemon's can only be restored by CRIU into the restoring criu's own
// terminal, or with the master handed back over RPC, which go-criu cannot
// receive. A process holding a terminal (a TTY session) therefore gets no
// image: its checkpoint is templates only (Parts.ImageErr says why, the
// pool evicts it only once it is hinted unreachable, and a restore without
// the template fails with that reason), and a checkpoint that would need the CRIU path for it (a tree,
// a multi-threaded process) fails at once, before anything is stopped.
//
// ShellDigest asks a template-forked copy of a persistent bash for its
// state (variables, functions, aliases, options, traps, jobs, cwd, umask,
// descriptors, limits) under a seccomp filter, and leaves the shell itself
// untouched; equal digests say its state did not change (policy/SHELLS.md).
package cr
