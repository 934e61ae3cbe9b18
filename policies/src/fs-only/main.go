//go:build wasip1

// Command fs-only is rewind's built-in "fs-only" policy as a WASM reactor module.
// Build it with scripts/build-policies.sh; the logic is rules.FSOnly.
package main

import (
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func init() { guest.HandleCounters(rules.FSOnly) }

func main() {}
