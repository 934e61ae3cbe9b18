package fs

import (
	"os"
	"testing"
)

func TestSmoke(t *testing.T) {
	fx := mountT(t, func(l string) {
		mustWrite(t, l+"/a/b.txt", "lower")
		mustWrite(t, l+"/c.txt", "c")
	}, Options{})
	if got := mustRead(t, fx.p("a/b.txt")); got != "lower" {
		t.Fatalf("read %q", got)
	}
	mustWrite(t, fx.p("a/b.txt"), "upper")
	if got := mustRead(t, fx.p("a/b.txt")); got != "upper" {
		t.Fatalf("read %q", got)
	}
	if got := mustRead(t, fx.lower+"/a/b.txt"); got != "lower" {
		t.Fatalf("lower changed: %q", got)
	}
	c1 := fx.checkpoint(t)
	if err := os.Remove(fx.p("c.txt")); err != nil {
		t.Fatal(err)
	}
	mustWrite(t, fx.p("a/b.txt"), "v2")
	mustWrite(t, fx.p("new/x"), "x")
	if _, err := os.Stat(fx.p("c.txt")); !os.IsNotExist(err) {
		t.Fatalf("c.txt still there: %v", err)
	}
	fx.restore(t, c1)
	if got := mustRead(t, fx.p("a/b.txt")); got != "upper" {
		t.Fatalf("after restore read %q", got)
	}
	if got := mustRead(t, fx.p("c.txt")); got != "c" {
		t.Fatalf("after restore c %q", got)
	}
	if _, err := os.Stat(fx.p("new")); !os.IsNotExist(err) {
		t.Fatalf("new still there: %v", err)
	}
}
