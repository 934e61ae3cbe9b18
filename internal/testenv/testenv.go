// Package testenv lets tests declare the host capabilities they need.
//
// On a developer machine a missing capability skips the test. Under CI
// (CI=true) or with REWIND_REQUIRE_ALL=1 it fails the test instead: the CI
// machine has every capability, so a skip there would hide a broken install.
package testenv

import (
	"os"
	"testing"
)

// Strict reports whether missing capabilities must fail tests rather than
// skip them.
func Strict() bool {
	return os.Getenv("CI") == "true" || os.Getenv("REWIND_REQUIRE_ALL") == "1"
}

// Require skips (or, under Strict, fails) t when ok is false, naming what is
// missing.
func Require(t testing.TB, ok bool, what string) {
	t.Helper()
	if ok {
		return
	}
	if Strict() {
		t.Fatalf("required capability missing: %s (CI=true or REWIND_REQUIRE_ALL=1 forbids skipping)", what)
	}
	t.Skipf("capability missing: %s", what)
}

// RequireNoErr is Require for a probe that returns an error.
func RequireNoErr(t testing.TB, err error, what string) {
	t.Helper()
	if err != nil {
		Require(t, false, what+": "+err.Error())
	}
}

// RequireRoot requires the test to run as root.
func RequireRoot(t testing.TB) {
	t.Helper()
	Require(t, os.Geteuid() == 0, "root")
}
