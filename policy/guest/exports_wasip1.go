//go:build wasip1

package guest

import (
	"unsafe"

	"github.com/rewind-sandbox/rewind/effect"
)

// Per-instance buffers: the host writes the encoded report into in (obtained
// through rewind_alloc) and reads the result from out.
var (
	in     []byte
	out    = make([]byte, 0, 1+MaxReason)
	report effect.Report
)

//go:wasmexport rewind_abi_version
func abiVersion() uint32 { return ABIVersion }

//go:wasmexport rewind_alloc
func alloc(size uint32) uint32 {
	in = make([]byte, size)
	if size == 0 {
		return 0
	}
	return uint32(uintptr(unsafe.Pointer(unsafe.SliceData(in))))
}

//go:wasmexport rewind_classify
func classifyExport(ptr, size uint32) uint64 {
	if len(in) == 0 || ptr != uint32(uintptr(unsafe.Pointer(unsafe.SliceData(in)))) || int(size) > len(in) {
		out = appendReason(append(out[:0], byte(Error)), "input is not in the buffer returned by rewind_alloc")
	} else {
		out = classify(in[:size], out, &report)
	}
	p := uint32(uintptr(unsafe.Pointer(unsafe.SliceData(out))))
	return uint64(p)<<32 | uint64(len(out))
}
