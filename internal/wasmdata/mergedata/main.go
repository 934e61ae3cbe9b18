// Command mergedata merges the data segments of WASM modules in place (see
// package wasmdata); scripts/build-policies.sh runs it on the built-in
// policies.
//
//	go run ./internal/wasmdata/mergedata FILE.wasm...
package main

import (
	"fmt"
	"os"

	"github.com/rewind-sandbox/rewind/internal/wasmdata"
)

func main() {
	if len(os.Args) < 2 {
		fmt.Fprintln(os.Stderr, "usage: mergedata FILE.wasm...")
		os.Exit(2)
	}
	for _, path := range os.Args[1:] {
		if err := mergeFile(path); err != nil {
			fmt.Fprintln(os.Stderr, "mergedata:", err)
			os.Exit(1)
		}
	}
}

func mergeFile(path string) error {
	b, err := os.ReadFile(path)
	if err != nil {
		return err
	}
	out, ok := wasmdata.Merge(b, wasmdata.DefaultGap)
	if !ok {
		return nil // already merged, or nothing to merge
	}
	fi, err := os.Stat(path)
	if err != nil {
		return err
	}
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, out, fi.Mode().Perm()); err != nil {
		return err
	}
	if err := os.Rename(tmp, path); err != nil {
		os.Remove(tmp)
		return fmt.Errorf("%s: %w", path, err)
	}
	return nil
}
