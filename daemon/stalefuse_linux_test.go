package daemon

import (
	"reflect"
	"testing"
)

func TestStaleFUSEMounts(t *testing.T) {
	info := `22 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw
39 22 0:39 / /var/lib/rewind/mnt/sb-1 rw,nosuid,nodev shared:20 - fuse.rewind rewind:sb-1 rw,user_id=0,group_id=0
40 22 0:40 / /var/lib/rewind/mnt/sb-2 rw shared:21 - fuse rewind rw
41 22 0:41 / /var/lib/rewind/mntx/sb-3 rw shared:22 - fuse.rewind rewind rw
42 22 0:42 / /var/lib/rewind/mnt/sb-4 rw shared:23 - overlay overlay rw,lowerdir=/a
43 22 0:43 / /home/u/my\040state/mnt/sb-5 rw shared:24 - fuse.rewind rewind rw
44 22 0:44 / /other/fuse rw shared:25 - fuse.sshfs host: rw
`
	for _, tc := range []struct {
		dir  string
		want []fuseMount
	}{
		{"/var/lib/rewind/mnt", []fuseMount{{"/var/lib/rewind/mnt/sb-1", 39}, {"/var/lib/rewind/mnt/sb-2", 40}}},
		{"/home/u/my state/mnt", []fuseMount{{"/home/u/my state/mnt/sb-5", 43}}},
		{"/nowhere", nil},
	} {
		if got := staleFUSEMounts([]byte(info), tc.dir); !reflect.DeepEqual(got, tc.want) {
			t.Errorf("under %s: %v, want %v", tc.dir, got, tc.want)
		}
	}
}
