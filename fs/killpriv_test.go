package fs

import (
	"encoding/binary"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"syscall"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// capXattr is a valid security.capability value (revision 2,
// CAP_NET_RAW permitted).
func capXattr() []byte {
	b := make([]byte, 20)
	binary.LittleEndian.PutUint32(b[0:], 0x02000000)
	binary.LittleEndian.PutUint32(b[4:], 1<<13)
	return b
}

// TestKillPrivLikeNative runs writes, truncates and chowns that must drop
// setuid/setgid bits or file capabilities (or keep them) on a plain
// directory and on the mount, and compares the outcome.
func TestKillPrivLikeNative(t *testing.T) {
	type file struct {
		mode uint32
		caps bool
	}
	asUser := func(t *testing.T, script string) {
		t.Helper()
		cmd := exec.Command("sh", "-c", script)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000}}
		if out, err := cmd.CombinedOutput(); err != nil {
			t.Fatalf("as uid 1000: %s: %v %s", script, err, out)
		}
	}
	asRoot := func(t *testing.T, script string) {
		t.Helper()
		if out, err := exec.Command("sh", "-c", script).CombinedOutput(); err != nil {
			t.Fatalf("%s: %v %s", script, err, out)
		}
	}
	cases := []struct {
		name string
		f    file
		op   func(t *testing.T, p string)
	}{
		{"user write to suid+sgid file", file{mode: 06777}, func(t *testing.T, p string) { asUser(t, "printf x >> "+p) }},
		{"user write twice", file{mode: 06777}, func(t *testing.T, p string) {
			asUser(t, "printf x >> "+p)
			asRoot(t, "chmod 6777 "+p)
			asUser(t, "printf y >> "+p)
		}},
		{"user write to sgid file without group exec", file{mode: 02767}, func(t *testing.T, p string) { asUser(t, "printf x >> "+p) }},
		{"root write to suid file", file{mode: 06777}, func(t *testing.T, p string) { asRoot(t, "printf x >> "+p) }},
		{"user truncate of suid file", file{mode: 06777}, func(t *testing.T, p string) { asUser(t, ": > "+p) }},
		{"root chown of suid file", file{mode: 06755}, func(t *testing.T, p string) {
			if err := os.Chown(p, 0, 0); err != nil {
				t.Fatal(err)
			}
		}},
		{"root write to file with capabilities", file{mode: 0o755, caps: true}, func(t *testing.T, p string) { asRoot(t, "printf x >> "+p) }},
		{"user write to file with capabilities", file{mode: 0o777, caps: true}, func(t *testing.T, p string) { asUser(t, "printf x >> "+p) }},
		{"root chown of file with capabilities", file{mode: 0o755, caps: true}, func(t *testing.T, p string) {
			if err := os.Chown(p, 0, 0); err != nil {
				t.Fatal(err)
			}
		}},
	}
	mk := func(t *testing.T, p string, f file) {
		t.Helper()
		if err := os.WriteFile(p, []byte("data"), 0o600); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, os.FileMode(f.mode&0o777)|modeBits(f.mode)); err != nil {
			t.Fatal(err)
		}
		if f.caps {
			if err := unix.Setxattr(p, "security.capability", capXattr(), 0); err != nil {
				t.Fatal(err)
			}
		}
	}
	state := func(t *testing.T, p string) string {
		t.Helper()
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		_, err := unix.Lgetxattr(p, "security.capability", nil)
		b, rerr := os.ReadFile(p)
		if rerr != nil {
			t.Fatal(rerr)
		}
		return fmt.Sprintf("mode %o caps %v data %q", st.Mode&07777, err == nil, b)
	}
	for _, pt := range []bool{false, true} {
		t.Run(fmt.Sprintf("passthrough=%v", pt), func(t *testing.T) {
			native := t.TempDir()
			fx := mountT(t, func(l string) {
				for i, c := range cases {
					mk(t, filepath.Join(l, fmt.Sprint("lower", i)), c.f)
				}
			}, Options{Passthrough: pt})
			for d := filepath.Dir(fx.mp); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
				if err := os.Chmod(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			for d := native; d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
				if err := os.Chmod(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			for i, c := range cases {
				// Each case on a lower file (copied up by the operation)
				// and on a file created in the view.
				for _, where := range []string{"lower", "upper"} {
					name := fmt.Sprint(where, i)
					if where == "upper" {
						mk(t, fx.p(name), c.f)
					}
					np := filepath.Join(native, name)
					mk(t, np, c.f)
					c.op(t, np)
					c.op(t, fx.p(name))
					if got, want := state(t, fx.p(name)), state(t, np); got != want {
						t.Errorf("%s (%s file): mount has %s, native %s", c.name, where, got, want)
					}
				}
			}
		})
	}
}

func modeBits(m uint32) os.FileMode {
	var b os.FileMode
	if m&unix.S_ISUID != 0 {
		b |= os.ModeSetuid
	}
	if m&unix.S_ISGID != 0 {
		b |= os.ModeSetgid
	}
	if m&unix.S_ISVTX != 0 {
		b |= os.ModeSticky
	}
	return b
}

// TestKillPrivAfterRestore: a restore that brings a setuid bit back must
// not leave the kernel believing the file has nothing to drop (it caches
// that per inode).
func TestKillPrivAfterRestore(t *testing.T) {
	for _, pt := range []bool{false, true} {
		t.Run(fmt.Sprintf("passthrough=%v", pt), func(t *testing.T) {
			fx := mountT(t, func(l string) {
				if err := os.WriteFile(l+"/f", []byte("a"), 0o600); err != nil {
					t.Fatal(err)
				}
				if err := os.Chmod(l+"/f", 0o777|os.ModeSetuid); err != nil {
					t.Fatal(err)
				}
			}, Options{Passthrough: pt})
			for d := filepath.Dir(fx.mp); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
				if err := os.Chmod(d, 0o755); err != nil {
					t.Fatal(err)
				}
			}
			write := func(s string) {
				t.Helper()
				cmd := exec.Command("sh", "-c", "printf "+s+" >> "+fx.p("f"))
				cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000}}
				if out, err := cmd.CombinedOutput(); err != nil {
					t.Fatalf("write as uid 1000: %v %s", err, out)
				}
			}
			mode := func() uint32 {
				t.Helper()
				var st unix.Stat_t
				if err := unix.Lstat(fx.p("f"), &st); err != nil {
					t.Fatal(err)
				}
				return st.Mode & 07777
			}
			c1 := fx.checkpoint(t) // f is setuid here
			write("b")             // drops it
			if m := mode(); m != 0o777 {
				t.Fatalf("after a write by uid 1000: mode %o, want 777", m)
			}
			write("c") // the kernel now skips the check for this inode
			fx.restore(t, c1)
			if m := mode(); m != 0o4777 {
				t.Fatalf("after the restore: mode %o, want 4777", m)
			}
			write("d")
			if m := mode(); m != 0o777 {
				t.Errorf("after a write by uid 1000 following the restore: mode %o, want 777", m)
			}
			if got := mustRead(t, fx.p("f")); got != "ad" {
				t.Errorf("content %q, want %q", got, "ad")
			}
		})
	}
}

// TestKillPrivWithPassthroughReleasePending: a setuid/setgid file whose
// last passthrough handle is being closed while a user opens it for
// writing. The kernel sends the RELEASE after close(2) returns, so the
// open can find the node still counting that handle; the write must drop
// the bits all the same, as it does natively.
func TestKillPrivWithPassthroughReleasePending(t *testing.T) {
	fx := mountT(t, nil, Options{Passthrough: true})
	for d := filepath.Dir(fx.mp); d != "/" && d != os.TempDir(); d = filepath.Dir(d) {
		if err := os.Chmod(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	for _, mode := range []os.FileMode{0o777 | os.ModeSetuid, 0o767 | os.ModeSetgid} {
		p := fx.p(fmt.Sprintf("f%o", mode))
		w, err := os.OpenFile(p, os.O_CREATE|os.O_WRONLY, 0o600)
		if err != nil {
			t.Fatal(err)
		}
		if _, err := w.WriteString("data"); err != nil {
			t.Fatal(err)
		}
		if err := os.Chmod(p, mode); err != nil {
			t.Fatal(err)
		}
		// Close the creating handle while the user's open is under way
		// (the open waits for its RELEASE).
		closed := make(chan error, 1)
		go func() {
			time.Sleep(30 * time.Millisecond)
			closed <- w.Close()
		}()
		cmd := exec.Command("sh", "-c", "printf x >> "+p)
		cmd.SysProcAttr = &syscall.SysProcAttr{Credential: &syscall.Credential{Uid: 1000, Gid: 1000}}
		out, err := cmd.CombinedOutput()
		if cerr := <-closed; cerr != nil {
			t.Fatal(cerr)
		}
		if err != nil {
			t.Fatalf("write as uid 1000: %v %s", err, out)
		}
		var st unix.Stat_t
		if err := unix.Lstat(p, &st); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := fmt.Sprintf("mode %o data %q", st.Mode&07777, b), fmt.Sprintf("mode %o data %q", mode.Perm(), "datax"); got != want {
			t.Errorf("created %v, closed during a user's write: %s, want %s", mode, got, want)
		}
	}
}
