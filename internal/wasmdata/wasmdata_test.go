package wasmdata

import (
	"bytes"
	"context"
	"encoding/binary"
	"math/rand/v2"
	"os"
	"testing"

	"github.com/tetratelabs/wazero"
)

// seg is a data segment of a synthetic module: active at an i32.const
// offset unless raw is set (then raw is the whole segment encoding).
type seg struct {
	off  uint32
	data []byte
	raw  []byte
}

// module builds a module with one memory of pages pages and the segments.
func module(pages uint32, segs []seg, dataCount bool) []byte {
	b := []byte("\x00asm\x01\x00\x00\x00")
	section := func(id byte, body []byte) {
		b = append(b, id)
		b = binary.AppendUvarint(b, uint64(len(body)))
		b = append(b, body...)
	}
	section(5, binary.AppendUvarint([]byte{1, 0}, uint64(pages)))
	if dataCount {
		section(12, binary.AppendUvarint(nil, uint64(len(segs))))
	}
	body := binary.AppendUvarint(nil, uint64(len(segs)))
	for _, s := range segs {
		if s.raw != nil {
			body = append(body, s.raw...)
			continue
		}
		body = append(body, 0x00, 0x41)
		body = appendSleb(body, int64(int32(s.off)))
		body = append(body, 0x0b)
		body = binary.AppendUvarint(body, uint64(len(s.data)))
		body = append(body, s.data...)
	}
	section(11, body)
	return b
}

// memoryOf instantiates wasm and returns its memory's bytes, or nil and
// the instantiation error.
func memoryOf(t *testing.T, rt wazero.Runtime, wasm []byte) ([]byte, error) {
	t.Helper()
	ctx := context.Background()
	cm, err := rt.CompileModule(ctx, wasm)
	if err != nil {
		t.Fatalf("compile: %v", err)
	}
	defer cm.Close(ctx)
	m, err := rt.InstantiateModule(ctx, cm, wazero.NewModuleConfig().WithName(""))
	if err != nil {
		return nil, err
	}
	defer m.Close(ctx)
	mem, _ := m.Memory().Read(0, m.Memory().Size())
	return bytes.Clone(mem), nil
}

// randomSegments returns n disjoint segments in shuffled order, some empty,
// with gaps from 0 to 6000 bytes.
func randomSegments(r *rand.Rand, n int) []seg {
	var segs []seg
	off := uint32(r.IntN(5000))
	for i := 0; i < n; i++ {
		d := make([]byte, r.IntN(40))
		for j := range d {
			d[j] = byte(1 + r.IntN(255))
		}
		segs = append(segs, seg{off: off, data: d})
		off += uint32(len(d))
		switch r.IntN(10) {
		case 0:
			off += 4000 + uint32(r.IntN(2000)) // some gaps beyond DefaultGap
		case 1:
			// adjacent
		default:
			off += uint32(1 + r.IntN(60))
		}
	}
	r.Shuffle(len(segs), func(i, j int) { segs[i], segs[j] = segs[j], segs[i] })
	return segs
}

func TestMergeKeepsMemory(t *testing.T) {
	ctx := context.Background()
	rt := wazero.NewRuntime(ctx)
	defer rt.Close(ctx)
	for seed := uint64(1); seed <= 20; seed++ {
		r := rand.New(rand.NewPCG(seed, 7))
		segs := randomSegments(r, 64+r.IntN(400))
		orig := module(8, segs, false)
		merged, ok := Merge(orig, DefaultGap)
		if !ok {
			t.Fatalf("seed %d: %d disjoint segments not merged", seed, len(segs))
		}
		n, err := countSegments(merged)
		if err != nil || n >= len(segs)/2 {
			t.Fatalf("seed %d: %d segments after merging %d (%v)", seed, n, len(segs), err)
		}
		want, err := memoryOf(t, rt, orig)
		if err != nil {
			t.Fatalf("seed %d: original: %v", seed, err)
		}
		got, err := memoryOf(t, rt, merged)
		if err != nil {
			t.Fatalf("seed %d: merged: %v", seed, err)
		}
		if !bytes.Equal(got, want) {
			t.Fatalf("seed %d: memory differs after merging", seed)
		}
		if again, ok := Merge(merged, DefaultGap); ok || !bytes.Equal(again, merged) {
			t.Fatalf("seed %d: merging twice changed the module", seed)
		}
	}
	// A segment out of bounds fails instantiation merged or not.
	segs := randomSegments(rand.New(rand.NewPCG(99, 7)), 100)
	segs = append(segs, seg{off: 1<<16 - 2, data: []byte("oob")})
	orig := module(1, segs, false)
	merged, ok := Merge(orig, 1<<16)
	if _, err := memoryOf(t, rt, orig); err == nil {
		t.Fatal("original out-of-bounds module instantiated")
	}
	if _, err := memoryOf(t, rt, merged); ok && err == nil {
		t.Fatal("merged out-of-bounds module instantiated")
	}
}

func TestMergeLeavesUnsafeModulesAlone(t *testing.T) {
	many := func(extra ...seg) []seg {
		var s []seg
		for i := 0; i < 100; i++ {
			s = append(s, seg{off: uint32(i * 16), data: []byte{byte(i + 1), 2, 3}})
		}
		return append(s, extra...)
	}
	var empties []seg // empty segments 4096 apart: would merge into 400 MiB
	for i := 0; i < 100000; i++ {
		empties = append(empties, seg{off: uint32(i * 4096)})
	}
	tests := []struct {
		name      string
		wasm      []byte
		dataCount bool
	}{
		{"overlapping", module(1, many(seg{off: 17, data: []byte{9, 9}}), false), false},
		{"passive segment", module(1, many(seg{raw: []byte{0x01, 0x01, 0xaa}}), false), false},
		{"memory index", module(1, many(seg{raw: []byte{0x02, 0x00, 0x41, 0x00, 0x0b, 0x01, 0xaa}}), false), false},
		{"global offset", module(1, many(seg{raw: []byte{0x00, 0x23, 0x00, 0x0b, 0x01, 0xaa}}), false), false},
		{"data count section", module(1, many(), true), true},
		{"few segments", module(1, many()[:10], false), false},
		{"empty segment bomb", module(1, empties, false), false},
		{"not wasm", []byte("hello, world"), false},
		{"truncated", module(1, many(), false)[:200], false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			out, ok := Merge(tt.wasm, DefaultGap)
			if ok || !bytes.Equal(out, tt.wasm) {
				t.Fatalf("merged (ok %v, %d -> %d bytes)", ok, len(tt.wasm), len(out))
			}
		})
	}
	// The control: the same segments without the unsafe one merge.
	if _, ok := Merge(module(1, many(), false), DefaultGap); !ok {
		t.Fatal("control module not merged")
	}
}

// TestMergeBuiltinPolicies checks the committed built-in policies are
// merged (scripts/build-policies.sh runs mergedata).
func TestMergeBuiltinPolicies(t *testing.T) {
	for _, name := range []string{"effects", "always", "fs-only", "cautious"} {
		b, err := os.ReadFile("../../policies/wasm/" + name + ".wasm")
		if err != nil {
			t.Fatal(err)
		}
		n, err := countSegments(b)
		if err != nil || n > 16 {
			t.Errorf("%s: %d data segments (%v); run make policies", name, n, err)
		}
	}
}

// countSegments returns the number of data segments of a module.
func countSegments(wasm []byte) (int, error) {
	pos := 8
	for pos < len(wasm) {
		id := wasm[pos]
		size, n := uleb(wasm[pos+1:])
		body := pos + 1 + n
		if id == sectionData {
			c, _ := uleb(wasm[body:])
			return int(c), nil
		}
		pos = body + int(size)
	}
	return 0, nil
}

func TestLEB(t *testing.T) {
	for _, v := range []int32{0, 1, -1, 63, 64, -64, -65, 20707, 1<<31 - 1, -1 << 31} {
		b := appendSleb(nil, int64(v))
		got, n := sleb32(b)
		if got != v || n != len(b) {
			t.Errorf("sleb %d: encoded %x decoded %d (%d bytes)", v, b, got, n)
		}
	}
	if _, n := uleb([]byte{0x80, 0x80, 0x80, 0x80, 0x80, 0x01}); n != 0 {
		t.Error("a 6-byte u32 LEB was accepted")
	}
}
