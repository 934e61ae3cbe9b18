#!/usr/bin/env bash
# Rebuilds rewind's WASM policies deterministically:
#   - the built-in policies policies/src/<name> -> policies/wasm/<name>.wasm
#     (Go, GOOS=wasip1 reactors, data segments merged; the toolchain version
#     is recorded in policies/wasm/TOOLCHAIN, because another Go release emits
#     other bytes);
#   - the hand-written WAT modules (examples/policy-wat, policy/testdata/hostile)
#     when wat2wasm (Debian package wabt) is installed.
#
# Usage: scripts/build-policies.sh [OUTDIR]
#   OUTDIR defaults to policies/wasm; with OUTDIR only the Go built-ins are
#   built (this is what the reproducibility test uses).
set -euo pipefail
shopt -s nullglob
cd "$(dirname "$0")/.."

GO=${GO:-go}
out=${1:-policies/wasm}
mkdir -p "$out"

# Fixed flags: no VCS stamping, no paths, no build id, stripped.
export GOOS=wasip1 GOARCH=wasm CGO_ENABLED=0 GOWASM= GOFLAGS=-buildvcs=false
for dir in policies/src/*/; do
	name=$(basename "$dir")
	"$GO" build -buildmode=c-shared -trimpath -ldflags="-s -w -buildid=" -o "$out/$name.wasm" "./$dir"
done
echo "$("$GO" env GOVERSION)" > "$out/TOOLCHAIN"
unset GOOS GOARCH GOWASM
# Go's linker writes one data segment per run of non-zero bytes (22,000 per
# policy); merged, every instantiation of a policy is 2-3 ms faster.
"$GO" run ./internal/wasmdata/mergedata "$out"/*.wasm

if [[ $# -eq 0 ]]; then
	if command -v wat2wasm >/dev/null; then
		for wat in examples/policy-wat/*.wat policy/testdata/hostile/*.wat; do
			wat2wasm "$wat" -o "${wat%.wat}.wasm"
		done
	else
		echo "build-policies: wat2wasm not found (apt-get install wabt): WAT modules not rebuilt" >&2
	fi
fi
echo "build-policies: built $(ls "$out"/*.wasm | wc -l) built-in policies into $out ($(cat "$out/TOOLCHAIN"))" >&2
