package criu

import (
	"math/rand"
	"slices"
	"testing"

	"github.com/checkpoint-restore/go-criu/v8/crit/images/fdinfo"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/fown"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/pstree"
	"github.com/checkpoint-restore/go-criu/v8/crit/images/regfile"
	sk_opts "github.com/checkpoint-restore/go-criu/v8/crit/images/sk-opts"
	sk_unix "github.com/checkpoint-restore/go-criu/v8/crit/images/sk-unix"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
)

// TestPstreeIDs decodes entries encoded by go-criu's generated code (the
// reference) and checks the ids match, for random trees.
func TestPstreeIDs(t *testing.T) {
	r := rand.New(rand.NewSource(1))
	for i := 0; i < 200; i++ {
		e := &pstree.PstreeEntry{Pid: ptr(r.Uint32()), Ppid: ptr(r.Uint32()), Pgid: ptr(r.Uint32()), Sid: ptr(r.Uint32())}
		for j := r.Intn(5); j > 0; j-- {
			e.Threads = append(e.Threads, r.Uint32()>>uint(r.Intn(32)))
		}
		raw, err := proto.Marshal(e)
		if err != nil {
			t.Fatal(err)
		}
		pid, threads, err := PstreeIDs(raw)
		if err != nil {
			t.Fatal(err)
		}
		if pid != e.GetPid() || !slices.Equal(threads, e.Threads) {
			t.Fatalf("entry %v: got pid %d threads %v", e, pid, threads)
		}
	}
	// Threads packed (proto3 style) decode the same.
	var raw []byte
	raw = protowire.AppendTag(raw, 1, protowire.VarintType)
	raw = protowire.AppendVarint(raw, 7)
	var packed []byte
	for _, t := range []uint64{7, 8, 300} {
		packed = protowire.AppendVarint(packed, t)
	}
	raw = protowire.AppendTag(raw, 5, protowire.BytesType)
	raw = protowire.AppendBytes(raw, packed)
	if pid, threads, err := PstreeIDs(raw); err != nil || pid != 7 || !slices.Equal(threads, []uint32{7, 8, 300}) {
		t.Fatalf("packed: %d %v %v", pid, threads, err)
	}
	for name, bad := range map[string][]byte{
		"no pid":    protowire.AppendVarint(protowire.AppendTag(nil, 2, protowire.VarintType), 1),
		"truncated": raw[:len(raw)-1],
		"group":     protowire.AppendTag(nil, 1, protowire.StartGroupType),
	} {
		if _, _, err := PstreeIDs(bad); err == nil {
			t.Errorf("%s: no error", name)
		}
	}
}

// TestFileNames checks fileNames against entries encoded by go-criu's
// generated code: regular files, unix sockets and other kinds.
func TestFileNames(t *testing.T) {
	fo := &fown.FownEntry{Uid: ptr(uint32(0)), Euid: ptr(uint32(0)), Signum: ptr(uint32(0)), PidType: ptr(uint32(0)), Pid: ptr(uint32(0))}
	tests := []struct {
		name string
		e    *fdinfo.FileEntry
		reg  string
		usk  string
	}{
		{"regular file", &fdinfo.FileEntry{Type: fdinfo.FdTypes_REG.Enum(), Id: ptr(uint32(3)),
			Reg: &regfile.RegFileEntry{Id: ptr(uint32(3)), Flags: ptr(uint32(2)), Pos: ptr(uint64(1 << 40)), Fown: fo, Name: ptr("/work/a file"), Size: ptr(uint64(9))}}, "/work/a file", ""},
		{"unix socket", &fdinfo.FileEntry{Type: fdinfo.FdTypes_UNIXSK.Enum(), Id: ptr(uint32(4)),
			Usk: &sk_unix.UnixSkEntry{Id: ptr(uint32(4)), Ino: ptr(uint32(1)), Type: ptr(uint32(1)), State: ptr(uint32(10)), Flags: ptr(uint32(0)),
				Uflags: ptr(uint32(0)), Backlog: ptr(uint32(5)), Peer: ptr(uint32(0)), Fown: fo, Opts: &sk_opts.SkOptsEntry{SoSndbuf: ptr(uint32(1)), SoRcvbuf: ptr(uint32(1)), SoSndTmoSec: ptr(uint64(0)), SoSndTmoUsec: ptr(uint64(0)), SoRcvTmoSec: ptr(uint64(0)), SoRcvTmoUsec: ptr(uint64(0))},
				Name: []byte("/tmp/app.sock")}}, "", "/tmp/app.sock"},
		{"abstract socket", &fdinfo.FileEntry{Type: fdinfo.FdTypes_UNIXSK.Enum(), Id: ptr(uint32(5)),
			Usk: &sk_unix.UnixSkEntry{Id: ptr(uint32(5)), Ino: ptr(uint32(2)), Type: ptr(uint32(1)), State: ptr(uint32(10)), Flags: ptr(uint32(0)),
				Uflags: ptr(uint32(0)), Backlog: ptr(uint32(5)), Peer: ptr(uint32(0)), Fown: fo, Opts: &sk_opts.SkOptsEntry{SoSndbuf: ptr(uint32(1)), SoRcvbuf: ptr(uint32(1)), SoSndTmoSec: ptr(uint64(0)), SoSndTmoUsec: ptr(uint64(0)), SoRcvTmoSec: ptr(uint64(0)), SoRcvTmoUsec: ptr(uint64(0))},
				Name: []byte("\x00abstract")}}, "", "\x00abstract"},
		{"pipe", &fdinfo.FileEntry{Type: fdinfo.FdTypes_PIPE.Enum(), Id: ptr(uint32(6))}, "", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			raw, err := proto.Marshal(tc.e)
			if err != nil {
				t.Fatal(err)
			}
			reg, usk, err := fileNames(raw)
			if err != nil {
				t.Fatal(err)
			}
			if reg != tc.reg || string(usk) != tc.usk {
				t.Fatalf("got reg %q usk %q, want %q %q", reg, usk, tc.reg, tc.usk)
			}
		})
	}
	if _, _, err := fileNames([]byte{0x1a, 0x05, 0x32}); err == nil {
		t.Error("truncated entry: no error")
	}
}
