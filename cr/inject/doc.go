// Package inject makes a non-cooperating, single-threaded Linux process
// execute system calls on rewind's behalf, by ptrace: it seizes the process,
// saves its registers, points the instruction pointer at a `syscall`
// instruction of the process's vDSO, single-steps it, and restores the
// registers exactly (an interrupted system call is restarted as the kernel
// would have done).
//
// Every ptrace request is issued from one locked OS thread owned by a
// Tracer; a Tracer serialises the work of all the processes it traces.
package inject
