package main

import "testing"

func TestParseSize(t *testing.T) {
	cases := []struct {
		in   string
		want int64
		ok   bool
	}{
		{"10G", 10 << 30, true},
		{"512M", 512 << 20, true},
		{"1t", 1 << 40, true},
		{"2GiB", 2 << 30, true},
		{"4096", 4096, true},
		{"", 0, false},
		{"-1G", 0, false},
		{"1x", 0, false},
	}
	for _, c := range cases {
		got, err := parseSize(c.in)
		if (err == nil) != c.ok || got != c.want {
			t.Errorf("parseSize(%q) = %d, %v; want %d ok=%v", c.in, got, err, c.want, c.ok)
		}
	}
}
