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
