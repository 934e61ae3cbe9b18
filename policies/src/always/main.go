//go:build wasip1

// Command always is rewind's built-in "always" policy as a WASM reactor module.
// Build it with scripts/build-policies.sh; the logic is rules.Always.
package main

import (
	"github.com/rewind-sandbox/rewind/policies/rules"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

func init() { guest.HandleCounters(rules.Always) }

func main() {}
