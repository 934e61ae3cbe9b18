package criu

import (
	"encoding/binary"
	"errors"
	"fmt"
)

// CRIU image magics (criu/include/magic.h): an image file starts with the
// common (or service) magic, then its own, then length-prefixed protobuf
// entries.
const (
	imgCommonMagic  = 0x54564319
	imgServiceMagic = 0x55105940
)

// ImageEntries splits the contents b of a CRIU image file into its
// entries (each one protobuf message, still encoded). With magic != 0 the
// file's own magic must be magic.
func ImageEntries(b []byte, magic uint32) ([][]byte, error) {
	if len(b) < 8 {
		return nil, errors.New("too short")
	}
	m := binary.LittleEndian.Uint32(b)
	if m == imgCommonMagic || m == imgServiceMagic {
		b = b[4:]
		m = binary.LittleEndian.Uint32(b)
	}
	if magic != 0 && m != magic {
		return nil, fmt.Errorf("magic %#x, want %#x", m, magic)
	}
	b = b[4:]
	var out [][]byte
	for len(b) > 0 {
		if len(b) < 4 {
			return nil, errors.New("truncated entry")
		}
		n := int(binary.LittleEndian.Uint32(b))
		b = b[4:]
		if n > len(b) {
			return nil, errors.New("truncated entry")
		}
		out = append(out, b[:n])
		b = b[n:]
	}
	return out, nil
}
