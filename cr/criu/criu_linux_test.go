package criu

import "testing"

func TestFirstError(t *testing.T) {
	tests := []struct{ log, want string }{
		{"", ""},
		{"(00.1) Dumping\n(00.2) all fine\n", ""},
		{"(00.1) Error (criu/kerndat.c:1) RLIMIT_NOFILE\n(00.2) Seizing 12\n(10.0) Error (criu/cr-dump.c:1791): Timeout reached\n(10.1) Error: Dumping FAILED.\n",
			"; after (00.2) Seizing 12; (10.0) Error (criu/cr-dump.c:1791): Timeout reached"},
		{"(00.1) Error (criu/x.c:1): first\n", "; (00.1) Error (criu/x.c:1): first"},
	}
	for _, tc := range tests {
		if got := firstError(tc.log); got != tc.want {
			t.Errorf("firstError(%q) = %q, want %q", tc.log, got, tc.want)
		}
	}
}
