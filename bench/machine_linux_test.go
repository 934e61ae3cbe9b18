package bench

import "testing"

// TestDescribeMachine: the report's machine line from what the host says.
func TestDescribeMachine(t *testing.T) {
	cpuinfo := "processor\t: 0\nmodel name\t: AMD EPYC 7B13\nflags\t\t: fpu vme hypervisor lahf_lm\nprocessor\t: 1\nmodel name\t: AMD EPYC 7B13\n"
	tests := []struct {
		name string
		f    machineFacts
		want string
	}{
		{"virtual machine", machineFacts{release: "6.8.0", cpus: 2, cpuinfo: cpuinfo, meminfo: "MemTotal:        4014080 kB\nMemFree: 1 kB\n", vendor: "QEMU", product: "Standard PC"},
			"Linux 6.8.0, 2 CPUs (AMD EPYC 7B13), 3.8 GiB, virtual machine (QEMU Standard PC)"},
		{"no DMI", machineFacts{release: "6.8.0", cpus: 2, cpuinfo: cpuinfo}, "Linux 6.8.0, 2 CPUs (AMD EPYC 7B13), virtual machine"},
		{"bare metal, nothing readable", machineFacts{cpus: 8}, "8 CPUs"},
	}
	for _, tc := range tests {
		if got := describeMachine(tc.f); got != tc.want {
			t.Errorf("%s: %q, want %q", tc.name, got, tc.want)
		}
	}
}
