package criu

import (
	"errors"
	"fmt"

	"google.golang.org/protobuf/encoding/protowire"
)

// The few image fields rewind reads are decoded here with protowire rather
// than through go-criu's crit/images packages: fdinfo alone imports two
// dozen generated packages whose descriptors every process of rewind's
// binary would register at start, sandbox inits included. Field numbers are
// those of CRIU's images/*.proto (pstree, fdinfo, regfile, sk-unix).
const (
	pstreePid     = 1 // pstree_entry.pid
	pstreeThreads = 5 // pstree_entry.threads (repeated uint32)
	fileReg       = 3 // file_entry.reg (reg_file_entry)
	fileUsk       = 16
	regName       = 6  // reg_file_entry.name
	uskName       = 11 // unix_sk_entry.name
)

// fields calls visit for every field of the protobuf message b: v holds a
// varint's value, data a length-delimited field's bytes. Fixed-width fields
// are skipped; groups are refused.
func fields(b []byte, visit func(num protowire.Number, typ protowire.Type, v uint64, data []byte) error) error {
	for len(b) > 0 {
		num, typ, n := protowire.ConsumeTag(b)
		if n < 0 {
			return protowire.ParseError(n)
		}
		b = b[n:]
		var v uint64
		var data []byte
		switch typ {
		case protowire.VarintType:
			v, n = protowire.ConsumeVarint(b)
		case protowire.BytesType:
			data, n = protowire.ConsumeBytes(b)
		case protowire.Fixed32Type, protowire.Fixed64Type:
			n = protowire.ConsumeFieldValue(num, typ, b)
		default:
			return fmt.Errorf("field %d: unsupported wire type %d", num, typ)
		}
		if n < 0 {
			return fmt.Errorf("field %d: %w", num, protowire.ParseError(n))
		}
		b = b[n:]
		if err := visit(num, typ, v, data); err != nil {
			return err
		}
	}
	return nil
}

// PstreeIDs decodes one entry of a pstree image: the process's pid and its
// threads' ids, in the dumped PID namespace.
func PstreeIDs(raw []byte) (pid uint32, threads []uint32, err error) {
	havePid := false
	err = fields(raw, func(num protowire.Number, typ protowire.Type, v uint64, data []byte) error {
		switch {
		case num == pstreePid && typ == protowire.VarintType:
			pid, havePid = uint32(v), true
		case num == pstreeThreads && typ == protowire.VarintType:
			threads = append(threads, uint32(v))
		case num == pstreeThreads && typ == protowire.BytesType: // packed
			for len(data) > 0 {
				t, n := protowire.ConsumeVarint(data)
				if n < 0 {
					return fmt.Errorf("threads: %w", protowire.ParseError(n))
				}
				threads = append(threads, uint32(t))
				data = data[n:]
			}
		}
		return nil
	})
	if err == nil && !havePid {
		err = errors.New("pstree entry without pid")
	}
	if err != nil {
		return 0, nil, fmt.Errorf("pstree entry: %w", err)
	}
	return pid, threads, nil
}

// fileNames decodes one entry of a files image: the path of a regular
// file (reg) and the bound name of a unix socket (usk), each empty when the
// entry is not of that kind.
func fileNames(raw []byte) (reg string, usk []byte, err error) {
	sub := func(data []byte, want protowire.Number) ([]byte, error) {
		var out []byte
		err := fields(data, func(num protowire.Number, typ protowire.Type, _ uint64, d []byte) error {
			if num == want && typ == protowire.BytesType {
				out = d
			}
			return nil
		})
		return out, err
	}
	err = fields(raw, func(num protowire.Number, typ protowire.Type, _ uint64, data []byte) error {
		if typ != protowire.BytesType {
			return nil
		}
		switch num {
		case fileReg:
			n, err := sub(data, regName)
			if err != nil {
				return fmt.Errorf("reg: %w", err)
			}
			reg = string(n)
		case fileUsk:
			n, err := sub(data, uskName)
			if err != nil {
				return fmt.Errorf("usk: %w", err)
			}
			usk = n
		}
		return nil
	})
	if err != nil {
		return "", nil, fmt.Errorf("file entry: %w", err)
	}
	return reg, usk, nil
}
