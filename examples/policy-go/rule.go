package main

import (
	"strconv"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

// shells are processes whose memory writes alone do not need a checkpoint.
var shells = map[string]bool{"bash": true, "sh": true, "dash": true, "zsh": true}

// Classify is the policy. It is plain Go, so it is unit-tested natively
// (rule_test.go) before being compiled to WASM.
func Classify(r *effect.Report) (guest.Decision, string) {
	d, reason := rules.Effects(r)
	if d != guest.Full || r.LostEvents > 0 || r.Mem.PagesWritten == 0 {
		return d, reason
	}
	// Re-run the rule without the memory writes, if every written page is
	// accounted for by a shell. If the per-process samples do not cover
	// all written pages, we cannot know who wrote the rest: stay safe.
	var shellPages uint64
	for _, p := range r.Mem.PerProc {
		if !shells[p.Comm] {
			return d, reason
		}
		shellPages += p.Pages
	}
	if shellPages < r.Mem.PagesWritten {
		return d, reason
	}
	quiet := *r
	quiet.Mem.PagesWritten = 0
	d2, reason2 := rules.Effects(&quiet)
	if d2 == guest.Full {
		return d2, reason2
	}
	return d2, reason2 + " (ignored " + strconv.FormatUint(shellPages, 10) + " pages written by shells)"
}
