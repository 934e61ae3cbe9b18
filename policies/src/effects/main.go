//go:build wasip1

// Command effects is rewind's built-in "effects" policy as a WASM reactor module.
// Build it with scripts/build-policies.sh; the logic is rules.Effects.
package main

import (
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func init() { guest.HandleCounters(rules.Effects) }

func main() {}
