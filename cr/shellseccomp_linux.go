package cr

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// The seccomp filter of a digest copy (see Engine.ShellDigest). Whatever
// code the copy runs — our dump, but also a DEBUG trap or a function named
// like a builtin that the agent defined — it may only read its stdin (our
// pipe), write its stdout and stderr (our pipe), manage its own memory,
// descriptors and signal handlers, and read its own ids, limits and the
// clock. It cannot open, create or change a file, write to or seek on a
// descriptor it shares with the live shell (an `exec 3>f`), fork, exec,
// signal another process or change a limit: every other call fails with
// EPERM. A non-x86-64 call kills it.

// Seccomp data offsets (struct seccomp_data): nr, arch, then the u64
// arguments from offset 16; the low half of argument i is at 16+8i.
const (
	seccompNr   = 0
	seccompArch = 4
)

func seccompArgLo(i int) uint32 { return uint32(16 + 8*i) }
func seccompArgHi(i int) uint32 { return uint32(20 + 8*i) }

// bpfIns is a classic BPF instruction whose jumps name labels.
type bpfIns struct {
	label  string // label of this instruction ("" for none)
	code   uint16
	k      uint32
	jt, jf string // jump targets ("" = next instruction)
}

func bpfLd(off uint32) bpfIns {
	return bpfIns{code: unix.BPF_LD | unix.BPF_W | unix.BPF_ABS, k: off}
}

func bpfJeq(k uint32, jt, jf string) bpfIns {
	return bpfIns{code: unix.BPF_JMP | unix.BPF_JEQ | unix.BPF_K, k: k, jt: jt, jf: jf}
}

func bpfRet(k uint32) bpfIns { return bpfIns{code: unix.BPF_RET | unix.BPF_K, k: k} }

// assemble resolves labels into jump offsets.
func assemble(ins []bpfIns) ([]unix.SockFilter, error) {
	at := map[string]int{}
	for i, in := range ins {
		if in.label != "" {
			at[in.label] = i
		}
	}
	off := func(i int, l string) (uint8, error) {
		if l == "" {
			return 0, nil
		}
		t, ok := at[l]
		if !ok || t <= i || t-i-1 > 255 {
			return 0, fmt.Errorf("bpf: bad jump from %d to %q", i, l)
		}
		return uint8(t - i - 1), nil
	}
	out := make([]unix.SockFilter, len(ins))
	for i, in := range ins {
		jt, err := off(i, in.jt)
		if err != nil {
			return nil, err
		}
		jf, err := off(i, in.jf)
		if err != nil {
			return nil, err
		}
		out[i] = unix.SockFilter{Code: in.code, Jt: jt, Jf: jf, K: in.k}
	}
	return out, nil
}

// copyAllowed are the calls a digest copy may make with any arguments.
var copyAllowed = []uint32{
	unix.SYS_CLOSE, unix.SYS_FSTAT, unix.SYS_NEWFSTATAT,
	unix.SYS_BRK, unix.SYS_MUNMAP, unix.SYS_MREMAP, unix.SYS_MPROTECT, unix.SYS_MADVISE,
	unix.SYS_RT_SIGACTION, unix.SYS_RT_SIGPROCMASK, unix.SYS_RT_SIGRETURN, unix.SYS_SIGALTSTACK,
	unix.SYS_DUP, unix.SYS_DUP2, unix.SYS_DUP3, unix.SYS_UMASK,
	unix.SYS_GETPID, unix.SYS_GETPPID, unix.SYS_GETPGRP, unix.SYS_GETPGID, unix.SYS_GETSID, unix.SYS_GETTID,
	unix.SYS_GETUID, unix.SYS_GETEUID, unix.SYS_GETGID, unix.SYS_GETEGID, unix.SYS_GETGROUPS,
	unix.SYS_GETCWD, unix.SYS_UNAME, unix.SYS_GETRANDOM, unix.SYS_CLOCK_GETTIME, unix.SYS_GETTIMEOFDAY,
	unix.SYS_TIME, unix.SYS_TIMES, unix.SYS_GETRUSAGE, unix.SYS_SYSINFO, unix.SYS_GETRLIMIT,
	unix.SYS_WAIT4, unix.SYS_NANOSLEEP, unix.SYS_CLOCK_NANOSLEEP, unix.SYS_POLL, unix.SYS_PPOLL,
	unix.SYS_SELECT, unix.SYS_PSELECT6, unix.SYS_FUTEX, unix.SYS_SCHED_YIELD, unix.SYS_RESTART_SYSCALL,
	unix.SYS_EXIT, unix.SYS_EXIT_GROUP,
}

// copyFilter builds the digest copy's seccomp filter.
func copyFilter() ([]unix.SockFilter, error) {
	const (
		allow = "allow"
		deny  = "deny"
	)
	p := []bpfIns{
		bpfLd(seccompArch),
		bpfJeq(unix.AUDIT_ARCH_X86_64, "", "kill"),
		bpfLd(seccompNr),
	}
	for _, nr := range copyAllowed {
		p = append(p, bpfJeq(nr, allow, ""))
	}
	// Conditional calls: each block starts by testing the number and
	// skips to the next block when it differs.
	type block struct {
		nr   uint32
		body []bpfIns
	}
	argIs := func(i int, vals ...uint32) []bpfIns {
		b := []bpfIns{bpfLd(seccompArgLo(i))}
		for _, v := range vals {
			b = append(b, bpfJeq(v, allow, ""))
		}
		return append(b, bpfRet(unix.SECCOMP_RET_ERRNO|uint32(unix.EPERM)))
	}
	fcntl := []bpfIns{bpfLd(seccompArgLo(1))}
	for _, c := range []uint32{unix.F_GETFD, unix.F_SETFD, unix.F_DUPFD, unix.F_DUPFD_CLOEXEC, unix.F_GETFL} {
		fcntl = append(fcntl, bpfJeq(c, allow, ""))
	}
	// F_SETFL changes the open file, shared with the live shell: only on
	// the copy's own stdio pipes.
	fcntl = append(fcntl, bpfJeq(unix.F_SETFL, "", deny), bpfLd(seccompArgLo(0)))
	fcntl = append(fcntl, argIs(0, 0, 1, 2)[1:]...)
	blocks := []block{
		{unix.SYS_READ, argIs(0, 0)},
		{unix.SYS_READV, argIs(0, 0)},
		{unix.SYS_LSEEK, argIs(0, 0)},
		{unix.SYS_WRITE, argIs(0, 1, 2)},
		{unix.SYS_WRITEV, argIs(0, 1, 2)},
		{unix.SYS_IOCTL, argIs(1, unix.TCGETS, unix.TIOCGWINSZ, unix.TIOCGPGRP)},
		{unix.SYS_FCNTL, fcntl},
		// Anonymous mappings only (fd -1): a shared mapping of a file
		// would write it.
		{unix.SYS_MMAP, argIs(4, 0xffffffff)},
		// prlimit64 reading limits only (new_limit NULL).
		{unix.SYS_PRLIMIT64, []bpfIns{
			bpfLd(seccompArgLo(2)), bpfJeq(0, "", deny),
			bpfLd(seccompArgHi(2)), bpfJeq(0, allow, deny),
		}},
	}
	for i, b := range blocks {
		next := fmt.Sprint("block", i+1)
		if i == len(blocks)-1 {
			next = deny
		}
		in := bpfJeq(b.nr, "", next)
		in.label = fmt.Sprint("block", i)
		p = append(p, in)
		p = append(p, b.body...)
	}
	p = append(p,
		bpfIns{label: deny, code: unix.BPF_RET | unix.BPF_K, k: unix.SECCOMP_RET_ERRNO | uint32(unix.EPERM)},
		bpfIns{label: allow, code: unix.BPF_RET | unix.BPF_K, k: unix.SECCOMP_RET_ALLOW},
		bpfIns{label: "kill", code: unix.BPF_RET | unix.BPF_K, k: unix.SECCOMP_RET_KILL_PROCESS},
	)
	return assemble(p)
}
