package policy

import (
	"bytes"
	"testing"
	"unsafe"
)

func TestLinearMemory(t *testing.T) {
	const page = 65536
	tests := []struct {
		name          string
		capB, maxB    uint64
		grow          []uint64 // successive Reallocate sizes
		wantNil       int      // index of the first size that must fail (-1: none)
		wantMovedFrom int      // first index whose buffer must have moved (-1: none)
	}{
		{"grows within the reserve", 33 * page, 256 * page, []uint64{33 * page, 38 * page, 42 * page}, -1, -1},
		{"grows past the reserve", page, 256 * page, []uint64{page, 10 * page, 40 * page}, -1, 2},
		{"limit below the reserve", 2 * page, 4 * page, []uint64{2 * page, 4 * page, 5 * page}, 2, -1},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			lm := memoryAllocator{}.Allocate(tt.capB, tt.maxB)
			var prev []byte
			for i, size := range tt.grow {
				b := lm.Reallocate(size)
				if i == tt.wantNil {
					if b != nil {
						t.Fatalf("Reallocate(%d) beyond the limit %d returned memory", size, tt.maxB)
					}
					return
				}
				if uint64(len(b)) != size || uint64(cap(b)) > tt.maxB {
					t.Fatalf("Reallocate(%d): len %d cap %d (limit %d)", size, len(b), cap(b), tt.maxB)
				}
				if prev != nil {
					moved := unsafe.SliceData(b) != unsafe.SliceData(prev)
					if moved != (i >= tt.wantMovedFrom && tt.wantMovedFrom >= 0) {
						t.Fatalf("step %d: moved %v", i, moved)
					}
					if !bytes.Equal(b[:len(prev)], prev) {
						t.Fatalf("step %d: content lost", i)
					}
					if bytes.IndexFunc(b[len(prev):], func(r rune) bool { return r != 0 }) >= 0 {
						t.Fatalf("step %d: grown bytes are not zero", i)
					}
				}
				for j := range b { // the guest writes everything it has
					b[j] = byte(j%251 + 1)
				}
				prev = b
			}
			lm.Free()
		})
	}
}
