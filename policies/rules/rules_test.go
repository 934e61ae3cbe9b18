package rules

import (
	"testing"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func TestPreexistingExited(t *testing.T) {
	tests := []struct {
		forked, longLived, exited, want uint64
	}{
		{0, 0, 0, 0},
		{1, 0, 0, 0}, // a transient child: born and reaped, not in Exited
		{3, 1, 0, 0}, // two transient, one still running
		{0, 0, 1, 1}, // a pre-existing process died
		{1, 0, 1, 1}, // a pre-existing server killed by a turn that also forked once
		{2, 0, 3, 3},
	}
	for _, tt := range tests {
		r := effect.Report{Proc: effect.Proc{Forked: tt.forked, NewLongLived: tt.longLived, Exited: tt.exited}}
		if got := PreexistingExited(&r); got != tt.want {
			t.Errorf("forked %d long-lived %d exited %d: got %d, want %d", tt.forked, tt.longLived, tt.exited, got, tt.want)
		}
	}
}

func TestByName(t *testing.T) {
	for _, n := range Names() {
		if _, ok := ByName(n); !ok {
			t.Errorf("ByName(%q) missing", n)
		}
	}
	if _, ok := ByName("nope"); ok {
		t.Error("ByName(nope) found")
	}
	r := &effect.Report{Net: effect.Net{Listens: 1}, FS: effect.FS{Created: 1}}
	if d, _ := Cautious(r); d != guest.Full {
		t.Errorf("cautious on a listen: %d", d)
	}
	if d, _ := Effects(r); d != guest.FS {
		t.Errorf("effects on a listen and a file: %d", d)
	}
}
