#!/usr/bin/env bash
# make bench: the quick version of every benchmark (minutes, not CI), each
# printing rewind next to its baseline. Results go to bench-results/ (JSON,
# Markdown, SVG for the MCTS replay). Long runs: `rewind bench mcts --full`.
#
# A private daemon (own state dir and socket) is started for the API-level
# benchmarks and stopped at the end.
set -euo pipefail
cd "$(dirname "$0")/.."
out=${BENCH_OUT:-bench-results}
mkdir -p "$out"
bin=./bin/rewind
state=$(mktemp -d /tmp/rewind-bench-state.XXXXXX)
sock=$state.sock
cleanup() {
	[[ -n ${dpid:-} ]] && kill "$dpid" 2>/dev/null && wait "$dpid" 2>/dev/null
	# Unmount what a crashed daemon may have left before removing the dir.
	grep " $state" /proc/mounts | awk '{print $2}' | sort -r | xargs -r -n1 umount -l 2>/dev/null || true
	rm -rf --one-file-system "$state" "$sock"
}
trap cleanup EXIT

echo "== go test -bench (package benchmarks, one iteration each)"
pkgs=()
for p in fs layer kernelpath cr cr/criu sandbox probe/probebench policy; do
	[[ -d $p ]] && pkgs+=("./$p/")
done
REWIND_BENCH=1 go test -run '^$' -bench . -benchtime "${BENCHTIME:-1x}" -timeout 30m "${pkgs[@]}" | tee "$out/go-bench.txt"

"$bin" daemon --state "$state/state" --socket "$sock" >"$state.log" 2>&1 &
dpid=$!
for _ in $(seq 50); do [[ -S $sock ]] && break; sleep 0.1; done

echo "== rewind bench turn"
"$bin" bench turn --socket "$sock" --n 100 | tee "$out/turn.txt"
echo "== rewind bench fanout"
"$bin" bench fanout --socket "$sock" -n 16,32,64 | tee "$out/fanout.md"
echo "== rewind bench mcts --quick"
"$bin" bench mcts --socket "$sock" --quick --out "$out" | tee "$out/mcts.txt"
echo "results in $out/"
