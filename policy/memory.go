package policy

import "github.com/tetratelabs/wazero/experimental"

// reserveBytes is the linear memory capacity an instance gets beyond its
// initial size: a Go guest starts at 2.1 MiB and grows by 0.3 MiB while its
// runtime initialises and a little more in its first calls, and wazero's
// own growth copies the whole memory each time (half the cost of an
// instantiation). Growing within the reserve copies nothing; the reserve's
// cost is zeroing it.
const reserveBytes = 1 << 20

// memoryAllocator gives instances Go-allocated linear memory with
// reserveBytes of spare capacity (bounded by the memory limit) that grows by
// doubling. The memory stays GC-managed, so a module closed while a call
// still runs (Host.Close) can never make the call touch freed memory.
type memoryAllocator struct{}

// Allocate implements experimental.MemoryAllocator.
func (memoryAllocator) Allocate(capBytes, maxBytes uint64) experimental.LinearMemory {
	c := min(capBytes+reserveBytes, maxBytes)
	return &linearMemory{buf: make([]byte, 0, c), max: maxBytes}
}

type linearMemory struct {
	buf []byte
	max uint64
}

// Reallocate implements experimental.LinearMemory. Bytes past the old
// length are zero: make zeroes the whole capacity and the guest never
// reaches beyond the length.
func (m *linearMemory) Reallocate(size uint64) []byte {
	if size > m.max {
		return nil
	}
	if size <= uint64(cap(m.buf)) {
		m.buf = m.buf[:size]
		return m.buf
	}
	nb := make([]byte, size, min(max(size, 2*uint64(cap(m.buf))), m.max))
	copy(nb, m.buf)
	m.buf = nb
	return nb
}

// Free implements experimental.LinearMemory.
func (m *linearMemory) Free() { m.buf = nil }
