// Package policies embeds rewind's built-in checkpoint policies as WASM
// modules: effects (the default), always, fs-only and cautious. Their logic
// is package rules; their sources are policies/src/<name>; the committed
// modules in policies/wasm are rebuilt deterministically by
// scripts/build-policies.sh and checked against their sources by the tests.
package policies

import (
	"embed"

	"github.com/rewind-sandbox/rewind/policies/rules"
)

//go:embed wasm/*.wasm
var modules embed.FS

// Default is the name of the default policy.
const Default = rules.NameEffects

// Names lists the built-in policies, the default first.
func Names() []string { return rules.Names() }

// WASM returns the module of the built-in policy name.
func WASM(name string) ([]byte, bool) {
	if _, ok := rules.ByName(name); !ok {
		return nil, false
	}
	b, err := modules.ReadFile("wasm/" + name + ".wasm")
	return b, err == nil
}
