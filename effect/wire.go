package effect

import (
	"errors"
	"strconv"
)

// The wire encoding is the compact binary form of a Report passed to WASM
// policies (policy/ABI.md documents it byte by byte). It is written for
// guests as much as for the host: this file uses no reflection and compiles
// for GOOS=wasip1, so a Go policy decodes with the very code the host encodes
// with.
//
// Layout (all integers little-endian):
//
//	offset 0   [2]byte  magic "RW"
//	offset 2   uint8    wire version (WireVersion)
//	offset 3   uint8    flags: bit 0 FS.UpperNonEmpty, bit 1 Mem.Exact
//	offset 4   uint32   N, the number of 8-byte counters that follow
//	offset 8   N x u64  counters, in the order of the Wire* indexes below
//	then       variable section: strings and samples (see ABI.md)
//
// Counters are only ever appended in later minor revisions: a reader takes
// the first min(N, known) counters and treats missing ones as zero.
const (
	// WireVersion is the version of the wire layout written by AppendWire.
	WireVersion = 1
	// WireHeaderSize is the size of the fixed header before the counters.
	WireHeaderSize = 8
	// WireCounterCount is the number of counters written by this build.
	WireCounterCount = wireNumCounters
	// WireFlagUpperNonEmpty is flag bit 0: FS.UpperNonEmpty.
	WireFlagUpperNonEmpty = 1 << 0
	// WireFlagMemExact is flag bit 1: Mem.Exact.
	WireFlagMemExact = 1 << 1
	// MaxWireString bounds any string in the wire form; longer strings are
	// truncated by AppendWire and rejected by UnmarshalWire.
	MaxWireString = 4096
)

// Indexes of the wire counters. The byte offset of counter i in an encoded
// report is WireHeaderSize + 8*i.
const (
	WireVersionField = iota // Report.Version
	WireTurn
	WireDurationUS // int64 stored as its two's-complement u64
	WireLostEvents
	WireFSCreated
	WireFSModified
	WireFSDeleted
	WireFSRenamed
	WireFSMetaChanged
	WireFSBytesWritten
	WireProcForked
	WireProcExecs
	WireProcExited
	WireProcAlive
	WireProcNewLongLived
	WireProcCwdChanges
	WireProcSignalsSent
	WireMemPagesWritten
	WireMemMmaps
	WireMemMunmaps
	WireMemBrks
	WireNetRemoteConnects
	WireNetListens
	WireNetBytesSent
	wireNumCounters
)

// ErrWire is wrapped by every decoding error.
var ErrWire = errors.New("malformed wire report")

// wireError is a decoding error wrapping ErrWire. The package avoids fmt so
// that WASM guests which decode reports stay small.
type wireError struct{ msg string }

func (e *wireError) Error() string { return ErrWire.Error() + ": " + e.msg }
func (e *wireError) Unwrap() error { return ErrWire }

func wireErr(msg string) error { return &wireError{msg: msg} }

func itoa(i int) string { return strconv.Itoa(i) }

// Little-endian helpers (encoding/binary would pull reflect into guests).
func appendU32(b []byte, v uint32) []byte {
	return append(b, byte(v), byte(v>>8), byte(v>>16), byte(v>>24))
}

func appendU64(b []byte, v uint64) []byte {
	return append(b, byte(v), byte(v>>8), byte(v>>16), byte(v>>24), byte(v>>32), byte(v>>40), byte(v>>48), byte(v>>56))
}

func leU32(b []byte) uint32 {
	_ = b[3]
	return uint32(b[0]) | uint32(b[1])<<8 | uint32(b[2])<<16 | uint32(b[3])<<24
}

func leU64(b []byte) uint64 {
	_ = b[7]
	return uint64(b[0]) | uint64(b[1])<<8 | uint64(b[2])<<16 | uint64(b[3])<<24 |
		uint64(b[4])<<32 | uint64(b[5])<<40 | uint64(b[6])<<48 | uint64(b[7])<<56
}

// wireCounters returns the report's counter fields in wire order.
func (r *Report) wireCounters() [wireNumCounters]uint64 {
	var c [wireNumCounters]uint64
	c[WireVersionField] = uint64(int64(r.Version))
	c[WireTurn] = r.Turn
	c[WireDurationUS] = uint64(r.DurationUS)
	c[WireLostEvents] = r.LostEvents
	c[WireFSCreated] = r.FS.Created
	c[WireFSModified] = r.FS.Modified
	c[WireFSDeleted] = r.FS.Deleted
	c[WireFSRenamed] = r.FS.Renamed
	c[WireFSMetaChanged] = r.FS.MetaChanged
	c[WireFSBytesWritten] = r.FS.BytesWritten
	c[WireProcForked] = r.Proc.Forked
	c[WireProcExecs] = r.Proc.Execs
	c[WireProcExited] = r.Proc.Exited
	c[WireProcAlive] = r.Proc.Alive
	c[WireProcNewLongLived] = r.Proc.NewLongLived
	c[WireProcCwdChanges] = r.Proc.CwdChanges
	c[WireProcSignalsSent] = r.Proc.SignalsSent
	c[WireMemPagesWritten] = r.Mem.PagesWritten
	c[WireMemMmaps] = r.Mem.Mmaps
	c[WireMemMunmaps] = r.Mem.Munmaps
	c[WireMemBrks] = r.Mem.Brks
	c[WireNetRemoteConnects] = r.Net.RemoteConnects
	c[WireNetListens] = r.Net.Listens
	c[WireNetBytesSent] = r.Net.BytesSent
	return c
}

// setWireCounters sets the report's counter fields from c, in wire order.
// Straight-line code on purpose: a switch per counter costs ~0.2 µs each in
// a Go WASM guest, which would dominate a decision.
func (r *Report) setWireCounters(c *[wireNumCounters]uint64) {
	r.Version = int(int64(c[WireVersionField]))
	r.Turn = c[WireTurn]
	r.DurationUS = int64(c[WireDurationUS])
	r.LostEvents = c[WireLostEvents]
	r.FS.Created = c[WireFSCreated]
	r.FS.Modified = c[WireFSModified]
	r.FS.Deleted = c[WireFSDeleted]
	r.FS.Renamed = c[WireFSRenamed]
	r.FS.MetaChanged = c[WireFSMetaChanged]
	r.FS.BytesWritten = c[WireFSBytesWritten]
	r.Proc.Forked = c[WireProcForked]
	r.Proc.Execs = c[WireProcExecs]
	r.Proc.Exited = c[WireProcExited]
	r.Proc.Alive = c[WireProcAlive]
	r.Proc.NewLongLived = c[WireProcNewLongLived]
	r.Proc.CwdChanges = c[WireProcCwdChanges]
	r.Proc.SignalsSent = c[WireProcSignalsSent]
	r.Mem.PagesWritten = c[WireMemPagesWritten]
	r.Mem.Mmaps = c[WireMemMmaps]
	r.Mem.Munmaps = c[WireMemMunmaps]
	r.Mem.Brks = c[WireMemBrks]
	r.Net.RemoteConnects = c[WireNetRemoteConnects]
	r.Net.Listens = c[WireNetListens]
	r.Net.BytesSent = c[WireNetBytesSent]
}

// AppendWire appends the wire encoding of r to b and returns the extended
// slice. Sample slices longer than MaxSamples and strings longer than
// MaxWireString are truncated, so the encoding of any report is bounded.
func (r *Report) AppendWire(b []byte) []byte {
	var flags byte
	if r.FS.UpperNonEmpty {
		flags |= WireFlagUpperNonEmpty
	}
	if r.Mem.Exact {
		flags |= WireFlagMemExact
	}
	b = append(b, 'R', 'W', WireVersion, flags)
	b = appendU32(b, wireNumCounters)
	c := r.wireCounters()
	for _, v := range c {
		b = appendU64(b, v)
	}
	b = appendString(b, r.Sandbox)
	b = appendString(b, r.Backend)

	n := min(len(r.FS.Samples), MaxSamples)
	b = appendU32(b, uint32(n))
	for _, s := range r.FS.Samples[:n] {
		b = appendString(b, s.Op)
		b = appendString(b, s.Path)
	}
	b = appendExecs(b, r.Proc.ExecSamples)
	b = appendExecs(b, r.Proc.LongLived)
	n = min(len(r.Mem.PerProc), MaxSamples)
	b = appendU32(b, uint32(n))
	for _, p := range r.Mem.PerProc[:n] {
		b = appendU64(b, uint64(int64(p.PID)))
		b = appendString(b, p.Comm)
		b = appendU64(b, p.Pages)
	}
	n = min(len(r.Net.Remotes), MaxSamples)
	b = appendU32(b, uint32(n))
	for _, s := range r.Net.Remotes[:n] {
		b = appendString(b, s)
	}
	return b
}

func appendExecs(b []byte, es []Exec) []byte {
	n := min(len(es), MaxSamples)
	b = appendU32(b, uint32(n))
	for _, e := range es[:n] {
		b = appendU64(b, uint64(int64(e.PID)))
		b = appendString(b, e.Comm)
		b = appendString(b, e.Argv0)
	}
	return b
}

func appendString(b []byte, s string) []byte {
	if len(s) > MaxWireString {
		s = s[:MaxWireString]
	}
	b = appendU32(b, uint32(len(s)))
	return append(b, s...)
}

// UnmarshalWireCounters decodes the header and counters of an encoded report
// into r, leaving its strings and samples untouched. It does not allocate,
// which makes it the fast path for policies that only look at counts.
func UnmarshalWireCounters(b []byte, r *Report) error {
	_, err := unmarshalCounters(b, r)
	return err
}

func unmarshalCounters(b []byte, r *Report) (rest []byte, err error) {
	if len(b) < WireHeaderSize {
		return nil, wireErr(itoa(len(b)) + " bytes, shorter than the header")
	}
	if b[0] != 'R' || b[1] != 'W' {
		return nil, wireErr("bad magic " + strconv.Quote(string(b[:2])))
	}
	if b[2] != WireVersion {
		return nil, wireErr("unsupported wire version " + itoa(int(b[2])) + " (want " + itoa(WireVersion) + ")")
	}
	flags := b[3]
	n := leU32(b[4:8])
	b = b[WireHeaderSize:]
	if uint64(n)*8 > uint64(len(b)) {
		return nil, wireErr(itoa(int(n)) + " counters announced, " + itoa(len(b)) + " bytes left")
	}
	r.FS.UpperNonEmpty = flags&WireFlagUpperNonEmpty != 0
	r.Mem.Exact = flags&WireFlagMemExact != 0
	var c [wireNumCounters]uint64
	for i := 0; i < int(min(n, wireNumCounters)); i++ {
		c[i] = leU64(b[8*i:])
	}
	r.setWireCounters(&c)
	return b[8*int(n):], nil
}

// wireReader decodes the variable section, remembering the first error.
type wireReader struct {
	b   []byte
	err error
}

func (d *wireReader) u32() uint32 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 4 {
		d.err = wireErr("truncated")
		return 0
	}
	v := leU32(d.b)
	d.b = d.b[4:]
	return v
}

func (d *wireReader) u64() uint64 {
	if d.err != nil {
		return 0
	}
	if len(d.b) < 8 {
		d.err = wireErr("truncated")
		return 0
	}
	v := leU64(d.b)
	d.b = d.b[8:]
	return v
}

func (d *wireReader) str() string {
	n := d.u32()
	if d.err != nil {
		return ""
	}
	if n > MaxWireString || int(n) > len(d.b) {
		d.err = wireErr("string of " + itoa(int(n)) + " bytes")
		return ""
	}
	s := string(d.b[:n])
	d.b = d.b[n:]
	return s
}

// count reads a sample count and checks it against MaxSamples.
func (d *wireReader) count() int {
	n := d.u32()
	if n > MaxSamples {
		d.err = wireErr(itoa(int(n)) + " samples, more than " + itoa(MaxSamples))
		return 0
	}
	return int(n)
}

func (d *wireReader) execs() []Exec {
	n := d.count()
	if n == 0 || d.err != nil {
		return nil
	}
	es := make([]Exec, 0, n)
	for i := 0; i < n && d.err == nil; i++ {
		es = append(es, Exec{PID: int(int64(d.u64())), Comm: d.str(), Argv0: d.str()})
	}
	return es
}

// UnmarshalWire decodes a complete encoded report into r, replacing its
// contents. Malformed input yields an error wrapping ErrWire; the decoder
// never allocates more than a small multiple of len(b).
func (r *Report) UnmarshalWire(b []byte) error {
	*r = Report{}
	rest, err := unmarshalCounters(b, r)
	if err != nil {
		return err
	}
	d := &wireReader{b: rest}
	r.Sandbox = d.str()
	r.Backend = d.str()
	if n := d.count(); n > 0 && d.err == nil {
		r.FS.Samples = make([]PathSample, 0, n)
		for i := 0; i < n && d.err == nil; i++ {
			r.FS.Samples = append(r.FS.Samples, PathSample{Op: d.str(), Path: d.str()})
		}
	}
	r.Proc.ExecSamples = d.execs()
	r.Proc.LongLived = d.execs()
	if n := d.count(); n > 0 && d.err == nil {
		r.Mem.PerProc = make([]ProcPages, 0, n)
		for i := 0; i < n && d.err == nil; i++ {
			r.Mem.PerProc = append(r.Mem.PerProc, ProcPages{PID: int(int64(d.u64())), Comm: d.str(), Pages: d.u64()})
		}
	}
	if n := d.count(); n > 0 && d.err == nil {
		r.Net.Remotes = make([]string, 0, n)
		for i := 0; i < n && d.err == nil; i++ {
			r.Net.Remotes = append(r.Net.Remotes, d.str())
		}
	}
	if d.err != nil {
		return d.err
	}
	// Trailing bytes are allowed: later minor revisions may append sections.
	return nil
}
