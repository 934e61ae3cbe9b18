package cr

import (
	"strings"
	"testing"
)

// TestSharedStateTakesCRIU: a process holding state a fork shares instead
// of copying (a memfd, a MAP_SHARED anonymous region, an unlinked
// temporary file) is checkpointed through CRIU, and every restore brings
// back the content it had at the checkpoint, although the live process
// changed it afterwards; one mapping SysV shared memory is refused. Through a
// template (the path before sharedState) the restored process read the
// live process's later writes.
func TestSharedStateTakesCRIU(t *testing.T) {
	needCRIU(t)
	for _, tc := range []struct {
		name, setup, change, probe, want, why string
		// fails: the checkpoint fails, with an error naming this (CRIU
		// dumps SysV shared memory only with the IPC namespace, which
		// the sandbox's processes do not own), rather than restoring
		// what the live process wrote later.
		fails string
	}{
		{
			name:   "memfd",
			setup:  "m = os.memfd_create('mf'); os.write(m, b'memfd-orig')",
			change: "os.pwrite(m, b'MEMFD-CHNG', 0)",
			probe:  "print(os.pread(m, 10, 0).decode())",
			want:   "memfd-orig",
			why:    "/memfd:mf",
		},
		{
			name:   "shared-anon",
			setup:  "a = mmap.mmap(-1, 4096, flags=mmap.MAP_SHARED); a[:8] = b'anonORIG'",
			change: "a[:8] = b'anonCHNG'",
			probe:  "print(a[:8].decode())",
			want:   "anonORIG",
			why:    "/dev/zero",
		},
		{
			name:   "unlinked-file",
			setup:  "f = tempfile.TemporaryFile(dir=D); f.write(b'tmp-orig'); f.flush()",
			change: "f.seek(0); f.write(b'TMP-CHNG'); f.flush()",
			probe:  "print(os.pread(f.fileno(), 8, 0).decode())",
			want:   "tmp-orig",
			why:    "without a name",
		},
		{
			// Past criu's default limit for such files (1 MiB).
			name:   "unlinked-file-8MiB",
			setup:  "f = tempfile.TemporaryFile(dir=D); f.write(b'tmp-orig' * (1 << 20)); f.flush()",
			change: "f.seek(0); f.write(b'TMP-CHNG'); f.flush()",
			probe:  "print(os.pread(f.fileno(), 8, 0).decode(), os.fstat(f.fileno()).st_size)",
			want:   "tmp-orig 8388608",
			why:    "without a name",
		},
		{
			name:   "sysv-shm",
			setup:  "import ctypes; L = ctypes.CDLL(None); L.shmat.restype = ctypes.c_void_p; sid = L.shmget(0, 4096, 0o1600); p = L.shmat(sid, None, 0); L.shmctl(sid, 0, None); ctypes.memmove(p, b'sysvORIG', 8)",
			change: "ctypes.memmove(p, b'sysvCHNG', 8)",
			probe:  "print(ctypes.string_at(p, 8).decode())",
			want:   "sysvORIG",
			why:    "/SYSV",
			fails:  "SysVIPC",
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sb := startSandbox(t, "python3", "-u", "-c", pyLoop)
			live := session{in: sb.in, out: sb.out}
			pyChat(t, live, "import os, mmap, tempfile; D = "+pyQuote(t.TempDir()))
			pyChat(t, live, tc.setup)
			if got := pyChat(t, live, tc.probe); got != tc.want {
				t.Fatalf("before the checkpoint: %q, want %q", got, tc.want)
			}
			e := newEngine(t, Config{Warm: true, ImagesDir: t.TempDir(), Logger: testLogger()})
			barrier := 0
			ck, err := e.Checkpoint(ctxT(t), sb, CheckpointOptions{ID: "c", Barrier: func() error { barrier++; return nil }})
			if tc.fails != "" {
				if err == nil || !strings.Contains(err.Error(), tc.fails) || !strings.Contains(err.Error(), tc.why) {
					t.Fatalf("checkpoint: %v; want an error naming %q and %q", err, tc.fails, tc.why)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if ck.Mode != ModeCRIU || !strings.Contains(ck.Reason, tc.why) || barrier != 1 {
				t.Fatalf("checkpoint mode %s, reason %q, barrier ran %d times; want %s, a reason naming %q, once", ck.Mode, ck.Reason, barrier, ModeCRIU, tc.why)
			}
			pyChat(t, live, tc.change)
			if got := pyChat(t, live, tc.probe); got == tc.want {
				t.Fatalf("the live change is not visible: %q", got)
			}
			for i := range 2 {
				stdio, sessions := freshStdio(t, sb)
				if _, err := e.Restore(ctxT(t), sb, "c", RestoreOptions{Stdio: stdio}); err != nil {
					t.Fatal(err)
				}
				s := <-sessions
				if got := pyChat(t, s, tc.probe); got != tc.want {
					t.Fatalf("restore %d: %q, want the checkpoint's %q", i, got, tc.want)
				}
				// The restored process changes it in turn; the next
				// restore must not see that either.
				pyChat(t, s, tc.change)
			}
		})
	}
}

// TestSharedMapping: which lines of /proc/PID/maps are shared state.
func TestSharedMapping(t *testing.T) {
	for _, tc := range []struct {
		line   string
		shared bool
	}{
		{"7f0be1153000-7f0be1154000 rw-s 00000000 00:01 0                          /SYSV00000000 (deleted)", true},
		{"7f0be1da9000-7f0be1daa000 rw-s 00000000 00:01 120952                     /dev/zero (deleted)", true},
		{"7f0be1daa000-7f0be1dab000 rw-s 00000000 00:01 120951                     /memfd:mf (deleted)", true},
		{"7f0be1daa000-7f0be1dab000 r--s 00000000 fe:00 120951                     /work/a file (deleted)", true},
		{"7f0be1dab000-7f0be1db2000 r--s 00000000 fe:00 325737                     /usr/lib/x86_64-linux-gnu/gconv/gconv-modules.cache", false},
		{"7f0be1daa000-7f0be1dab000 rw-p 00000000 00:01 120951                     /memfd:mf (deleted)", false},
		{"7f0be1daa000-7f0be1dab000 rw-p 00000000 00:00 0 ", false},
		{"7ffd5a1c4000-7ffd5a1e5000 rw-p 00000000 00:00 0                          [stack]", false},
		{"", false},
	} {
		why := sharedMapping(tc.line)
		if (why != "") != tc.shared {
			t.Errorf("sharedMapping(%q) = %q, want shared %v", tc.line, why, tc.shared)
		}
	}
}

// pyQuote is s as a Python string literal.
func pyQuote(s string) string {
	return "'" + strings.NewReplacer(`\`, `\\`, `'`, `\'`).Replace(s) + "'"
}

// BenchmarkSharedState: the check a template checkpoint now makes of every
// process while it is stopped (its maps and each descriptor), on an
// interactive bash.
func BenchmarkSharedState(b *testing.B) {
	sb := startSandbox(b, "bash", "--norc", "--noprofile")
	bashChat(b, session{in: sb.in, out: sb.out}, "cd /")
	kids, err := children(sb.InitPID())
	if err != nil || len(kids) != 1 {
		b.Fatalf("children of init: %v %v", kids, err)
	}
	for b.Loop() {
		if why := sharedState(kids[0]); why != "" {
			b.Fatal(why)
		}
	}
}
