package guest

import (
	"strings"
	"testing"

	"github.com/rewind-sandbox/rewind/effect"
)

func TestCall(t *testing.T) {
	t.Cleanup(func() { registered = handler{} })
	in := (&effect.Report{Turn: 3, FS: effect.FS{Samples: []effect.PathSample{{Op: "create", Path: "/a"}}}}).AppendWire(nil)
	long := strings.Repeat("x", MaxReason+50)
	tests := []struct {
		name   string
		set    func()
		in     []byte
		code   Decision
		reason string
	}{
		{"none registered", func() { registered = handler{} }, in, Error, "no classifier registered (call guest.Handle in init)"},
		{"full decode", func() {
			Handle(func(r *effect.Report) (Decision, string) { return FS, r.FS.Samples[0].Path })
		}, in, FS, "/a"},
		{"counters only", func() {
			HandleCounters(func(r *effect.Report) (Decision, string) { return Skip, strings.Repeat("t", int(r.Turn)) })
		}, in, Skip, "ttt"},
		{"reason cut", func() { Handle(func(*effect.Report) (Decision, string) { return Full, long }) }, in, Full, long[:MaxReason]},
		{"panic", func() {
			Handle(func(r *effect.Report) (Decision, string) { panic("boom") })
		}, in, Error, "policy panicked"},
		{"bad input", func() { Handle(func(*effect.Report) (Decision, string) { return Skip, "" }) }, []byte("junk"), Error, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			tt.set()
			out := Call(tt.in)
			if len(out) == 0 || Decision(out[0]) != tt.code {
				t.Fatalf("output %q, want code %d", out, tt.code)
			}
			if tt.reason != "" && string(out[1:]) != tt.reason {
				t.Fatalf("reason %q, want %q", out[1:], tt.reason)
			}
		})
	}
}
