package compat

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"golang.org/x/sys/unix"

	"github.com/rewind-sandbox/rewind/internal/testenv"
)

// TestCRIUCheckBesideLongMount: an overlay mount whose mountinfo line is
// longer than CRIU's parser takes (a deep lowerdir+ stack) must not make
// the doctor report CRIU missing, and the check must leave it mounted.
func TestCRIUCheckBesideLongMount(t *testing.T) {
	testenv.RequireRoot(t)
	_, err := FindCRIU("")
	testenv.Require(t, err == nil, "criu (make deps)")
	base := filepath.Join(t.TempDir(), strings.Repeat("d", 100))
	fd, err := unix.Fsopen("overlay", unix.FSOPEN_CLOEXEC)
	testenv.Require(t, err == nil, "overlayfs")
	defer unix.Close(fd)
	for i := range 60 {
		l := filepath.Join(base, fmt.Sprintf("layer-%03d-%s", i, strings.Repeat("x", 40)))
		if err := os.MkdirAll(l, 0o755); err != nil {
			t.Fatal(err)
		}
		if err := unix.FsconfigSetString(fd, "lowerdir+", l); err != nil {
			testenv.Require(t, false, "overlayfs lowerdir+: "+err.Error())
		}
	}
	up, work, mp := filepath.Join(base, "up"), filepath.Join(base, "work"), filepath.Join(base, "mp")
	for _, d := range []string{up, work, mp} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := unix.FsconfigSetString(fd, "upperdir", up); err != nil {
		t.Fatal(err)
	}
	if err := unix.FsconfigSetString(fd, "workdir", work); err != nil {
		t.Fatal(err)
	}
	if err := unix.FsconfigCreate(fd); err != nil {
		t.Fatal(err)
	}
	mfd, err := unix.Fsmount(fd, unix.FSMOUNT_CLOEXEC, 0)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(mfd)
	if err := unix.MoveMount(mfd, "", unix.AT_FDCWD, mp, unix.MOVE_MOUNT_F_EMPTY_PATH); err != nil {
		t.Fatal(err)
	}
	defer unix.Unmount(mp, unix.MNT_DETACH)
	for _, c := range probeCRIU(context.Background(), "") {
		if c.Name == "check" && c.Status != OK {
			t.Errorf("criu check beside a long overlay mount: %s: %s", c.Status, c.Detail)
		}
	}
	if err := unix.Access(filepath.Join(mp, "."), unix.F_OK); err != nil {
		t.Fatal(err)
	}
	var st, pst unix.Stat_t
	if unix.Stat(mp, &st) != nil || unix.Stat(base, &pst) != nil || st.Dev == pst.Dev {
		t.Fatal("the check unmounted the host's overlay")
	}
}
