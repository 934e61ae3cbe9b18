// Command policy-go is an example rewind checkpoint policy written in Go: a
// variant of the built-in "effects" rule that does not take a full
// checkpoint when the only memory written in a turn was written by shells
// (bash, sh, dash, zsh): an interactive shell dirties its heap on every
// command, which would otherwise make every turn a full checkpoint.
//
// Build it to a WASM module with one command (see README.md):
//
//	make            # = GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared -o policy.wasm .
package main

import "github.com/rewind-sandbox/rewind/policy/guest"

// init registers the classifier. guest.Handle decodes the whole report,
// samples included; use guest.HandleCounters when counts are enough.
func init() { guest.Handle(Classify) }

// main is never called: the module is a reactor (built with
// -buildmode=c-shared) whose exports the host calls.
func main() {}
