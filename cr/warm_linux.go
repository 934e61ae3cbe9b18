package cr

import (
	"bufio"
	"encoding/binary"
	"fmt"
	"os"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

const pageSize = 4096

// Prefault makes every present page of pid's private writable mappings
// private to pid (it breaks copy-on-write sharing) by reading each page and
// writing the same bytes back with process_vm_readv/writev. pid must be
// stopped: a running process could write a page between the read and the
// write-back and lose that write.
func Prefault(pid int) error { return prefault(pid, nil) }

// prefault is Prefault leaving out the 2 MiB ranges in skip (by start).
func prefault(pid int, skip map[uint64]bool) error {
	maps, err := os.Open("/proc/" + strconv.Itoa(pid) + "/maps")
	if err != nil {
		return err
	}
	defer maps.Close()
	pm, err := os.Open("/proc/" + strconv.Itoa(pid) + "/pagemap")
	if err != nil {
		return err
	}
	defer pm.Close()
	buf := make([]byte, 1<<20)
	var ents []byte
	s := bufio.NewScanner(maps)
	for s.Scan() {
		f := strings.Fields(s.Text())
		if len(f) < 2 || f[1] != "rw-p" {
			continue
		}
		if len(f) >= 6 && strings.HasPrefix(f[5], "[v") { // [vvar], [vdso]
			continue
		}
		start, end, ok := parseRange(f[0])
		if !ok {
			continue
		}
		for chunk := start; chunk < end; chunk += uint64(len(buf)) {
			n := min(end-chunk, uint64(len(buf)))
			pages := n / pageSize
			if cap(ents) < int(pages*8) {
				ents = make([]byte, pages*8)
			}
			ents = ents[:pages*8]
			if _, err := pm.ReadAt(ents, int64(chunk/pageSize*8)); err != nil {
				continue
			}
			// Copy runs of present pages.
			skipped := func(i uint64) bool {
				return skip[(chunk+i*pageSize)&^(hugeSize-1)]
			}
			for i := uint64(0); i < pages; {
				if binary.LittleEndian.Uint64(ents[i*8:])&(1<<63) == 0 || skipped(i) {
					i++
					continue
				}
				j := i
				for j < pages && binary.LittleEndian.Uint64(ents[j*8:])&(1<<63) != 0 && !skipped(j) {
					j++
				}
				if err := rewrite(pid, chunk+i*pageSize, buf[:(j-i)*pageSize]); err != nil {
					return fmt.Errorf("prefault %d at %#x: %w", pid, chunk+i*pageSize, err)
				}
				i = j
			}
		}
	}
	return s.Err()
}

// parseRange parses a maps line's "start-end" field (hex addresses).
func parseRange(f string) (start, end uint64, ok bool) {
	a, b, _ := strings.Cut(f, "-")
	start, err1 := strconv.ParseUint(a, 16, 64)
	end, err2 := strconv.ParseUint(b, 16, 64)
	return start, end, err1 == nil && err2 == nil
}

func rewrite(pid int, addr uint64, buf []byte) error {
	local := []unix.Iovec{{Base: &buf[0], Len: uint64(len(buf))}}
	remote := []unix.RemoteIovec{{Base: uintptr(addr), Len: len(buf)}}
	n, err := unix.ProcessVMReadv(pid, local, remote, 0)
	if err != nil {
		return err
	}
	local[0].Len = uint64(n)
	remote[0].Len = n
	_, err = unix.ProcessVMWritev(pid, local, remote, 0)
	return err
}
