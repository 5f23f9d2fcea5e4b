#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, build (examples and benches
# included), unit, property and multi-process integration tests.
#
# System packages: the tests need only the Rust toolchain so far. Packages that later
# tests need (e.g. libfabric-dev) are installed here with apt-get when running as root.
set -euo pipefail
cd "$(dirname "$0")/.."

need_rust_component() {
    if ! cargo "$1" --version >/dev/null 2>&1; then
        echo "== installing rustup component $2"
        rustup component add "$2"
    fi
}
need_rust_component fmt rustfmt
need_rust_component clippy clippy

echo "== cargo fmt --check"
cargo fmt --all --check
echo "== cargo clippy"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== build (binaries, examples, tests)"
cargo build --workspace --all-targets --locked
echo "== tests"
cargo test --workspace --locked
echo "== benches compile"
cargo bench --workspace --locked --no-run
