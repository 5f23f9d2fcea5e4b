#!/usr/bin/env bash
# The main demo: a Jacobi heat solver on simulated local nodes (2 slots each) that grows
# and shrinks while it computes, 1 -> 2 -> 8 -> 4 -> 1 nodes, then the same solver on a
# fixed set of processes for comparison, then on 8 processes of which one fails midway
# (`--on-failure shrink`: the job shrinks to the 7 left and goes on). The launcher
# prints a table of the reconfigurations with their phase times; the three checksums
# must be equal.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p ductile-launcher -p ductile-suite --bins --examples
jacobi=(target/release/examples/jacobi --points 4194304 --iters 200 --every 25 "$@")
echo "== malleable run: 1 -> 2 -> 8 -> 4 -> 1 nodes of 2 slots"
target/release/ductile run --nodes 1 --slots 2 --max-nodes 8 --policy steps:2,8,4,1 -- "${jacobi[@]}" 2>&1 |
    tee /tmp/ductile-demo-$$.txt
echo "== rigid run: 2 processes"
target/release/ductile run -n 2 -- "${jacobi[@]}" 2>&1 | grep -v 'control socket' | tee -a /tmp/ductile-demo-$$.txt
echo "== a process fails: rank 5 of 8 exits at iteration 60; the job shrinks to 7 and goes on"
target/release/ductile run -n 8 --nodes 4 --on-failure shrink -- "${jacobi[@]}" --fail-at 5:60 2>&1 |
    grep -v 'control socket' | tee -a /tmp/ductile-demo-$$.txt
sums=$(grep -o 'checksum [0-9a-f]*' /tmp/ductile-demo-$$.txt | sort -u | wc -l)
rm -f /tmp/ductile-demo-$$.txt
if [ "$sums" = 1 ]; then
    echo "== checksums equal: the resizes moved every value exactly, and the job survived the failure"
else
    echo "== checksums differ" >&2
    exit 1
fi
