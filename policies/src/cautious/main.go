//go:build wasip1

// Command cautious is rewind's built-in "cautious" policy as a WASM reactor module.
// Build it with scripts/build-policies.sh; the logic is rules.Cautious.
package main

import (
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func init() { guest.HandleCounters(rules.Cautious) }

func main() {}
