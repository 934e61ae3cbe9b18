package effect

import (
	"bytes"
	"encoding/binary"
	"errors"
	"reflect"
	"strings"
	"testing"
)

func fullReport() Report {
	return Report{
		Version: Version, Sandbox: "sb-1", Turn: 42, Backend: BackendEBPF, DurationUS: -7, LostEvents: 3,
		FS: FS{Created: 1, Modified: 2, Deleted: 3, Renamed: 4, MetaChanged: 5, BytesWritten: 6, UpperNonEmpty: true,
			Samples: []PathSample{{Op: "create", Path: "/a"}, {Op: "delete", Path: "/b/c"}}},
		Proc: Proc{Forked: 7, Execs: 8, Exited: 9, Alive: 10, NewLongLived: 11, CwdChanges: 12, SignalsSent: 13,
			ExecSamples: []Exec{{PID: 100, Comm: "sh", Argv0: "/bin/sh"}},
			LongLived:   []Exec{{PID: -1, Comm: "postgres"}}},
		Mem: Mem{PagesWritten: 14, Exact: true, Mmaps: 15, Munmaps: 16, Brks: 17,
			PerProc: []ProcPages{{PID: 1, Comm: "python3", Pages: 99}}},
		Net: Net{RemoteConnects: 18, Listens: 19, BytesSent: 20, Remotes: []string{"1.2.3.4:443"}},
	}
}

func TestWireRoundTrip(t *testing.T) {
	tests := []struct {
		name string
		r    Report
	}{
		{"zero", Report{}},
		{"counters only", Report{Version: 1, Turn: 1, FS: FS{Modified: 1}, Mem: Mem{Exact: true}}},
		{"full", fullReport()},
		{"max values", Report{Turn: ^uint64(0), DurationUS: -1 << 63, LostEvents: ^uint64(0), Version: -1}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b := tt.r.AppendWire(nil)
			var got Report
			if err := got.UnmarshalWire(b); err != nil {
				t.Fatalf("UnmarshalWire: %v", err)
			}
			if !reflect.DeepEqual(got, tt.r) {
				t.Fatalf("round trip:\n got %+v\nwant %+v", got, tt.r)
			}
			var counters Report
			counters.Sandbox = "kept"
			if err := UnmarshalWireCounters(b, &counters); err != nil {
				t.Fatalf("UnmarshalWireCounters: %v", err)
			}
			want := tt.r
			want.Sandbox, want.Backend = "kept", ""
			want.FS.Samples, want.Proc.ExecSamples, want.Proc.LongLived, want.Mem.PerProc, want.Net.Remotes = nil, nil, nil, nil, nil
			if !reflect.DeepEqual(counters, want) {
				t.Fatalf("counters:\n got %+v\nwant %+v", counters, want)
			}
		})
	}
}

func TestWireFixedOffsets(t *testing.T) {
	r := fullReport()
	b := r.AppendWire(nil)
	if string(b[:2]) != "RW" || b[2] != WireVersion || b[3] != WireFlagUpperNonEmpty|WireFlagMemExact {
		t.Fatalf("header % x", b[:8])
	}
	if n := binary.LittleEndian.Uint32(b[4:]); n != WireCounterCount {
		t.Fatalf("counter count %d", n)
	}
	at := func(i int) uint64 { return binary.LittleEndian.Uint64(b[WireHeaderSize+8*i:]) }
	checks := map[int]uint64{WireTurn: 42, WireLostEvents: 3, WireFSCreated: 1, WireFSBytesWritten: 6,
		WireProcForked: 7, WireProcCwdChanges: 12, WireMemPagesWritten: 14, WireNetRemoteConnects: 18, WireNetListens: 19,
		WireNetBytesSent: 20, WireDurationUS: ^uint64(6)}
	for i, want := range checks {
		if got := at(i); got != want {
			t.Errorf("counter %d = %d, want %d", i, got, want)
		}
	}
	// The ABI documents these absolute offsets; they must never move.
	if WireHeaderSize+8*WireLostEvents != 32 || WireHeaderSize+8*WireNetListens != 184 || WireCounterCount != 24 {
		t.Fatalf("documented offsets changed")
	}
}

func TestWireTruncatesOversized(t *testing.T) {
	r := Report{Sandbox: strings.Repeat("x", MaxWireString+10)}
	for i := 0; i < MaxSamples+5; i++ {
		r.Net.Remotes = append(r.Net.Remotes, "h:1")
		r.FS.Samples = append(r.FS.Samples, PathSample{Op: "modify", Path: "/p"})
	}
	var got Report
	if err := got.UnmarshalWire(r.AppendWire(nil)); err != nil {
		t.Fatal(err)
	}
	if len(got.Sandbox) != MaxWireString || len(got.Net.Remotes) != MaxSamples || len(got.FS.Samples) != MaxSamples {
		t.Fatalf("not truncated: %d %d %d", len(got.Sandbox), len(got.Net.Remotes), len(got.FS.Samples))
	}
}

func TestWireCompat(t *testing.T) {
	r := fullReport()
	b := r.AppendWire(nil)
	// A newer writer with two more counters and a trailing section.
	newer := append([]byte{}, b[:4]...)
	newer = binary.LittleEndian.AppendUint32(newer, WireCounterCount+2)
	newer = append(newer, b[8:8+8*WireCounterCount]...)
	newer = binary.LittleEndian.AppendUint64(newer, 1)
	newer = binary.LittleEndian.AppendUint64(newer, 2)
	newer = append(newer, b[8+8*WireCounterCount:]...)
	newer = append(newer, "future"...)
	var got Report
	if err := got.UnmarshalWire(newer); err != nil {
		t.Fatalf("newer: %v", err)
	}
	if !reflect.DeepEqual(got, r) {
		t.Fatalf("newer decoded differently")
	}
	// An older writer with only 4 counters and no variable section... must
	// still carry the variable section, here empty.
	older := []byte{'R', 'W', WireVersion, 0}
	older = binary.LittleEndian.AppendUint32(older, 4)
	for i := 0; i < 4; i++ {
		older = binary.LittleEndian.AppendUint64(older, uint64(i+1))
	}
	older = append(older, make([]byte, 4*2+4*5)...)
	if err := got.UnmarshalWire(older); err != nil {
		t.Fatalf("older: %v", err)
	}
	if got.Version != 1 || got.Turn != 2 || got.DurationUS != 3 || got.LostEvents != 4 || got.FS.Created != 0 {
		t.Fatalf("older: %+v", got)
	}
}

func TestWireMalformed(t *testing.T) {
	good := fullReport()
	b := good.AppendWire(nil)
	// Every strict prefix of a valid encoding is an error, never a panic.
	for i := 0; i < len(b); i++ {
		var r Report
		if err := r.UnmarshalWire(b[:i]); err == nil {
			t.Fatalf("prefix of %d/%d bytes accepted", i, len(b))
		} else if !errors.Is(err, ErrWire) {
			t.Fatalf("error %v does not wrap ErrWire", err)
		}
	}
	bad := map[string][]byte{
		"magic":          append([]byte("XX"), b[2:]...),
		"version":        append([]byte{'R', 'W', 9}, b[3:]...),
		"huge counters":  append(append([]byte{}, b[:4]...), 0xff, 0xff, 0xff, 0xff),
		"huge string":    append(bytes.Clone(b[:WireHeaderSize+8*WireCounterCount]), 0xff, 0xff, 0xff, 0x7f),
		"too many items": append(bytes.Clone(b[:WireHeaderSize+8*WireCounterCount]), 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0, 0, 0),
	}
	for name, in := range bad {
		var r Report
		if err := r.UnmarshalWire(in); !errors.Is(err, ErrWire) {
			t.Errorf("%s: err = %v, want ErrWire", name, err)
		}
	}
}

func FuzzUnmarshalWire(f *testing.F) {
	r := fullReport()
	f.Add(r.AppendWire(nil))
	f.Add((&Report{}).AppendWire(nil))
	f.Fuzz(func(t *testing.T, b []byte) {
		var r Report
		if err := r.UnmarshalWire(b); err != nil {
			return
		}
		// Whatever decodes re-encodes to something that decodes the same.
		var again Report
		if err := again.UnmarshalWire(r.AppendWire(nil)); err != nil {
			t.Fatalf("re-encode: %v", err)
		}
		if !reflect.DeepEqual(r, again) {
			t.Fatalf("unstable: %+v vs %+v", r, again)
		}
	})
}

func BenchmarkWire(b *testing.B) {
	r := fullReport()
	buf := r.AppendWire(nil)
	b.Run("append", func(b *testing.B) {
		b.ReportAllocs()
		for b.Loop() {
			buf = r.AppendWire(buf[:0])
		}
	})
	b.Run("counters", func(b *testing.B) {
		b.ReportAllocs()
		var got Report
		for b.Loop() {
			_ = UnmarshalWireCounters(buf, &got)
		}
	})
}
