package probe

import (
	"fmt"

	"github.com/cilium/ebpf/asm"
)

// Counters kept per cgroup in the cgstats map (one u64 each). The eBPF
// programs add to them atomically; userspace zeroes them at Begin and reads
// and deletes them at End.
const (
	cForked = iota
	cExecs
	cSignals
	cMmaps
	cMunmaps
	cBrks
	cCreated
	cModified
	cDeleted
	cRenamed
	cMeta
	cRemote
	cListens
	cBytesSent
	cLost
	cSampFS
	cSampExec
	cSampNet
	nCounters
)

// Event kinds in the ring buffer.
const (
	evFS   = 1
	evExec = 2
	evNet  = 3
)

// Event layout (little-endian), built on the BPF stack at fp-evtSize.
const (
	evtSize    = 184
	evtCgid    = 0   // u64
	evtKind    = 8   // u32
	evtPID     = 12  // u32 (tgid)
	evtAux     = 16  // u64: counter index for evFS
	evtComm    = 40  // [16]byte
	evtData    = 56  // [128]byte: path, exec file name, or raw sockaddr for evNet
	evtDataLen = 128 // bytes of evtData
)

// Syscall classes in the sysclass map. A class word is
// class | pathOff<<8 | argOff<<16 | counter<<24, the offsets being byte
// offsets into struct pt_regs (x86_64) of the path and the argument the
// class inspects.
const (
	clsFS = iota + 1
	clsOpen
	clsOpenat2
	clsCreat
	clsMmap
	clsMunmap
	clsBrk
)

// struct pt_regs offsets on x86_64.
const (
	regR10    = 56
	regR8     = 72
	regDX     = 96
	regSI     = 104
	regDI     = 112
	regOrigAX = 120
)

const (
	oWRONLY    = 0x1
	oRDWR      = 0x2
	oCREAT     = 0x40
	oTRUNC     = 0x200
	tcpSynSent = 2
	tcpListen  = 10
	// sampleLimit bounds the ring-buffer samples of one kind per window.
	sampleLimit = 32
)

func cls(class, pathOff, argOff, counter int) uint32 {
	return uint32(class | pathOff<<8 | argOff<<16 | counter<<24)
}

// sysClasses maps x86_64 syscall numbers to class words.
var sysClasses = map[int]uint32{
	2:   cls(clsOpen, regDI, regSI, 0),    // open(path, flags)
	257: cls(clsOpen, regSI, regDX, 0),    // openat(dfd, path, flags)
	437: cls(clsOpenat2, regSI, regDX, 0), // openat2(dfd, path, how)
	85:  cls(clsCreat, regDI, 0, 0),       // creat(path)

	83:  cls(clsFS, regDI, 0, cCreated),  // mkdir
	258: cls(clsFS, regSI, 0, cCreated),  // mkdirat
	133: cls(clsFS, regDI, 0, cCreated),  // mknod
	259: cls(clsFS, regSI, 0, cCreated),  // mknodat
	88:  cls(clsFS, regSI, 0, cCreated),  // symlink(target, newpath)
	266: cls(clsFS, regDX, 0, cCreated),  // symlinkat(target, dfd, newpath)
	86:  cls(clsFS, regSI, 0, cCreated),  // link(old, new)
	265: cls(clsFS, regR10, 0, cCreated), // linkat(odfd, old, ndfd, new)
	87:  cls(clsFS, regDI, 0, cDeleted),  // unlink
	263: cls(clsFS, regSI, 0, cDeleted),  // unlinkat
	84:  cls(clsFS, regDI, 0, cDeleted),  // rmdir
	82:  cls(clsFS, regDI, 0, cRenamed),  // rename(old, new)
	264: cls(clsFS, regSI, 0, cRenamed),  // renameat
	316: cls(clsFS, regSI, 0, cRenamed),  // renameat2
	76:  cls(clsFS, regDI, 0, cModified), // truncate
	77:  cls(clsFS, 0, 0, cModified),     // ftruncate
	285: cls(clsFS, 0, 0, cModified),     // fallocate
	90:  cls(clsFS, regDI, 0, cMeta),     // chmod
	91:  cls(clsFS, 0, 0, cMeta),         // fchmod
	268: cls(clsFS, regSI, 0, cMeta),     // fchmodat
	452: cls(clsFS, regSI, 0, cMeta),     // fchmodat2
	92:  cls(clsFS, regDI, 0, cMeta),     // chown
	93:  cls(clsFS, 0, 0, cMeta),         // fchown
	94:  cls(clsFS, regDI, 0, cMeta),     // lchown
	260: cls(clsFS, regSI, 0, cMeta),     // fchownat
	132: cls(clsFS, regDI, 0, cMeta),     // utime
	235: cls(clsFS, regDI, 0, cMeta),     // utimes
	280: cls(clsFS, regSI, 0, cMeta),     // utimensat (path may be NULL)
	261: cls(clsFS, regSI, 0, cMeta),     // futimesat
	188: cls(clsFS, regDI, 0, cMeta),     // setxattr
	189: cls(clsFS, regDI, 0, cMeta),     // lsetxattr
	190: cls(clsFS, 0, 0, cMeta),         // fsetxattr
	197: cls(clsFS, regDI, 0, cMeta),     // removexattr
	198: cls(clsFS, regDI, 0, cMeta),     // lremovexattr
	199: cls(clsFS, 0, 0, cMeta),         // fremovexattr

	9:  cls(clsMmap, 0, 0, 0),
	25: cls(clsMmap, 0, 0, 0), // mremap
	11: cls(clsMunmap, 0, 0, 0),
	12: cls(clsBrk, 0, regDI, 0),
}

// Stack layout of the programs (offsets from the frame pointer R10).
const (
	stEvt  = -evtSize // the event, 184 bytes
	stTmp  = -192     // 8 bytes scratch
	stTmp2 = -200     // 8 bytes scratch
	stSA   = -224     // 24 bytes of sockaddr
	stKey  = -232     // cgroup id, the cgstats key
)

// builder assembles a program with named labels.
type builder struct {
	insns   asm.Instructions
	pending string
}

func (b *builder) emit(ins ...asm.Instruction) {
	for _, in := range ins {
		if b.pending != "" {
			in = in.WithSymbol(b.pending)
			b.pending = ""
		}
		b.insns = append(b.insns, in)
	}
}

// label names the next instruction.
func (b *builder) label(name string) {
	if b.pending != "" {
		// Two labels on one spot: separate them with a no-op jump.
		b.emit(asm.Instruction{OpCode: asm.OpCode(asm.JumpClass).SetJumpOp(asm.Ja), Offset: 0})
	}
	b.pending = name
}

// incr adds 1 to counter idx of the value at R7.
func (b *builder) incr(idx int) {
	b.emit(asm.Mov.Imm(asm.R1, 1), asm.AddAtomic.Mem(asm.R7, asm.R1, asm.DWord, int16(idx*8)))
}

// limit jumps to exit when counter idx reached sampleLimit, else adds 1.
func (b *builder) limit(idx int) {
	b.emit(
		asm.LoadMem(asm.R1, asm.R7, int16(idx*8), asm.DWord),
		asm.JGE.Imm(asm.R1, sampleLimit, "exit"),
	)
	b.incr(idx)
}

// readReg reads the u64 at pt_regs+(R9>>shift & 0xff) into stTmp, exiting
// on failure. R8 holds the pt_regs pointer.
func (b *builder) readReg(shift int32) {
	b.emit(
		asm.Mov.Reg(asm.R3, asm.R9),
		asm.RSh.Imm(asm.R3, shift),
		asm.And.Imm(asm.R3, 0xff),
		asm.Add.Reg(asm.R3, asm.R8),
		asm.Mov.Reg(asm.R1, asm.RFP),
		asm.Add.Imm(asm.R1, stTmp),
		asm.Mov.Imm(asm.R2, 8),
		asm.FnProbeReadKernel.Call(),
		asm.JNE.Imm(asm.R0, 0, "exit"),
	)
}

// zeroEvt clears the event on the stack.
func (b *builder) zeroEvt() {
	b.emit(asm.Mov.Imm(asm.R1, 0))
	for off := stEvt; off < 0; off += 8 {
		b.emit(asm.StoreMem(asm.RFP, int16(off), asm.R1, asm.DWord))
	}
}

// header fills cgid, kind, pid and comm of the event.
func (b *builder) header(kind int32) {
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stKey, asm.DWord),
		asm.StoreMem(asm.RFP, stEvt+evtCgid, asm.R1, asm.DWord),
		asm.Mov.Imm(asm.R1, kind),
		asm.StoreMem(asm.RFP, stEvt+evtKind, asm.R1, asm.Word),
		asm.FnGetCurrentPidTgid.Call(),
		asm.RSh.Imm(asm.R0, 32),
		asm.StoreMem(asm.RFP, stEvt+evtPID, asm.R0, asm.Word),
		asm.Mov.Reg(asm.R1, asm.RFP),
		asm.Add.Imm(asm.R1, stEvt+evtComm),
		asm.Mov.Imm(asm.R2, 16),
		asm.FnGetCurrentComm.Call(),
	)
}

// output sends the event to the ring buffer, counting a failure as lost,
// and exits.
func (b *builder) output(events int) {
	b.emit(
		asm.LoadMapPtr(asm.R1, events),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, stEvt),
		asm.Mov.Imm(asm.R3, evtSize),
		asm.Mov.Imm(asm.R4, 0),
		asm.FnRingbufOutput.Call(),
		asm.JEq.Imm(asm.R0, 0, "exit"),
	)
	b.incr(cLost)
	b.emit(asm.Ja.Label("exit"))
}

// prologue looks up the current cgroup's counters: R7 = value or exit.
func (b *builder) prologue(cgstats int) {
	b.emit(
		asm.FnGetCurrentCgroupId.Call(),
		asm.StoreMem(asm.RFP, stKey, asm.R0, asm.DWord),
		asm.LoadMapPtr(asm.R1, cgstats),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, stKey),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "exit"),
		asm.Mov.Reg(asm.R7, asm.R0),
	)
}

func (b *builder) epilogue() {
	b.label("exit")
	b.emit(asm.Mov.Imm(asm.R0, 0), asm.Return())
}

// readUserStr reads the user string whose pointer is at stTmp into the
// event's data.
func (b *builder) readUserStrFromTmp() {
	b.emit(
		asm.LoadMem(asm.R3, asm.RFP, stTmp, asm.DWord),
		asm.Mov.Reg(asm.R1, asm.RFP),
		asm.Add.Imm(asm.R1, stEvt+evtData),
		asm.Mov.Imm(asm.R2, evtDataLen),
		asm.FnProbeReadUserStr.Call(),
	)
}

// sysExitProg builds the raw_syscalls:sys_exit program. Context: u64
// args[0] = struct pt_regs *, args[1] = return value.
func sysExitProg(cgstats, sysclass, events int) asm.Instructions {
	b := &builder{}
	// The syscall's class first (most syscalls have none and leave here),
	// then the cgroup: this order is the cheaper one for the sandbox's own
	// uninteresting syscalls.
	b.emit(
		asm.Mov.Reg(asm.R6, asm.R1),
		asm.LoadMem(asm.R8, asm.R6, 0, asm.DWord),
		asm.Mov.Reg(asm.R1, asm.RFP),
		asm.Add.Imm(asm.R1, stTmp),
		asm.Mov.Imm(asm.R2, 8),
		asm.Mov.Reg(asm.R3, asm.R8),
		asm.Add.Imm(asm.R3, regOrigAX),
		asm.FnProbeReadKernel.Call(),
		asm.JNE.Imm(asm.R0, 0, "exit"),
		asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.DWord),
		asm.JGT.Imm(asm.R1, 511, "exit"),
		asm.StoreMem(asm.RFP, stTmp, asm.R1, asm.Word),
		asm.LoadMapPtr(asm.R1, sysclass),
		asm.Mov.Reg(asm.R2, asm.RFP),
		asm.Add.Imm(asm.R2, stTmp),
		asm.FnMapLookupElem.Call(),
		asm.JEq.Imm(asm.R0, 0, "exit"),
		asm.LoadMem(asm.R9, asm.R0, 0, asm.Word),
		asm.JEq.Imm(asm.R9, 0, "exit"),
	)
	b.prologue(cgstats)
	b.emit(
		asm.LoadMem(asm.R6, asm.R6, 8, asm.DWord), // R6 = return value
		asm.Mov.Reg(asm.R1, asm.R9),
		asm.And.Imm(asm.R1, 0xff),
	)
	for _, c := range []struct {
		cls   int32
		label string
	}{
		{clsFS, "fs"}, {clsOpen, "open"}, {clsOpenat2, "openat2"}, {clsCreat, "creat"},
		{clsMmap, "mmap"}, {clsMunmap, "munmap"}, {clsBrk, "brk"},
	} {
		b.emit(asm.JEq.Imm(asm.R1, c.cls, c.label))
	}
	b.emit(asm.Ja.Label("exit"))

	// Memory.
	b.label("mmap")
	b.emit(asm.JSLT.Imm(asm.R6, 0, "exit"))
	b.incr(cMmaps)
	b.emit(asm.Ja.Label("exit"))

	b.label("munmap")
	b.emit(asm.JNE.Imm(asm.R6, 0, "exit"))
	b.incr(cMunmaps)
	b.emit(asm.Ja.Label("exit"))

	b.label("brk")
	b.readReg(16)
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.DWord),
		asm.JEq.Imm(asm.R1, 0, "exit"),
	)
	b.incr(cBrks)
	b.emit(asm.Ja.Label("exit"))

	// File system: a counter chosen by the class word, and a sample.
	b.label("fs")
	b.emit(
		asm.JSLT.Imm(asm.R6, 0, "exit"),
		asm.Mov.Reg(asm.R2, asm.R9),
		asm.RSh.Imm(asm.R2, 24),
		asm.JGT.Imm(asm.R2, nCounters-1, "exit"),
		asm.LSh.Imm(asm.R2, 3),
		asm.Add.Reg(asm.R2, asm.R7),
		asm.Mov.Imm(asm.R1, 1),
		asm.AddAtomic.Mem(asm.R2, asm.R1, asm.DWord, 0),
	)
	b.limit(cSampFS)
	b.zeroEvt()
	b.header(evFS)
	b.emit(
		asm.Mov.Reg(asm.R1, asm.R9),
		asm.RSh.Imm(asm.R1, 24),
		asm.StoreMem(asm.RFP, stEvt+evtAux, asm.R1, asm.DWord),
		asm.Mov.Reg(asm.R1, asm.R9),
		asm.RSh.Imm(asm.R1, 8),
		asm.And.Imm(asm.R1, 0xff),
		asm.JEq.Imm(asm.R1, 0, "fs_out"),
	)
	b.readReg(8)
	b.readUserStrFromTmp()
	b.label("fs_out")
	b.output(events)

	// Opens: flags go to stTmp2, then the common path.
	b.label("open")
	b.emit(asm.JSLT.Imm(asm.R6, 0, "exit"))
	b.readReg(16)
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.DWord),
		asm.StoreMem(asm.RFP, stTmp2, asm.R1, asm.DWord),
		asm.Ja.Label("open_common"),
	)

	b.label("openat2")
	b.emit(asm.JSLT.Imm(asm.R6, 0, "exit"))
	b.readReg(16)
	b.emit(
		asm.LoadMem(asm.R3, asm.RFP, stTmp, asm.DWord),
		asm.Mov.Reg(asm.R1, asm.RFP),
		asm.Add.Imm(asm.R1, stTmp2),
		asm.Mov.Imm(asm.R2, 8),
		asm.FnProbeReadUser.Call(),
		asm.JNE.Imm(asm.R0, 0, "exit"),
		asm.Ja.Label("open_common"),
	)

	b.label("creat")
	b.emit(
		asm.JSLT.Imm(asm.R6, 0, "exit"),
		asm.Mov.Imm(asm.R1, oCREAT|oWRONLY|oTRUNC),
		asm.StoreMem(asm.RFP, stTmp2, asm.R1, asm.DWord),
	)

	b.label("open_common")
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stTmp2, asm.DWord),
		asm.And.Imm(asm.R1, oWRONLY|oRDWR|oCREAT|oTRUNC),
		asm.JEq.Imm(asm.R1, 0, "exit"),
	)
	b.zeroEvt()
	b.readReg(8)
	b.readUserStrFromTmp()
	// Writes to /dev, /proc and /sys are not file-system state.
	for _, p := range []struct {
		prefix string
		mask   int64
	}{{"/dev/", 0xff_ffff_ffff}, {"/sys/", 0xff_ffff_ffff}, {"/proc/", 0xffff_ffff_ffff}} {
		var v int64
		for i := len(p.prefix) - 1; i >= 0; i-- {
			v = v<<8 | int64(p.prefix[i])
		}
		b.emit(
			asm.LoadMem(asm.R1, asm.RFP, stEvt+evtData, asm.DWord),
			asm.LoadImm(asm.R2, p.mask, asm.DWord),
			asm.And.Reg(asm.R1, asm.R2),
			asm.LoadImm(asm.R2, v, asm.DWord),
			asm.JEq.Reg(asm.R1, asm.R2, "exit"),
		)
	}
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stTmp2, asm.DWord),
		asm.And.Imm(asm.R1, oCREAT),
		asm.JEq.Imm(asm.R1, 0, "open_mod"),
	)
	b.incr(cCreated)
	b.emit(
		asm.Mov.Imm(asm.R1, cCreated),
		asm.StoreMem(asm.RFP, stTmp, asm.R1, asm.DWord),
		asm.Ja.Label("open_sample"),
	)
	b.label("open_mod")
	b.incr(cModified)
	b.emit(
		asm.Mov.Imm(asm.R1, cModified),
		asm.StoreMem(asm.RFP, stTmp, asm.R1, asm.DWord),
	)
	b.label("open_sample")
	b.limit(cSampFS)
	b.header(evFS)
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.DWord),
		asm.StoreMem(asm.RFP, stEvt+evtAux, asm.R1, asm.DWord),
	)
	b.output(events)

	b.epilogue()
	return b.insns
}

// execProg builds the sched_process_exec program. Context: u64 args[0] =
// struct task_struct *, args[1] = old pid, args[2] = struct linux_binprm *.
// filenameOff is the offset of linux_binprm.filename, or -1 if unknown.
func execProg(cgstats, events int, filenameOff int) asm.Instructions {
	b := &builder{}
	b.emit(asm.Mov.Reg(asm.R6, asm.R1))
	b.prologue(cgstats)
	b.incr(cExecs)
	b.limit(cSampExec)
	b.zeroEvt()
	b.header(evExec)
	if filenameOff >= 0 {
		b.emit(
			asm.LoadMem(asm.R3, asm.R6, 16, asm.DWord),
			asm.Add.Imm(asm.R3, int32(filenameOff)),
			asm.Mov.Reg(asm.R1, asm.RFP),
			asm.Add.Imm(asm.R1, stTmp),
			asm.Mov.Imm(asm.R2, 8),
			asm.FnProbeReadKernel.Call(),
			asm.JNE.Imm(asm.R0, 0, "exec_out"),
			asm.LoadMem(asm.R3, asm.RFP, stTmp, asm.DWord),
			asm.Mov.Reg(asm.R1, asm.RFP),
			asm.Add.Imm(asm.R1, stEvt+evtData),
			asm.Mov.Imm(asm.R2, evtDataLen),
			asm.FnProbeReadKernelStr.Call(),
		)
	}
	b.label("exec_out")
	b.output(events)
	b.epilogue()
	return b.insns
}

// fsOpName names the counter an evFS sample was counted in.
func fsOpName(counter uint64) string {
	switch counter {
	case cCreated:
		return "create"
	case cModified:
		return "modify"
	case cDeleted:
		return "delete"
	case cRenamed:
		return "rename"
	case cMeta:
		return "meta"
	}
	return fmt.Sprintf("op%d", counter)
}

// kernelOffsets are byte offsets of kernel struct fields, from the kernel's
// BTF; -1 when unknown.
type kernelOffsets struct {
	binprmFilename int // linux_binprm.filename
	taskPID        int // task_struct.pid
	taskTGID       int // task_struct.tgid
	skFamily       int // sock_common.skc_family
	skDport        int // sock_common.skc_dport
	skDaddr        int // sock_common.skc_daddr
	skV6Daddr      int // sock_common.skc_v6_daddr
}

// forkProg builds the sched_process_fork program (args: parent, child; it
// runs in the parent). Threads are not counted when task_struct's pid and
// tgid offsets are known.
func forkProg(cgstats int, o kernelOffsets) asm.Instructions {
	b := &builder{}
	b.emit(asm.Mov.Reg(asm.R6, asm.R1))
	b.prologue(cgstats)
	if o.taskPID >= 0 && o.taskTGID >= 0 {
		b.emit(asm.LoadMem(asm.R8, asm.R6, 8, asm.DWord)) // child
		b.readKernel(asm.R8, o.taskPID, stTmp, 4)
		b.readKernel(asm.R8, o.taskTGID, stTmp2, 4)
		b.emit(
			asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.Word),
			asm.LoadMem(asm.R2, asm.RFP, stTmp2, asm.Word),
			asm.JNE.Reg(asm.R1, asm.R2, "exit"),
		)
	}
	b.incr(cForked)
	b.epilogue()
	return b.insns
}

// readKernel copies size bytes at base+off (kernel memory) to the stack at
// dst, exiting on failure.
func (b *builder) readKernel(base asm.Register, off int, dst int16, size int32) {
	b.emit(
		asm.Mov.Reg(asm.R3, base),
		asm.Add.Imm(asm.R3, int32(off)),
		asm.Mov.Reg(asm.R1, asm.RFP),
		asm.Add.Imm(asm.R1, int32(dst)),
		asm.Mov.Imm(asm.R2, size),
		asm.FnProbeReadKernel.Call(),
		asm.JNE.Imm(asm.R0, 0, "exit"),
	)
}

// signalProg builds the signal_generate program (args: sig, info, task,
// group, result; it runs in the sender). Only signals sent by a process to
// another process count (kill, tgkill, sigqueue, ...): SEND_SIG_PRIV,
// kernel si_codes (> 0: SIGCHLD, SIGSEGV, SIGPIPE, ...) and signals to
// oneself do not.
func signalProg(cgstats int, o kernelOffsets) asm.Instructions {
	b := &builder{}
	b.emit(asm.Mov.Reg(asm.R6, asm.R1))
	b.prologue(cgstats)
	if o.taskTGID >= 0 {
		// A process signalling itself (raise, abort, the Go runtime's
		// preemption signals) affects no other process: not counted.
		b.emit(asm.LoadMem(asm.R8, asm.R6, 16, asm.DWord)) // target task
		b.readKernel(asm.R8, o.taskTGID, stTmp, 4)
		b.emit(
			asm.FnGetCurrentPidTgid.Call(),
			asm.RSh.Imm(asm.R0, 32),
			asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.Word),
			asm.JEq.Reg(asm.R0, asm.R1, "exit"),
		)
	}
	b.emit(
		asm.LoadMem(asm.R8, asm.R6, 8, asm.DWord), // info
		asm.JEq.Imm(asm.R8, 0, "count"),           // SEND_SIG_NOINFO: from a process
		asm.JEq.Imm(asm.R8, 1, "exit"),            // SEND_SIG_PRIV: from the kernel
	)
	b.readKernel(asm.R8, 8, stTmp, 4) // kernel_siginfo.si_code
	b.emit(
		asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.Word),
		asm.JSGT.Imm32(asm.R1, 0, "exit"),
	)
	b.label("count")
	b.incr(cSignals)
	b.epilogue()
	return b.insns
}

// sockStateProg builds the inet_sock_set_state program (args: sk,
// oldstate, newstate). TCP_LISTEN counts a listening socket; TCP_SYN_SENT
// (set by connect, in the connecting process) counts a connection when the
// peer is not loopback.
func sockStateProg(cgstats, events int, o kernelOffsets) asm.Instructions {
	b := &builder{}
	b.emit(asm.Mov.Reg(asm.R6, asm.R1))
	b.prologue(cgstats)
	b.emit(
		asm.LoadMem(asm.R1, asm.R6, 16, asm.DWord),
		asm.JEq.Imm32(asm.R1, tcpListen, "listen"),
		asm.JEq.Imm32(asm.R1, tcpSynSent, "connect"),
		asm.Ja.Label("exit"),
	)
	b.label("listen")
	b.incr(cListens)
	b.emit(asm.Ja.Label("exit"))

	b.label("connect")
	if o.skFamily < 0 || o.skDport < 0 || o.skDaddr < 0 {
		b.emit(asm.Ja.Label("remote")) // cannot tell loopback: count it
	} else {
		b.emit(asm.Mov.Imm(asm.R1, 0))
		for off := stSA; off < stSA+24; off += 8 {
			b.emit(asm.StoreMem(asm.RFP, int16(off), asm.R1, asm.DWord))
		}
		b.emit(asm.LoadMem(asm.R8, asm.R6, 0, asm.DWord)) // sk
		b.readKernel(asm.R8, o.skFamily, stSA, 2)
		b.readKernel(asm.R8, o.skDport, stSA+2, 2)
		b.emit(
			asm.LoadMem(asm.R1, asm.RFP, stSA, asm.Half),
			asm.JEq.Imm(asm.R1, 2, "addr4"),
			asm.JEq.Imm(asm.R1, 10, "addr6"),
			asm.Ja.Label("exit"),
		)
		b.label("addr4")
		b.readKernel(asm.R8, o.skDaddr, stSA+4, 4)
		b.emit(
			asm.LoadMem(asm.R1, asm.RFP, stSA+4, asm.Byte),
			asm.JEq.Imm(asm.R1, 127, "exit"),
			asm.LoadMem(asm.R1, asm.RFP, stSA+4, asm.Word),
			asm.JEq.Imm(asm.R1, 0, "exit"),
			asm.Ja.Label("remote"),
		)
		b.label("addr6")
		if o.skV6Daddr < 0 {
			b.emit(asm.Ja.Label("remote"))
		} else {
			b.readKernel(asm.R8, o.skV6Daddr, stSA+8, 16)
			b.emit(
				asm.LoadMem(asm.R1, asm.RFP, stSA+8, asm.DWord),
				asm.LoadMem(asm.R2, asm.RFP, stSA+16, asm.DWord),
				asm.JNE.Imm(asm.R1, 0, "remote"),
				asm.JEq.Imm(asm.R2, 0, "exit"), // ::
				asm.LoadImm(asm.R3, 0x0100000000000000, asm.DWord),
				asm.JEq.Reg(asm.R2, asm.R3, "exit"), // ::1
				asm.Mov.Reg(asm.R3, asm.R2),
				asm.LSh.Imm(asm.R3, 32),
				asm.RSh.Imm(asm.R3, 32),
				asm.LoadImm(asm.R4, 0xffff0000, asm.DWord),
				asm.JNE.Reg(asm.R3, asm.R4, "remote"),
				asm.Mov.Reg(asm.R3, asm.R2),
				asm.RSh.Imm(asm.R3, 32),
				asm.JEq.Imm(asm.R3, 0, "exit"), // ::ffff:0.0.0.0
				asm.And.Imm(asm.R3, 0xff),
				asm.JEq.Imm(asm.R3, 127, "exit"), // ::ffff:127.x
			)
		}
	}
	b.label("remote")
	b.incr(cRemote)
	b.limit(cSampNet)
	b.zeroEvt()
	for off := int16(0); off < 24; off += 8 {
		b.emit(
			asm.LoadMem(asm.R1, asm.RFP, stSA+off, asm.DWord),
			asm.StoreMem(asm.RFP, stEvt+evtData+off, asm.R1, asm.DWord),
		)
	}
	b.header(evNet)
	b.output(events)
	b.epilogue()
	return b.insns
}

// sendLenProg builds the sock_send_length program (args: sk, ret, flags;
// it runs in the sender): bytes sent on inet sockets.
func sendLenProg(cgstats int, o kernelOffsets) asm.Instructions {
	b := &builder{}
	b.emit(asm.Mov.Reg(asm.R6, asm.R1))
	b.prologue(cgstats)
	b.emit(
		asm.LoadMem(asm.R9, asm.R6, 8, asm.DWord),
		asm.LSh.Imm(asm.R9, 32),
		asm.ArSh.Imm(asm.R9, 32), // sign-extend the int
		asm.JSLE.Imm(asm.R9, 0, "exit"),
		asm.LoadMem(asm.R8, asm.R6, 0, asm.DWord),
	)
	if o.skFamily >= 0 {
		b.readKernel(asm.R8, o.skFamily, stTmp, 2)
		b.emit(
			asm.LoadMem(asm.R1, asm.RFP, stTmp, asm.Half),
			asm.JEq.Imm(asm.R1, 2, "inet"),
			asm.JEq.Imm(asm.R1, 10, "inet"),
			asm.Ja.Label("exit"),
		)
	}
	b.label("inet")
	b.emit(asm.AddAtomic.Mem(asm.R7, asm.R9, asm.DWord, cBytesSent*8))
	b.epilogue()
	return b.insns
}
