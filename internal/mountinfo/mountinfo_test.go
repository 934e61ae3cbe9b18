package mountinfo

import "testing"

func TestUnescape(t *testing.T) {
	tests := []struct{ in, want string }{
		{"/plain/path", "/plain/path"},
		{`/with\040space`, "/with space"},
		{`/tab\011nl\012`, "/tab\tnl\n"},
		{`/back\134slash`, `/back\slash`},
		{`/trailing\04`, `/trailing\04`},
		{`/not\9octal`, `/not\9octal`},
		{`\040`, " "},
		{``, ``},
	}
	for _, tc := range tests {
		if got := Unescape(tc.in); got != tc.want {
			t.Errorf("Unescape(%q) = %q, want %q", tc.in, got, tc.want)
		}
	}
}

func TestParse(t *testing.T) {
	in := "26 1 254:0 / / rw,relatime shared:1 - ext4 /dev/vda rw\n" +
		"90 26 0:52 / /tmp/a\\040b rw,nosuid - fuse.rewind rewind:x rw,user_id=0\n" +
		"garbage line\n" +
		"91 26 0:53 / /v rw - overlay overlay rw,lowerdir=/l\n"
	got := Parse([]byte(in))
	want := []Mount{{"254:0", "/", "ext4", "rw"}, {"0:52", "/tmp/a b", "fuse.rewind", "rw,user_id=0"}, {"0:53", "/v", "overlay", "rw,lowerdir=/l"}}
	if len(got) != len(want) {
		t.Fatalf("Parse = %+v, want %+v", got, want)
	}
	for i := range want {
		if got[i] != want[i] {
			t.Errorf("mount %d = %+v, want %+v", i, got[i], want[i])
		}
	}
}
