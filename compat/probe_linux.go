package compat

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"time"
	"unsafe"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/asm"
	"github.com/cilium/ebpf/btf"
	"github.com/cilium/ebpf/features"
	"github.com/cilium/ebpf/link"
	"github.com/hanwen/go-fuse/v2/fuse"
	"github.com/rewind-sandbox/rewind/internal/procfs"
	"github.com/rewind-sandbox/rewind/kernelpath"
	"golang.org/x/sys/unix"
)

// DefaultStateDir is the daemon's default state directory.
const DefaultStateDir = "/var/lib/rewind"

// groupOrder fixes the order in which groups appear in a report.
var groupOrder = []string{"kernel", "fuse", "overlayfs", "statedir", "ebpf", "criu"}

func probeHost(ctx context.Context, opts Options) *Report {
	r := &Report{StateDir: opts.StateDir}
	if r.StateDir == "" {
		r.StateDir = DefaultStateDir
	}
	var uts unix.Utsname
	if err := unix.Uname(&uts); err == nil {
		r.Kernel = unix.ByteSliceToString(uts.Release[:])
	}
	kv, _ := ParseKernelVersion(r.Kernel)

	probes := map[string]func() []Check{
		"kernel":    func() []Check { return probeKernel() },
		"fuse":      func() []Check { return probeFUSE(kv) },
		"overlayfs": func() []Check { return probeOverlay() },
		"statedir": func() []Check {
			return append(probeStateDir(r.StateDir, opts.SkipLoopXFS), probeKernelPath(r.StateDir))
		},
		"ebpf": func() []Check { return probeEBPF() },
		"criu": func() []Check { return probeCRIU(ctx, opts.CRIUPath) },
	}
	results := make(map[string][]Check, len(probes))
	var mu sync.Mutex
	var wg sync.WaitGroup
	for g, f := range probes {
		wg.Add(1)
		go func() {
			defer wg.Done()
			cs := f()
			mu.Lock()
			results[g] = cs
			mu.Unlock()
		}()
	}
	wg.Wait()
	for _, g := range groupOrder {
		for _, c := range results[g] {
			c.Group = g
			r.Checks = append(r.Checks, c)
		}
	}
	return r
}

func ok(name, detail string) Check       { return Check{Name: name, Status: OK, Detail: detail} }
func missing(name, detail string) Check  { return Check{Name: name, Status: Missing, Detail: detail} }
func degraded(name, detail string) Check { return Check{Name: name, Status: Degraded, Detail: detail} }

func errnoDetail(err error) string {
	var en syscall.Errno
	if errors.As(err, &en) {
		return fmt.Sprintf("%v (errno %s)", err, unix.ErrnoName(en))
	}
	return err.Error()
}

// ---- kernel: namespaces, cgroups, ptrace, userfaultfd, PAGEMAP_SCAN ----

func probeKernel() []Check {
	var cs []Check
	nsFlags := []struct {
		name string
		flag uintptr
	}{
		{"ns-pid", unix.CLONE_NEWPID},
		{"ns-mount", unix.CLONE_NEWNS},
		{"ns-net", unix.CLONE_NEWNET},
		{"ns-user", unix.CLONE_NEWUSER},
		{"ns-uts-ipc", unix.CLONE_NEWUTS | unix.CLONE_NEWIPC},
	}
	for _, ns := range nsFlags {
		cmd := exec.Command("/bin/true")
		cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: ns.flag}
		if err := cmd.Run(); err != nil {
			cs = append(cs, missing(ns.name, "cannot create the namespace: "+errnoDetail(err)+"; run as root on a kernel with namespaces enabled"))
		} else {
			cs = append(cs, ok(ns.name, "a child can be started in a new namespace"))
		}
	}
	cs = append(cs, probeFreezer())
	cs = append(cs, probePtrace())
	cs = append(cs, probeUserfaultfd())
	cs = append(cs, probePagemapScan())
	cs = append(cs, probeHugeCollapse())
	cs = append(cs, probePidnsTranslate(), probeProcmapQuery())
	return cs
}

// probePidnsTranslate checks that a PID namespace's descriptor translates
// a thread id into that namespace's (here the daemon's own namespace, so
// the answer is the id itself), as the cr engine's scans of a sandbox's
// processes do before a restore that recreates exact pids.
func probePidnsTranslate() Check {
	fd, err := unix.Open("/proc/self/ns/pid", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return degraded("pidns-translate", "open /proc/self/ns/pid: "+err.Error())
	}
	defer unix.Close(fd)
	tid := unix.Gettid()
	got, err := procfs.PIDInNS(fd, tid)
	if err != nil || got != tid {
		return degraded("pidns-translate", fmt.Sprintf("NS_GET_PID_IN_PIDNS: %d, %v: restores that recreate exact pids read each thread's /proc status instead (needs Linux >= 6.10)", got, err))
	}
	return ok("pidns-translate", "NS_GET_PID_IN_PIDNS translates thread ids into a PID namespace (one call per thread in the pid scans before image restores)")
}

// probeProcmapQuery checks that /proc/PID/maps answers PROCMAP_QUERY, as
// the cr engine's check for shared state does while a checkpoint holds
// the processes stopped: the shared mappings alone, without formatting
// every mapping's line.
func probeProcmapQuery() Check {
	fd, err := unix.Open("/proc/self/maps", unix.O_RDONLY|unix.O_CLOEXEC, 0)
	if err != nil {
		return degraded("procmap-query", "open /proc/self/maps: "+err.Error())
	}
	defer unix.Close(fd)
	if _, err := procfs.NextMapping(fd, 0, 0); err != nil {
		return degraded("procmap-query", fmt.Sprintf("PROCMAP_QUERY: %v: a checkpoint reads each stopped process's whole maps file instead (about 3x the time; needs Linux >= 6.11)", err))
	}
	return ok("procmap-query", "PROCMAP_QUERY lists a process's shared mappings (the check for state a template would share, while a checkpoint holds the processes stopped)")
}

func readMountinfo() ([]MountInfo, error) {
	f, err := os.Open("/proc/self/mountinfo")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ParseMountinfo(f)
}

// cgroup2Mount returns the mount point of the cgroup v2 hierarchy.
func cgroup2Mount() (string, error) {
	mounts, err := readMountinfo()
	if err != nil {
		return "", err
	}
	for _, m := range mounts {
		if m.FSType == "cgroup2" {
			return m.MountPoint, nil
		}
	}
	return "", errors.New("no cgroup2 file system is mounted")
}

func probeFreezer() Check {
	mounts, err := readMountinfo()
	if err != nil {
		return missing("cgroup-freezer", "read mountinfo: "+err.Error())
	}
	for _, m := range mounts {
		if m.FSType == "cgroup" && strings.Contains(","+m.SuperOptions+",", ",freezer,") {
			return ok("cgroup-freezer", "cgroup v1 freezer at "+m.MountPoint)
		}
	}
	for _, m := range mounts {
		if m.FSType == "cgroup2" {
			ctrl, _ := os.ReadFile(filepath.Join(m.MountPoint, "cgroup.controllers"))
			// cgroup.freeze exists in every non-root v2 cgroup (kernel >= 5.2).
			return ok("cgroup-freezer", "cgroup v2 cgroup.freeze at "+m.MountPoint+" (controllers: "+strings.TrimSpace(string(ctrl))+")")
		}
	}
	return missing("cgroup-freezer", "neither a cgroup v1 freezer nor cgroup v2 is mounted; mount cgroup2 or the v1 freezer controller")
}

func probePtrace() Check {
	scope := "absent (no Yama)"
	if b, err := os.ReadFile("/proc/sys/kernel/yama/ptrace_scope"); err == nil {
		scope = strings.TrimSpace(string(b))
		if scope == "3" {
			return missing("ptrace", "kernel.yama.ptrace_scope=3 forbids ptrace: template fork needs it; set it to 1 or less")
		}
	}
	if os.Geteuid() != 0 {
		return degraded("ptrace", "not root: template fork of sandbox processes needs CAP_SYS_PTRACE")
	}
	return ok("ptrace", "root; yama ptrace_scope "+scope)
}

func probeUserfaultfd() Check {
	fd, _, errno := unix.Syscall(unix.SYS_USERFAULTFD, unix.O_CLOEXEC|unix.O_NONBLOCK, 0, 0)
	if errno != 0 {
		return missing("userfaultfd", fmt.Sprintf("userfaultfd(2): %v (errno %s): CRIU lazy-pages and exact dirty tracking need CONFIG_USERFAULTFD", errno, unix.ErrnoName(errno)))
	}
	unix.Close(int(fd))
	return ok("userfaultfd", "userfaultfd(2) works (CRIU lazy-pages, write-protect tracking)")
}

// probeHugeCollapse checks that another process's memory can be moved into
// a transparent huge page with process_madvise(MADV_COLLAPSE), as the cr
// engine does after a checkpoint (cr.Config.NoCollapse), on a mapping of
// its own through its own pidfd.
func probeHugeCollapse() Check {
	const huge, madvCollapse = 2 << 20, 25
	mem, err := unix.Mmap(-1, 0, 2*huge, unix.PROT_READ|unix.PROT_WRITE, unix.MAP_PRIVATE|unix.MAP_ANONYMOUS)
	if err != nil {
		return degraded("huge-collapse", "mmap: "+err.Error())
	}
	defer unix.Munmap(mem)
	for i := range mem {
		if i%4096 == 0 {
			mem[i] = 1
		}
	}
	base := uintptr(unsafe.Pointer(&mem[0]))
	start := (base + huge - 1) &^ (huge - 1)
	pidfd, err := unix.PidfdOpen(os.Getpid(), 0)
	if err != nil {
		return degraded("huge-collapse", "pidfd_open: "+err.Error())
	}
	defer unix.Close(pidfd)
	iov := struct{ base, len uint64 }{uint64(start), huge}
	_, _, errno := unix.Syscall6(unix.SYS_PROCESS_MADVISE, uintptr(pidfd), uintptr(unsafe.Pointer(&iov)), 1, madvCollapse, 0, 0)
	if errno != 0 {
		thp, _ := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled")
		return degraded("huge-collapse", fmt.Sprintf("process_madvise(MADV_COLLAPSE): %v (errno %s; THP %s): checkpointed memory stays in 4 KiB pages, so template forks, restores and the frozen time grow with a process's memory (needs Linux >= 6.1 with THP not \"never\")", errno, unix.ErrnoName(errno), strings.TrimSpace(string(thp))))
	}
	return ok("huge-collapse", "process_madvise(MADV_COLLAPSE) works: checkpointed memory is moved into huge pages, so forks copy one entry per 2 MiB")
}

// pmScanArg mirrors struct pm_scan_arg of <linux/fs.h>.
type pmScanArg struct {
	Size, Flags, Start, End, Walk_end, Vec, Vec_len, Max_pages, Category_inverted, Category_mask, Category_anyof_mask, Return_mask uint64
}

// pagemapScan is PAGEMAP_SCAN = _IOWR('f', 16, struct pm_scan_arg).
const pagemapScan = 0xC0606610

func probePagemapScan() Check {
	f, err := os.Open("/proc/self/pagemap")
	if err != nil {
		return missing("pagemap-scan", "open /proc/self/pagemap: "+err.Error())
	}
	defer f.Close()
	arg := pmScanArg{Size: uint64(unsafe.Sizeof(pmScanArg{}))}
	_, _, errno := unix.Syscall(unix.SYS_IOCTL, f.Fd(), pagemapScan, uintptr(unsafe.Pointer(&arg)))
	if errno != 0 {
		return missing("pagemap-scan", fmt.Sprintf("PAGEMAP_SCAN ioctl: %v (errno %s): exact dirty-page tracking needs kernel >= 6.7; estimates from /proc are used", errno, unix.ErrnoName(errno)))
	}
	return ok("pagemap-scan", "PAGEMAP_SCAN ioctl works (exact written-page sets with userfaultfd write-protect)")
}

// ---- FUSE ----

func probeFUSE(kv KernelVersion) []Check {
	var cs []Check
	f, err := os.OpenFile("/dev/fuse", os.O_RDWR, 0)
	if err != nil {
		cs = append(cs, missing("dev-fuse", "open /dev/fuse: "+errnoDetail(err)+"; install fuse3 and load the fuse module (modprobe fuse)"))
		return append(cs, missing("mount", "no /dev/fuse"), missing("passthrough", "no /dev/fuse"))
	}
	f.Close()
	cs = append(cs, ok("dev-fuse", "/dev/fuse opens read-write"))

	dir, err := os.MkdirTemp("", "rewind-doctor-fuse-")
	if err != nil {
		return append(cs, missing("mount", "temp dir: "+err.Error()))
	}
	defer os.Remove(dir)
	srv, err := fuse.NewServer(fuse.NewDefaultRawFileSystem(), dir, &fuse.MountOptions{
		DirectMount: true, Name: "rewind-doctor", FsName: "rewind-doctor", DisableXAttrs: true,
	})
	if err != nil {
		return append(cs, missing("mount", "mount a FUSE file system: "+errnoDetail(err)+"; rewind needs root (or fusermount3 from fuse3)"),
			missing("passthrough", "FUSE mount failed"))
	}
	go srv.Serve()
	werr := srv.WaitMount()
	ks := srv.KernelSettings()
	if uerr := srv.Unmount(); uerr != nil {
		_ = unix.Unmount(dir, unix.MNT_DETACH)
	}
	if werr != nil {
		return append(cs, missing("mount", "FUSE mount did not come up: "+werr.Error()), missing("passthrough", "FUSE mount failed"))
	}
	cs = append(cs, ok("mount", fmt.Sprintf("mounted and unmounted a FUSE file system; kernel protocol %d.%d", ks.Major, ks.Minor)))
	if ks.Flags64()&fuse.CAP_PASSTHROUGH != 0 {
		cs = append(cs, ok("passthrough", "kernel offers FUSE_PASSTHROUGH (native-speed reads and writes of upper-layer files)"))
	} else {
		cs = append(cs, degraded("passthrough", fmt.Sprintf("kernel %s does not offer FUSE_PASSTHROUGH (needs 6.9+ with CONFIG_FUSE_PASSTHROUGH): file data goes through the daemon", kv)))
	}
	return cs
}

// ---- overlayfs ----

// ovlMaxStack is the kernel's limit on overlayfs lower layers (OVL_MAX_STACK).
const ovlMaxStack = 500

func probeOverlay() []Check {
	fss, err := readFilesystems()
	if err != nil {
		return []Check{missing("present", err.Error())}
	}
	if !fss["overlay"] {
		return []Check{
			missing("present", "overlay is not in /proc/filesystems: enable CONFIG_OVERLAY_FS or modprobe overlay"),
			missing("mount", "overlayfs absent"),
			missing("layer-switch-ioctl", "overlayfs absent"),
		}
	}
	cs := []Check{ok("present", "overlay is in /proc/filesystems")}
	dir, err := os.MkdirTemp("", "rewind-doctor-ovl-")
	if err != nil {
		return append(cs, missing("mount", "temp dir: "+err.Error()))
	}
	defer os.RemoveAll(dir)
	for _, d := range []string{"l1", "l2", "u", "w"} {
		if err := os.Mkdir(filepath.Join(dir, d), 0o755); err != nil {
			return append(cs, missing("mount", err.Error()))
		}
	}
	// The new mount API with lowerdir+ takes one layer per call, so no
	// option-string length limit applies; the mount is never attached to the
	// tree (closing the fd frees it).
	if err := fsmountOverlay([]string{filepath.Join(dir, "l1"), filepath.Join(dir, "l2")}, filepath.Join(dir, "u"), filepath.Join(dir, "w")); err == nil {
		cs = append(cs, ok("mount", fmt.Sprintf("overlay mounts through fsopen/fsconfig with lowerdir+; max %d lower layers", ovlMaxStack)))
	} else {
		target := filepath.Join(dir, "m")
		_ = os.Mkdir(target, 0o755)
		data := fmt.Sprintf("lowerdir=%s:%s,upperdir=%s,workdir=%s", filepath.Join(dir, "l1"), filepath.Join(dir, "l2"), filepath.Join(dir, "u"), filepath.Join(dir, "w"))
		if merr := unix.Mount("overlay", target, "overlay", 0, data); merr != nil {
			cs = append(cs, missing("mount", "mount overlay: "+errnoDetail(merr)+" (fsconfig lowerdir+: "+errnoDetail(err)+")"))
		} else {
			_ = unix.Unmount(target, unix.MNT_DETACH)
			cs = append(cs, degraded("mount", fmt.Sprintf("overlay mounts with mount(2) only (lowerdir+ unsupported: %v): the option string limits deep stacks below %d layers", err, ovlMaxStack)))
		}
	}
	switch err := kernelpath.ProbeSwitchIoctl(dir); {
	case err == nil:
		cs = append(cs, ok("layer-switch-ioctl", "patched overlayfs answers the layer-switch ioctl (kernelpath/ABI.md): O(1) kernel-path checkpoints"))
	case errors.Is(err, kernelpath.ErrIoctlAbsent):
		cs = append(cs, missing("layer-switch-ioctl", "stock overlayfs: no layer-switch ioctl (kernelpath/ABI.md); the kernel path freezes uppers by reflink copy instead"))
	default:
		cs = append(cs, missing("layer-switch-ioctl", "probe failed: "+errnoDetail(err)))
	}
	return cs
}

func fsmountOverlay(lowers []string, upper, work string) error {
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	if err != nil {
		return fmt.Errorf("fsopen: %w", err)
	}
	defer unix.Close(fd)
	for _, l := range lowers {
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			return fmt.Errorf("fsconfig lowerdir+: %w", err)
		}
	}
	if err := unix.FsconfigSetString(fd, "upperdir", upper); err != nil {
		return fmt.Errorf("fsconfig upperdir: %w", err)
	}
	if err := unix.FsconfigSetString(fd, "workdir", work); err != nil {
		return fmt.Errorf("fsconfig workdir: %w", err)
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		return fmt.Errorf("fsconfig create: %w", err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		return fmt.Errorf("fsmount: %w", err)
	}
	return unix.Close(mfd)
}

func readFilesystems() (map[string]bool, error) {
	f, err := os.Open("/proc/filesystems")
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return ParseFilesystems(f)
}

// ---- state directory: type, reflink, snapshots; loop XFS self-test ----

// fsTypeName names common statfs magic numbers.
func fsTypeName(magic int64) string {
	switch magic {
	case unix.XFS_SUPER_MAGIC:
		return "xfs"
	case unix.BTRFS_SUPER_MAGIC:
		return "btrfs"
	case unix.EXT4_SUPER_MAGIC:
		return "ext4"
	case unix.TMPFS_MAGIC:
		return "tmpfs"
	case unix.OVERLAYFS_SUPER_MAGIC:
		return "overlay"
	case unix.FUSE_SUPER_MAGIC:
		return "fuse"
	case 0x2fc12fc1:
		return "zfs"
	}
	return fmt.Sprintf("0x%x", magic)
}

// existingParent returns dir or its nearest existing ancestor.
func existingParent(dir string) string {
	d := filepath.Clean(dir)
	for {
		if _, err := os.Stat(d); err == nil {
			return d
		}
		p := filepath.Dir(d)
		if p == d {
			return d
		}
		d = p
	}
}

func probeStateDir(stateDir string, skipLoop bool) []Check {
	var cs []Check
	base := existingParent(stateDir)
	var st unix.Statfs_t
	if err := unix.Statfs(base, &st); err != nil {
		return []Check{missing("type", "statfs "+base+": "+errnoDetail(err))}
	}
	typ := fsTypeName(int64(st.Type))
	where := stateDir
	if base != filepath.Clean(stateDir) {
		where = fmt.Sprintf("%s (not created yet; probed %s)", stateDir, base)
	}
	cs = append(cs, ok("type", typ+" at "+where))
	if err := reflinkSelfTest(base); err != nil {
		cs = append(cs, missing("reflink", "FICLONE on "+typ+": "+errnoDetail(err)+"; copy-up falls back to copy_file_range. For reflink use XFS (mkfs.xfs -m reflink=1) or btrfs: rewind init-store"))
	} else {
		cs = append(cs, ok("reflink", "FICLONE works on "+typ+": copy-up shares extents"))
	}
	if typ == "btrfs" {
		if err := btrfsSnapshotSelfTest(base); err != nil {
			cs = append(cs, missing("btrfs-snapshot", "btrfs subvolume snapshot: "+err.Error()))
		} else {
			cs = append(cs, ok("btrfs-snapshot", "read-only subvolume snapshots work"))
		}
	} else {
		cs = append(cs, missing("btrfs-snapshot", "state dir is "+typ+", not btrfs"))
	}
	if !skipLoop {
		cs = append(cs, loopXFSSelfTest())
	}
	return cs
}

func reflinkSelfTest(dir string) error {
	tmp, err := os.MkdirTemp(dir, ".rewind-doctor-")
	if err != nil {
		return fmt.Errorf("temp dir in %s: %w", dir, err)
	}
	defer os.RemoveAll(tmp)
	src, err := os.Create(filepath.Join(tmp, "a"))
	if err != nil {
		return err
	}
	defer src.Close()
	if _, err := src.Write(bytes.Repeat([]byte{'r'}, 4096)); err != nil {
		return err
	}
	dst, err := os.Create(filepath.Join(tmp, "b"))
	if err != nil {
		return err
	}
	defer dst.Close()
	return unix.IoctlFileClone(int(dst.Fd()), int(src.Fd()))
}

func btrfsSnapshotSelfTest(dir string) error {
	bin, err := exec.LookPath("btrfs")
	if err != nil {
		return errors.New("btrfs CLI not found: install btrfs-progs")
	}
	sub := filepath.Join(dir, fmt.Sprintf(".rewind-doctor-sv-%d", os.Getpid()))
	snap := sub + "-snap"
	defer func() {
		_ = exec.Command(bin, "subvolume", "delete", snap).Run()
		_ = exec.Command(bin, "subvolume", "delete", sub).Run()
	}()
	if out, err := exec.Command(bin, "subvolume", "create", sub).CombinedOutput(); err != nil {
		return fmt.Errorf("subvolume create: %v: %s", err, bytes.TrimSpace(out))
	}
	if out, err := exec.Command(bin, "subvolume", "snapshot", "-r", sub, snap).CombinedOutput(); err != nil {
		return fmt.Errorf("subvolume snapshot: %v: %s", err, bytes.TrimSpace(out))
	}
	return nil
}

// loopXFSSelfTest makes a sparse XFS image with reflink=1, loop-mounts it,
// reflinks a file in it and tears everything down: it proves that
// `rewind init-store --xfs-image` can give this host a reflink state dir.
func loopXFSSelfTest() Check {
	const name = "xfs-reflink-loop"
	mkfs, err := exec.LookPath("mkfs.xfs")
	if err != nil {
		return missing(name, "mkfs.xfs not found: install xfsprogs (make deps)")
	}
	tmp, err := os.MkdirTemp("", "rewind-doctor-xfs-")
	if err != nil {
		return missing(name, err.Error())
	}
	defer os.RemoveAll(tmp)
	img := filepath.Join(tmp, "img")
	f, err := os.Create(img)
	if err != nil {
		return missing(name, err.Error())
	}
	// XFS needs at least 300 MiB; the file is sparse.
	err = f.Truncate(320 << 20)
	f.Close()
	if err != nil {
		return missing(name, "truncate image: "+err.Error())
	}
	if out, err := exec.Command(mkfs, "-q", "-m", "reflink=1", img).CombinedOutput(); err != nil {
		return missing(name, fmt.Sprintf("mkfs.xfs -m reflink=1: %v: %s", err, bytes.TrimSpace(out)))
	}
	mnt := filepath.Join(tmp, "mnt")
	if err := os.Mkdir(mnt, 0o755); err != nil {
		return missing(name, err.Error())
	}
	if out, err := exec.Command("mount", "-o", "loop", img, mnt).CombinedOutput(); err != nil {
		return missing(name, fmt.Sprintf("mount -o loop: %v: %s (needs root and loop devices)", err, bytes.TrimSpace(out)))
	}
	defer func() {
		if err := unix.Unmount(mnt, 0); err != nil {
			_ = unix.Unmount(mnt, unix.MNT_DETACH)
		}
	}()
	if err := reflinkSelfTest(mnt); err != nil {
		return missing(name, "FICLONE on loop-mounted XFS: "+errnoDetail(err))
	}
	return ok(name, "a loop-mounted XFS with reflink=1 reflinks files (rewind init-store --xfs-image)")
}

// probeKernelPath runs the kernel path's self-test on the state dir's file
// system: a scratch overlay, a 100-entry checkpoint and a switch, timed.
func probeKernelPath(stateDir string) Check {
	const name = "kernel-path"
	rep, err := kernelpath.SelfTest(existingParent(stateDir))
	if err != nil {
		return missing(name, "kernel path self-test: "+errnoDetail(err))
	}
	detail := "self-test: " + rep.Detail
	if onRootFS(stateDir) {
		detail += "; the state dir is on the host's root file system, the sandboxes' default base, where overlayfs refuses its layers (a layer inside another): --fs kernel needs a state dir on its own file system (rewind init-store)"
	}
	if !rep.LiveFDsFollow {
		return degraded(name, detail+" (open fds of live processes stay on the old view without the ioctl: the daemon re-creates a sandbox's processes on the new view at every restore)")
	}
	return ok(name, detail)
}

// onRootFS reports whether dir (or its nearest existing parent) is on the
// file system of /.
func onRootFS(dir string) bool {
	var a, b unix.Stat_t
	if unix.Stat(existingParent(dir), &a) != nil || unix.Stat("/", &b) != nil {
		return false
	}
	return a.Dev == b.Dev
}

// ---- eBPF ----

func probeEBPF() []Check {
	var cs []Check
	if err := features.HaveProgramType(ebpf.SocketFilter); err != nil {
		cs = append(cs, missing("bpf-syscall", "load a BPF program: "+errnoDetail(err)+"; needs root (CAP_BPF) and CONFIG_BPF_SYSCALL"))
		for _, n := range []string{"btf", "tracepoints", "raw-tracepoints", "fentry-fexit", "cgroup-v2-id"} {
			cs = append(cs, missing(n, "no BPF syscall"))
		}
		return cs
	}
	cs = append(cs, ok("bpf-syscall", "BPF programs load"))

	if spec, err := btf.LoadKernelSpec(); err != nil {
		cs = append(cs, missing("btf", "kernel BTF: "+errnoDetail(err)+"; needs CONFIG_DEBUG_INFO_BTF (/sys/kernel/btf/vmlinux)"))
	} else {
		_ = spec
		cs = append(cs, ok("btf", "kernel BTF at /sys/kernel/btf/vmlinux"))
	}
	cs = append(cs, probeTracepoint())
	cs = append(cs, probeRawTracepoint())
	cs = append(cs, probeFentry())
	cs = append(cs, probeCgroupID())
	return cs
}

func trivialProg(typ ebpf.ProgramType) *ebpf.ProgramSpec {
	return &ebpf.ProgramSpec{
		Type:         typ,
		License:      "GPL",
		Instructions: asm.Instructions{asm.Mov.Imm(asm.R0, 0), asm.Return()},
	}
}

// tracefsDir returns a mounted tracefs, mounting a private one in a temp
// dir when none is (the returned cleanup unmounts it).
func tracefsDir() (string, func(), error) {
	mounts, err := readMountinfo()
	if err == nil {
		for _, m := range mounts {
			if m.FSType == "tracefs" {
				return m.MountPoint, func() {}, nil
			}
		}
	}
	tmp, err := os.MkdirTemp("", "rewind-doctor-tracefs-")
	if err != nil {
		return "", nil, err
	}
	if err := unix.Mount("tracefs", tmp, "tracefs", 0, ""); err != nil {
		os.Remove(tmp)
		return "", nil, fmt.Errorf("mount tracefs: %w", err)
	}
	return tmp, func() {
		_ = unix.Unmount(tmp, unix.MNT_DETACH)
		os.Remove(tmp)
	}, nil
}

func probeTracepoint() Check {
	const name = "tracepoints"
	prog, err := ebpf.NewProgram(trivialProg(ebpf.TracePoint))
	if err != nil {
		return missing(name, "load a tracepoint program: "+errnoDetail(err))
	}
	defer prog.Close()
	dir, cleanup, err := tracefsDir()
	if err != nil {
		return missing(name, "tracefs: "+errnoDetail(err)+"; needs CONFIG_TRACING")
	}
	defer cleanup()
	idb, err := os.ReadFile(filepath.Join(dir, "events/sched/sched_process_fork/id"))
	if err != nil {
		return missing(name, "tracepoint sched:sched_process_fork: "+err.Error())
	}
	id, err := strconv.ParseUint(strings.TrimSpace(string(idb)), 10, 64)
	if err != nil {
		return missing(name, "tracepoint id: "+err.Error())
	}
	attr := unix.PerfEventAttr{Type: unix.PERF_TYPE_TRACEPOINT, Config: id, Sample_type: unix.PERF_SAMPLE_RAW, Sample: 1, Wakeup: 1}
	attr.Size = uint32(unsafe.Sizeof(attr))
	pfd, err := unix.PerfEventOpen(&attr, -1, 0, -1, unix.PERF_FLAG_FD_CLOEXEC)
	if err != nil {
		return missing(name, "perf_event_open on a tracepoint: "+errnoDetail(err))
	}
	defer unix.Close(pfd)
	if err := unix.IoctlSetInt(pfd, unix.PERF_EVENT_IOC_SET_BPF, prog.FD()); err != nil {
		return missing(name, "attach BPF to tracepoint: "+errnoDetail(err))
	}
	detail := "sched:sched_process_fork attaches"
	if !strings.HasPrefix(dir, "/sys/kernel") {
		detail += " (tracefs is not mounted by default: rewind mounts it when needed)"
	}
	return ok(name, detail)
}

func probeRawTracepoint() Check {
	const name = "raw-tracepoints"
	prog, err := ebpf.NewProgram(trivialProg(ebpf.RawTracepoint))
	if err != nil {
		return missing(name, "load a raw tracepoint program: "+errnoDetail(err))
	}
	defer prog.Close()
	l, err := link.AttachRawTracepoint(link.RawTracepointOptions{Name: "sys_enter", Program: prog})
	if err != nil {
		return missing(name, "attach raw tracepoint sys_enter: "+errnoDetail(err))
	}
	l.Close()
	return ok(name, "raw_syscalls sys_enter attaches (no tracefs needed)")
}

func probeFentry() Check {
	const name = "fentry-fexit"
	spec := trivialProg(ebpf.Tracing)
	spec.AttachType = ebpf.AttachTraceFEntry
	spec.AttachTo = "do_unlinkat"
	prog, err := ebpf.NewProgram(spec)
	if err != nil {
		return missing(name, "load an fentry program: "+errnoDetail(err)+" (BPF trampolines are unavailable here; rewind uses tracepoints)")
	}
	prog.Close()
	return ok(name, "fentry programs load")
}

func probeCgroupID() Check {
	const name = "cgroup-v2-id"
	mp, err := cgroup2Mount()
	if err != nil {
		return missing(name, err.Error()+": mount cgroup2 (e.g. at /sys/fs/cgroup/unified) so sandboxes get distinct cgroup ids")
	}
	if err := features.HaveProgramHelper(ebpf.RawTracepoint, asm.FnGetCurrentCgroupId); err != nil {
		return missing(name, "bpf_get_current_cgroup_id: "+errnoDetail(err))
	}
	return ok(name, "cgroup2 at "+mp+"; bpf_get_current_cgroup_id available (a sandbox's id is the inode of its v2 cgroup dir)")
}

// ---- CRIU ----

// criuMountScript runs criu (its $0) in a private copy of the host's mount
// table from which mounts with a mountinfo line too long for CRIU's parser
// are detached. CRIU reads its mountinfo in 4 KiB lines; an overlay mount
// with a deep lowerdir+ stack (rewind's own kernel path makes them) has a
// longer one, and every CRIU run in that mount namespace then fails ("Bad
// format in mountinfo"). rewind runs CRIU in sandbox mount namespaces,
// where no host mount is visible, so the check must not fail on them
// either. make-rprivate first: nothing done here reaches the host.
const criuMountScript = `set -e
mount --make-rprivate /
awk 'length($0) > 3500 { print $5 }' /proc/self/mountinfo | while read -r m; do
	umount -l "$(printf '%b' "$m")" 2>/dev/null || true
done
exec "$0" "$@"`

// criuCheckCommand is `criu args...` as criuMountScript runs it, in a new
// mount namespace.
func criuCheckCommand(ctx context.Context, bin string, args ...string) *exec.Cmd {
	cmd := exec.CommandContext(ctx, "sh", append([]string{"-c", criuMountScript, bin}, args...)...)
	cmd.SysProcAttr = &syscall.SysProcAttr{Cloneflags: syscall.CLONE_NEWNS}
	return cmd
}

func probeCRIU(ctx context.Context, configured string) []Check {
	bin, err := FindCRIU(configured)
	if err != nil {
		return []Check{
			missing("binary", err.Error()),
			missing("version", "no criu"), missing("check", "no criu"),
			missing("lazy-pages", "no criu"), missing("mem-track", "no criu"),
		}
	}
	cs := []Check{ok("binary", bin)}
	v, err := CRIUVersionOf(ctx, bin)
	switch {
	case err != nil:
		cs = append(cs, missing("version", err.Error()))
	case v.Major < 4:
		cs = append(cs, missing("version", fmt.Sprintf("criu %s at %s is older than 4 (3.x fails on recent kernels: \"Unexpected rt vDSO area bounds\"); run `make deps` to build 4.1.1 into %s", v, bin, DefaultCRIUPrefix)))
	default:
		cs = append(cs, ok("version", v.String()))
	}
	type res struct {
		out string
		err error
	}
	run := func(args ...string) res {
		c, cancel := context.WithTimeout(ctx, 30*time.Second)
		defer cancel()
		out, err := criuCheckCommand(c, bin, args...).CombinedOutput()
		return res{string(bytes.TrimSpace(out)), err}
	}
	var check, lazy, track res
	var wg sync.WaitGroup
	wg.Add(3)
	go func() { defer wg.Done(); check = run("check") }()
	go func() { defer wg.Done(); lazy = run("check", "--feature", "uffd-noncoop") }()
	go func() { defer wg.Done(); track = run("check", "--feature", "mem_dirty_track") }()
	wg.Wait()
	if check.err != nil {
		cs = append(cs, missing("check", "criu check: "+check.err.Error()+": "+lastLine(check.out)))
	} else {
		cs = append(cs, ok("check", lastLine(check.out)))
	}
	if lazy.err != nil {
		cs = append(cs, missing("lazy-pages", "criu check --feature uffd-noncoop: "+lastLine(lazy.out)+"; restores copy all memory up front"))
	} else {
		cs = append(cs, ok("lazy-pages", "userfaultfd non-cooperative mode: lazy-pages restores"))
	}
	if track.err != nil {
		cs = append(cs, missing("mem-track", "no soft-dirty (CONFIG_MEM_SOFT_DIRTY): no incremental pre-dumps; not needed: rewind's probes estimate written pages from minor faults and run time (probe package, \"Memory estimate\")"))
	} else {
		cs = append(cs, ok("mem-track", "soft-dirty memory tracking (incremental pre-dumps)"))
	}
	return cs
}

func lastLine(s string) string {
	s = strings.TrimSpace(s)
	if i := strings.LastIndexByte(s, '\n'); i >= 0 {
		return s[i+1:]
	}
	if s == "" {
		return "(no output)"
	}
	return s
}
