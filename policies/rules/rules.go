// Package rules holds the decision logic of rewind's built-in policies as
// plain Go functions. The WASM modules in policies/wasm are these functions
// compiled for wasip1 (see policies/src); natively they serve as the
// benchmark baseline and as the reference the fixtures are checked against.
//
// The code compiles for GOOS=wasip1 and avoids fmt, so the modules stay
// small and a decision stays in the microseconds.
package rules

import (
	"strconv"

	"github.com/rewind-sandbox/rewind/effect"
	"github.com/rewind-sandbox/rewind/policy/guest"
)

// Names of the built-in policies, the default first.
const (
	NameEffects  = "effects"
	NameAlways   = "always"
	NameFSOnly   = "fs-only"
	NameCautious = "cautious"
)

// Names lists the built-in policies, the default first.
func Names() []string { return []string{NameEffects, NameAlways, NameFSOnly, NameCautious} }

// ByName returns the rule of a built-in policy.
func ByName(name string) (guest.Func, bool) {
	switch name {
	case NameEffects:
		return Effects, true
	case NameAlways:
		return Always, true
	case NameFSOnly:
		return FSOnly, true
	case NameCautious:
		return Cautious, true
	}
	return nil, false
}

func u(v uint64) string { return strconv.FormatUint(v, 10) }

// Effects is the default policy (Crab's rule): skip when nothing lasting
// changed, fs when only files changed, full when the set of processes
// changed (a process born in the turn is still alive, or one that existed
// before it died), memory was written by a live process, or a cwd changed.
// Processes born and reaped within the turn (the grep or cat a shell runs)
// leave no process state behind and do not count. Lost events mean the
// report cannot be trusted: full.
func Effects(r *effect.Report) (guest.Decision, string) {
	if r.LostEvents > 0 {
		return guest.Full, "probe lost " + u(r.LostEvents) + " events"
	}
	p := &r.Proc
	if p.NewLongLived > 0 {
		return guest.Full, u(p.NewLongLived) + " new long-lived processes"
	}
	if died := PreexistingExited(r); died > 0 {
		return guest.Full, u(died) + " pre-existing processes exited"
	}
	if r.Mem.PagesWritten > 0 {
		return guest.Full, "memory written: " + u(r.Mem.PagesWritten) + " pages"
	}
	if p.CwdChanges > 0 {
		return guest.Full, "cwd changed"
	}
	if r.FSChanged() {
		return guest.FS, "files changed only"
	}
	if p.Forked > 0 {
		return guest.Skip, "no lasting effects (" + u(p.Forked) + " transient processes)"
	}
	return guest.Skip, "no effects"
}

// PreexistingExited returns how many processes that existed before the turn
// exited during it. Both probe backends count exactly that in Proc.Exited
// (processes alive at turn start and gone at its end), so a process born
// and reaped within the turn never counts, and a pre-existing one that died
// always does, however many transient processes the turn also forked.
func PreexistingExited(r *effect.Report) uint64 { return r.Proc.Exited }

// Always takes a full checkpoint every turn: the safe baseline.
func Always(*effect.Report) (guest.Decision, string) { return guest.Full, "always" }

// FSOnly never checkpoints processes: fs when files changed (or when the
// probe lost events, which might have hidden file changes), skip otherwise.
func FSOnly(r *effect.Report) (guest.Decision, string) {
	if r.LostEvents > 0 {
		return guest.FS, "probe lost " + u(r.LostEvents) + " events"
	}
	if r.FSChanged() {
		return guest.FS, "files changed"
	}
	return guest.Skip, "no file changes"
}

// Cautious is Effects, except that any non-loopback network connection or
// new listening socket — effects a restore cannot undo — takes a full
// checkpoint.
func Cautious(r *effect.Report) (guest.Decision, string) {
	if n := &r.Net; n.RemoteConnects+n.Listens > 0 {
		return guest.Full, "network effect: " + u(n.RemoteConnects) + " remote connects, " + u(n.Listens) + " listens"
	}
	return Effects(r)
}
