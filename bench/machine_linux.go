package bench

import (
	"fmt"
	"os"
	"runtime"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// Machine describes the host a benchmark runs on, for its report: kernel
// release, CPUs (count and model), memory, and the hypervisor when the CPU
// says there is one (with the DMI vendor and product, when readable).
// What it cannot read it leaves out.
func Machine() string {
	var u unix.Utsname
	release := ""
	if unix.Uname(&u) == nil {
		release = unix.ByteSliceToString(u.Release[:])
	}
	read := func(p string) string {
		b, _ := os.ReadFile(p)
		return string(b)
	}
	return describeMachine(machineFacts{
		release: release,
		cpus:    runtime.NumCPU(),
		cpuinfo: read("/proc/cpuinfo"),
		meminfo: read("/proc/meminfo"),
		vendor:  strings.TrimSpace(read("/sys/class/dmi/id/sys_vendor")),
		product: strings.TrimSpace(read("/sys/class/dmi/id/product_name")),
	})
}

// machineFacts is what Machine reads, as read.
type machineFacts struct {
	release          string
	cpus             int
	cpuinfo, meminfo string
	vendor, product  string
}

func describeMachine(f machineFacts) string {
	var parts []string
	if f.release != "" {
		parts = append(parts, "Linux "+f.release)
	}
	cpu := fmt.Sprintf("%d CPUs", f.cpus)
	hyper := false
	for _, l := range strings.Split(f.cpuinfo, "\n") {
		k, v, ok := strings.Cut(l, ":")
		if !ok {
			continue
		}
		switch strings.TrimSpace(k) {
		case "model name":
			if !strings.Contains(cpu, "(") {
				cpu += " (" + strings.TrimSpace(v) + ")"
			}
		case "flags":
			hyper = hyper || strings.Contains(" "+v+" ", " hypervisor ")
		}
	}
	parts = append(parts, cpu)
	for _, l := range strings.Split(f.meminfo, "\n") {
		if fs := strings.Fields(l); len(fs) >= 2 && fs[0] == "MemTotal:" {
			if kb, err := strconv.ParseInt(fs[1], 10, 64); err == nil {
				parts = append(parts, fmt.Sprintf("%.1f GiB", float64(kb)/(1<<20)))
			}
		}
	}
	if hyper {
		h := "virtual machine"
		if v := strings.TrimSpace(f.vendor + " " + f.product); v != "" {
			h += " (" + v + ")"
		}
		parts = append(parts, h)
	}
	return strings.Join(parts, ", ")
}
