#!/usr/bin/env bash
# Quick benchmarks of every area that has one (minutes, not CI). Each
# benchmark measures rewind and its baseline in the same run and prints the
# ratio. Long runs: see README.md.
set -euo pipefail
cd "$(dirname "$0")/.."
pkgs=()
for p in fs layer cr sandbox probe policy state; do
	[[ -d $p ]] && ls "$p"/*_test.go >/dev/null 2>&1 && pkgs+=("./$p/...")
done
export REWIND_BENCH=1
go test -run '^$' -bench . -benchtime "${BENCHTIME:-1x}" -timeout 30m "${pkgs[@]}"
if ./bin/rewind bench --help >/dev/null 2>&1; then
	./bin/rewind bench --help | sed -n '/Available Commands/,/^$/p'
fi
