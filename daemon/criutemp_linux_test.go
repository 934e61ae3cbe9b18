package daemon

import (
	"testing"

	"github.com/rewind-sandbox/rewind/effect"
)

func TestDiscountCRIUTemp(t *testing.T) {
	own := "/tmp/.criu.move_mount_set_group.Ab12Cd"
	for _, tc := range []struct {
		name    string
		fs      effect.FS
		changed bool
		created uint64
	}{
		{"criu only", effect.FS{Created: 1, Deleted: 1, Samples: []effect.PathSample{{Op: "create", Path: own}, {Op: "delete", Path: own}}}, false, 0},
		{"criu and the agent", effect.FS{Created: 2, Deleted: 1, Samples: []effect.PathSample{{Op: "create", Path: own}, {Op: "create", Path: "/w/f"}, {Op: "delete", Path: own}}}, true, 1},
		{"left behind", effect.FS{Created: 1, Samples: []effect.PathSample{{Op: "create", Path: own}}}, true, 1},
		{"written to", effect.FS{Created: 1, Modified: 1, Deleted: 1, Samples: []effect.PathSample{{Op: "create", Path: own}, {Op: "modify", Path: own}, {Op: "delete", Path: own}}}, true, 1},
		{"another name", effect.FS{Created: 1, Deleted: 1, Samples: []effect.PathSample{{Op: "create", Path: "/tmp/.criu.move_mount_set_group.x"}, {Op: "delete", Path: "/tmp/.criu.move_mount_set_group.x"}}}, true, 1},
		{"elsewhere", effect.FS{Created: 1, Deleted: 1, Samples: []effect.PathSample{{Op: "create", Path: "/w" + own}, {Op: "delete", Path: "/w" + own}}}, true, 1},
	} {
		r := &effect.Report{FS: tc.fs}
		discountCRIUTemp(r)
		if r.FSChanged() != tc.changed || r.FS.Created != tc.created {
			t.Errorf("%s: changed %v created %d (%+v), want %v %d", tc.name, r.FSChanged(), r.FS.Created, r.FS, tc.changed, tc.created)
		}
	}
	// Truncated samples may hide changes the counters count: untouched.
	r := &effect.Report{FS: effect.FS{Created: 40, Deleted: 40}}
	for i := 0; i < effect.MaxSamples/2; i++ {
		r.FS.Samples = append(r.FS.Samples, effect.PathSample{Op: "create", Path: own}, effect.PathSample{Op: "delete", Path: own})
	}
	discountCRIUTemp(r)
	if r.FS.Created != 40 {
		t.Errorf("truncated samples: %+v", r.FS)
	}
}
