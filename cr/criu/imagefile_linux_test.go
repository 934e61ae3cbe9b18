package criu

import (
	"encoding/binary"
	"strings"
	"testing"
)

func TestImageEntries(t *testing.T) {
	img := func(magics []uint32, ents ...string) []byte {
		var b []byte
		for _, m := range magics {
			b = binary.LittleEndian.AppendUint32(b, m)
		}
		for _, e := range ents {
			b = binary.LittleEndian.AppendUint32(b, uint32(len(e)))
			b = append(b, e...)
		}
		return b
	}
	const own = 0x50273030
	tests := []struct {
		name    string
		b       []byte
		magic   uint32
		want    []string
		wantErr string
	}{
		{"common magic, two entries", img([]uint32{imgCommonMagic, own}, "ab", "cde"), own, []string{"ab", "cde"}, ""},
		{"own magic only", img([]uint32{own}, "x", "y"), own, []string{"x", "y"}, ""},
		{"no entries", img([]uint32{imgServiceMagic, own}), own, nil, ""},
		{"any magic", img([]uint32{imgCommonMagic, 0x1234}, "z"), 0, []string{"z"}, ""},
		{"wrong magic", img([]uint32{imgCommonMagic, 0x1234}, "z"), own, nil, "magic 0x1234"},
		{"truncated body", img([]uint32{imgCommonMagic, own}, "abc")[:13], own, nil, "truncated"},
		{"truncated length", append(img([]uint32{imgCommonMagic, own}), 1, 0), own, nil, "truncated"},
		{"too short", []byte{1, 2, 3}, own, nil, "too short"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := ImageEntries(tt.b, tt.magic)
			if tt.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), tt.wantErr) {
					t.Fatalf("err %v, want %q", err, tt.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if len(got) != len(tt.want) {
				t.Fatalf("%d entries, want %d", len(got), len(tt.want))
			}
			for i := range got {
				if string(got[i]) != tt.want[i] {
					t.Fatalf("entry %d = %q, want %q", i, got[i], tt.want[i])
				}
			}
		})
	}
}
