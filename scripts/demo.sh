#!/usr/bin/env bash
# The main demo: an allreduce across 8 ranks on 4 simulated local nodes.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release --quiet -p ductile-launcher -p ductile-suite --bins --examples
exec target/release/ductile run -n 8 --nodes 4 --tag-output -- target/release/examples/allreduce "$@"
