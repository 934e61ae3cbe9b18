// Package wasmdata rewrites the data section of a WASM module so that it
// instantiates faster: Go's wasm linker emits one data segment per run of
// non-zero bytes (22,000 segments of ~25 bytes in a policy module), and a
// runtime applies each one on every instantiation (about 2 ms per instance
// in wazero). Merge joins segments that are close together.
package wasmdata

import (
	"cmp"
	"encoding/binary"
	"errors"
	"slices"
)

// WASM section ids used by Merge.
const (
	sectionData      = 11
	sectionDataCount = 12
)

// DefaultGap is the largest run of zero bytes Merge writes to join two
// segments by default: a few KiB more module bytes, thousands fewer
// segments.
const DefaultGap = 4096

// minSegments is the segment count below which Merge leaves a module alone
// (applying a few segments costs nothing).
const minSegments = 64

// dataSegment is an active data segment of memory 0 at a constant offset.
type dataSegment struct {
	offset uint32
	data   []byte // aliases the module's bytes
}

// Merge rewrites a module's data section so that active segments at most
// maxGap bytes apart become one segment, the gap zero-filled. It returns
// the new module and true, or wasm itself and false when the module has
// fewer than 64 segments or the rewrite does not apply.
//
// The rewrite preserves the module's meaning: it applies only when every
// segment is active in memory 0 at an i32.const offset and no two overlap
// (so their order does not matter, nothing else writes a gap, and fresh
// memory is zero), and there is no DataCount section (so no instruction
// refers to segments by index). The result is deterministic.
func Merge(wasm []byte, maxGap uint32) ([]byte, bool) {
	out, err := merge(wasm, maxGap)
	if err != nil {
		return wasm, false
	}
	return out, true
}

var errNoMerge = errors.New("data section not mergeable")

func merge(wasm []byte, maxGap uint32) ([]byte, error) {
	if len(wasm) < 8 || string(wasm[:4]) != "\x00asm" {
		return nil, errNoMerge
	}
	pos := 8
	dataStart, dataEnd, bodyStart := -1, -1, -1
	for pos < len(wasm) {
		id := wasm[pos]
		size, n := uleb(wasm[pos+1:])
		if n == 0 {
			return nil, errNoMerge
		}
		body := pos + 1 + n
		end := body + int(size)
		if end > len(wasm) || end < body {
			return nil, errNoMerge
		}
		switch id {
		case sectionDataCount:
			return nil, errNoMerge
		case sectionData:
			if dataStart >= 0 {
				return nil, errNoMerge
			}
			dataStart, bodyStart, dataEnd = pos, body, end
		}
		pos = end
	}
	if dataStart < 0 {
		return nil, errNoMerge
	}
	segs, err := parseData(wasm[bodyStart:dataEnd])
	if err != nil {
		return nil, err
	}
	// Disjoint writes commute: sorted by offset, the segments write the
	// same memory. (An empty segment goes before a segment at its offset.)
	slices.SortFunc(segs, func(a, b dataSegment) int {
		return cmp.Or(cmp.Compare(a.offset, b.offset), cmp.Compare(len(a.data), len(b.data)))
	})
	// Group runs of segments less than maxGap apart: group g covers
	// segs[starts[g]:starts[g+1]].
	starts := []int{0}
	for i := 1; i < len(segs); i++ {
		prevEnd := uint64(segs[i-1].offset) + uint64(len(segs[i-1].data))
		if uint64(segs[i].offset) < prevEnd {
			return nil, errNoMerge // overlapping: order matters
		}
		if uint64(segs[i].offset)-prevEnd > uint64(maxGap) {
			starts = append(starts, i)
		}
	}
	if len(starts) == len(segs) {
		return nil, errNoMerge // nothing to gain
	}
	starts = append(starts, len(segs))
	// Many empty segments maxGap apart would merge into a huge one: the
	// rewrite may add at most the module's size plus 1 MiB.
	var total uint64
	for g := 0; g+1 < len(starts); g++ {
		first, last := segs[starts[g]], segs[starts[g+1]-1]
		total += uint64(last.offset) + uint64(len(last.data)) - uint64(first.offset)
	}
	if total > 2*uint64(len(wasm))+1<<20 {
		return nil, errNoMerge
	}
	sec := make([]byte, 0, int(total)+len(starts)*16)
	sec = binary.AppendUvarint(sec, uint64(len(starts)-1))
	for g := 0; g+1 < len(starts); g++ {
		first, last := segs[starts[g]], segs[starts[g+1]-1]
		size := uint64(last.offset) + uint64(len(last.data)) - uint64(first.offset)
		sec = append(sec, 0x00, 0x41) // active, memory 0; i32.const
		sec = appendSleb(sec, int64(int32(first.offset)))
		sec = append(sec, 0x0b) // end
		sec = binary.AppendUvarint(sec, size)
		base := len(sec)
		sec = append(sec, make([]byte, size)...)
		for _, s := range segs[starts[g]:starts[g+1]] {
			copy(sec[base+int(s.offset-first.offset):], s.data)
		}
	}
	out := make([]byte, 0, len(wasm)-(dataEnd-dataStart)+len(sec)+6)
	out = append(out, wasm[:dataStart]...)
	out = append(out, sectionData)
	out = binary.AppendUvarint(out, uint64(len(sec)))
	out = append(out, sec...)
	out = append(out, wasm[dataEnd:]...)
	return out, nil
}

// parseData parses a data section body; every segment must be active in
// memory 0 with an i32.const offset.
func parseData(b []byte) ([]dataSegment, error) {
	count, n := uleb(b)
	if n == 0 || count > uint64(len(b)) || count < minSegments {
		return nil, errNoMerge
	}
	b = b[n:]
	segs := make([]dataSegment, 0, count)
	for i := uint64(0); i < count; i++ {
		// flags 0: active, memory 0, offset expression, bytes.
		if len(b) < 2 || b[0] != 0x00 || b[1] != 0x41 {
			return nil, errNoMerge
		}
		off, n := sleb32(b[2:])
		if n == 0 || len(b) < 2+n+1 || b[2+n] != 0x0b {
			return nil, errNoMerge
		}
		b = b[2+n+1:]
		size, n := uleb(b)
		if n == 0 || uint64(len(b)-n) < size {
			return nil, errNoMerge
		}
		segs = append(segs, dataSegment{offset: uint32(off), data: b[n : n+int(size)]})
		b = b[n+int(size):]
	}
	if len(b) != 0 {
		return nil, errNoMerge
	}
	return segs, nil
}

// uleb decodes an unsigned LEB128 u32; n is 0 when b does not start with
// one.
func uleb(b []byte) (v uint64, n int) {
	for shift := 0; n < len(b) && n < 5; shift += 7 {
		c := b[n]
		n++
		v |= uint64(c&0x7f) << shift
		if c&0x80 == 0 {
			if v > 0xffffffff {
				return 0, 0
			}
			return v, n
		}
	}
	return 0, 0
}

// sleb32 decodes a signed LEB128 i32; n is 0 when b does not start with
// one.
func sleb32(b []byte) (v int32, n int) {
	var r int64
	shift := 0
	for n < len(b) && n < 5 {
		c := b[n]
		n++
		r |= int64(c&0x7f) << shift
		shift += 7
		if c&0x80 == 0 {
			if shift < 64 && c&0x40 != 0 {
				r |= -1 << shift
			}
			if r < -1<<31 || r > 1<<31-1 {
				return 0, 0
			}
			return int32(r), n
		}
	}
	return 0, 0
}

// appendSleb appends v as signed LEB128.
func appendSleb(b []byte, v int64) []byte {
	for {
		c := byte(v & 0x7f)
		v >>= 7
		if (v == 0 && c&0x40 == 0) || (v == -1 && c&0x40 != 0) {
			return append(b, c)
		}
		b = append(b, c|0x80)
	}
}
