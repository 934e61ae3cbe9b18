// Package cr is rewind's process checkpoint/restore engine.
//
// A checkpoint of a sandbox's processes is, on the fast path, a set of
// templates: stopped copies of every process, made by injecting
// clone(CLONE_PARENT|SIGCHLD) into the running process with ptrace (see
// cr/inject). Templates share all pages with the live process until either
// writes (copy-on-write). A restore kills the live processes and forks the
// templates again: fork copies page tables only, so its cost hardly grows
// with memory size. Restored copies get fresh stdio, opened inside the copy
// from paths the caller supplies.
//
// Multi-threaded processes and process trees cannot be rebuilt by template
// fork; those checkpoints take the CRIU path (cr/criu) instead. Templates
// live in a pool bounded by count and private dirty memory.
package cr
