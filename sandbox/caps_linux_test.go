package sandbox

import (
	"os"
	"strings"
	"testing"

	"golang.org/x/sys/unix"
)

// TestStatusCapsWithin: the init's per-thread check reads CapPrm, CapEff
// and CapBnd from a status text, and refuses a thread whose status lacks
// one, has one it cannot read, or keeps a capability outside the mask.
func TestStatusCapsWithin(t *testing.T) {
	mask := keptMask()
	kept := hex16(mask)
	status5 := func(inh, prm, eff, bnd, amb string) string {
		return "Name:\trewind-init\nState:\tS (sleeping)\nCapInh:\t" + inh + "\nCapPrm:\t" + prm +
			"\nCapEff:\t" + eff + "\nCapBnd:\t" + bnd + "\nCapAmb:\t" + amb + "\nNoNewPrivs:\t0\n"
	}
	const zero = "0000000000000000"
	status := func(prm, eff, bnd string) string { return status5(zero, prm, eff, bnd, zero) }
	sysAdmin := hex16(1 << 21)
	tests := []struct {
		name, status string
		ok           bool
	}{
		{"kept", status(kept, kept, kept), true},
		{"none", status("0000000000000000", "0000000000000000", kept), true},
		{"prm-extra", status(sysAdmin, kept, kept), false},
		{"eff-extra", status(kept, sysAdmin, kept), false},
		{"bnd-full", status(kept, kept, "000001ffffffffff"), false},
		{"inh-extra", status5(sysAdmin, kept, kept, kept, zero), false},
		{"amb-extra", status5(zero, kept, kept, kept, sysAdmin), false},
		{"no-bnd", strings.Replace(status(kept, kept, kept), "CapBnd:", "CapBnx:", 1), false},
		{"garbled", status(kept, "zz", kept), false},
		{"empty", "", false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := statusCapsWithin([]byte(tc.status), mask)
			if (err == nil) != tc.ok {
				t.Fatalf("statusCapsWithin: %v, want ok=%v", err, tc.ok)
			}
		})
	}
	// This test process's own status parses (root: its bounding set is
	// full, so it is refused for keeping capabilities, not unreadable).
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		t.Fatal(err)
	}
	if err := statusCapsWithin(b, ^uint64(0)); err != nil {
		t.Fatalf("own status with a full mask: %v", err)
	}
	// ownBoundingSet agrees with asking for each capability.
	bnd, ok := ownBoundingSet()
	if !ok {
		t.Fatal("ownBoundingSet: not readable")
	}
	for c := 0; c <= lastCap(); c++ {
		in, err := unix.PrctlRetInt(unix.PR_CAPBSET_READ, uintptr(c), 0, 0, 0)
		if err != nil {
			t.Fatal(err)
		}
		if (in == 1) != (bnd&(1<<c) != 0) {
			t.Fatalf("capability %d: prctl says %d, ownBoundingSet %x", c, in, bnd)
		}
	}
	buf := make([]byte, 8192)
	n, err := readSmall("/proc/self/status", buf)
	if err != nil || string(buf[:n]) == "" || !strings.Contains(string(buf[:n]), "CapBnd:") {
		t.Fatalf("readSmall: %d %v", n, err)
	}
	if _, err := readSmall("/proc/self/status", make([]byte, 16)); err == nil {
		t.Fatal("readSmall into a 16-byte buffer succeeded")
	}
}

func hex16(v uint64) string {
	const digits = "0123456789abcdef"
	b := make([]byte, 16)
	for i := 15; i >= 0; i-- {
		b[i] = digits[v&15]
		v >>= 4
	}
	return string(b)
}
