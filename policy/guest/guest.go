// Package guest is the Go side of rewind's WASM policy ABI (see ../ABI.md):
// a policy written in Go imports it, registers one classifier function, and
// is built with
//
//	GOOS=wasip1 GOARCH=wasm go build -buildmode=c-shared -o policy.wasm .
//
// When built for wasip1 the package exports rewind_abi_version, rewind_alloc
// and rewind_classify; on other platforms it only provides the ABI constants
// and the registration functions, so the same policy code can be unit-tested
// natively.
package guest

import "github.com/rewind-sandbox/rewind/effect"

// ABIVersion is the version of the policy ABI implemented by this package
// and accepted by the host.
const ABIVersion = 1

// Names of the exports a policy module must provide.
const (
	ExportMemory     = "memory"
	ExportABIVersion = "rewind_abi_version"
	ExportAlloc      = "rewind_alloc"
	ExportClassify   = "rewind_classify"
)

// MaxReason bounds the reason string a policy may return, in bytes.
const MaxReason = 256

// Decision is the first byte of a classify result.
type Decision uint8

// Decision codes of the ABI.
const (
	Skip  Decision = 0    // no checkpoint needed
	FS    Decision = 1    // file-system-only checkpoint
	Full  Decision = 2    // file system and processes
	Error Decision = 0xFF // the policy failed; the rest of the output is the error message
)

// Func is a classifier: it receives a decoded report and returns a decision
// and a short reason (at most MaxReason bytes; longer reasons are cut).
type Func func(r *effect.Report) (Decision, string)

// handler is the registered classifier. A WASM instance runs one policy, so
// a package-level registration is the natural shape for guest code.
type handler struct {
	fn           Func
	countersOnly bool
}

var registered handler

// Handle registers fn as the module's classifier. fn receives the fully
// decoded report, samples included. Call it from an init function.
func Handle(fn Func) { registered = handler{fn: fn} }

// HandleCounters registers fn as the module's classifier and decodes only the
// report's header and counters (no strings, no samples, no allocation): the
// fast path for policies that look at counts only.
func HandleCounters(fn Func) { registered = handler{fn: fn, countersOnly: true} }

// Call runs the registered classifier on an encoded report (the wire form,
// see effect.(*Report).AppendWire) and returns the ABI output: the decision
// byte followed by the reason. It is what the rewind_classify export does,
// callable natively so a policy can be tested without a WASM host.
func Call(in []byte) []byte {
	var r effect.Report
	return classify(in, make([]byte, 0, 1+MaxReason), &r)
}

// classify runs the registered classifier on an encoded report and appends
// the ABI output (decision byte, then reason) to out.
func classify(in []byte, out []byte, r *effect.Report) (res []byte) {
	defer func() {
		if p := recover(); p != nil {
			res = append(out[:0], byte(Error))
			res = appendReason(res, "policy panicked")
		}
	}()
	if registered.fn == nil {
		return appendReason(append(out[:0], byte(Error)), "no classifier registered (call guest.Handle in init)")
	}
	var err error
	if registered.countersOnly {
		err = effect.UnmarshalWireCounters(in, r)
	} else {
		err = r.UnmarshalWire(in)
	}
	if err != nil {
		return appendReason(append(out[:0], byte(Error)), err.Error())
	}
	d, reason := registered.fn(r)
	return appendReason(append(out[:0], byte(d)), reason)
}

func appendReason(b []byte, s string) []byte {
	if len(s) > MaxReason {
		s = s[:MaxReason]
	}
	return append(b, s...)
}
