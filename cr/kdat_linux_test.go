package cr

import (
	"bytes"
	"errors"
	"io/fs"
	"os"
	"path/filepath"
	"strconv"
	"testing"
)

func TestKdatSeed(t *testing.T) {
	e := newEngine(t, Config{Logger: testLogger()})
	data, err := e.makeKdat()
	if err != nil {
		t.Fatalf("make criu kdat: %v", err)
	}
	if len(data) == 0 {
		t.Fatal("empty criu kdat")
	}
	e.kdat.data = data
	outside := filepath.Join(t.TempDir(), "target")
	cases := []struct {
		name    string
		prepare func(root string) // root is the sandbox root seen from the host
		seeded  bool
		want    []byte // content of /run/criu.kdat after seedKdat (nil: absent)
		symlink bool
	}{
		{"fresh child gets the cache", func(string) {}, true, data, false},
		{"own cache kept", func(root string) {
			must(os.WriteFile(filepath.Join(root, "run/criu.kdat"), []byte("mine"), 0o600))
		}, false, []byte("mine"), false},
		{"symlink not followed", func(root string) {
			must(os.Symlink(outside, filepath.Join(root, "run/criu.kdat")))
		}, false, nil, true},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			sb := startReal(t)
			root := "/proc/" + strconv.Itoa(sb.InitPID()) + "/root"
			tc.prepare(root)
			if got := e.seedKdat(sb.InitPID()); got != tc.seeded {
				t.Fatalf("seedKdat = %v, want %v", got, tc.seeded)
			}
			p := filepath.Join(root, "run/criu.kdat")
			if tc.symlink {
				if _, err := os.Stat(outside); !errors.Is(err, fs.ErrNotExist) {
					t.Fatalf("seeding followed a sandbox symlink: %v", err)
				}
				return
			}
			got, err := os.ReadFile(p)
			if err != nil || !bytes.Equal(got, tc.want) {
				t.Fatalf("/run/criu.kdat = %q %v, want %q", got, err, tc.want)
			}
			if tc.seeded {
				unseedKdat(sb.InitPID())
				if _, err := os.Lstat(p); !errors.Is(err, fs.ErrNotExist) {
					t.Fatalf("cache left in the sandbox after unseed: %v", err)
				}
			}
		})
	}
}
