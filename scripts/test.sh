#!/usr/bin/env bash
# The whole test suite, as CI runs it: formatting, lints, build (examples and benches
# included), unit, property and multi-process integration tests.
#
# Transports built and tested: tcp, quic and fabric. The fabric backend needs Debian's
# libfabric-dev (and libclang-dev for bindgen), its shm/tcp providers come with
# libfabric, and the transport bench runs libfabric-bin's fi_pingpong; they are
# installed here with apt-get when missing. Without root the script stops and says so,
# rather than skipping anything.
#
# Everything is built with every feature, so the conformance suite runs over tcp, quic,
# fabric(tcp;ofi_rxm) and fabric(shm), and the launcher tests run the examples over each
# transport. libfabric is loaded only by processes that open a fabric endpoint.
set -euo pipefail
cd "$(dirname "$0")/.."

# iproute2 makes the test hosts (network namespaces) of tests/hosts.rs, and
# openssh-server/-client run jobs across them over real ssh.
PACKAGES=(libfabric-dev libclang-dev libfabric-bin pkg-config iproute2 openssh-server openssh-client)
missing=()
for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
    if [ "$(id -u)" != 0 ]; then
        echo "== ERROR: the tests need these Debian packages: ${missing[*]} (run as root to install them)" >&2
        exit 1
    fi
    echo "== installing ${missing[*]}"
    # Installing openssh-server must not start an sshd on this machine: the tests
    # start their own, inside their test hosts. Debian's policy-rc.d hook says so for
    # the time of the install, unless the machine already has one.
    own_policy=""
    if [ ! -e /usr/sbin/policy-rc.d ]; then
        printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d
        chmod 755 /usr/sbin/policy-rc.d
        own_policy=1
    fi
    installed=1
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${missing[@]}" >/dev/null || installed=""
    if [ -n "$own_policy" ]; then
        rm -f /usr/sbin/policy-rc.d
    fi
    if [ -z "$installed" ]; then
        echo "== ERROR: installing ${missing[*]} failed" >&2
        exit 1
    fi
fi

# The transports beyond tcp, for every package that binds or names them.
FEATURES=(--all-features)

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
cargo clippy --workspace --all-targets --locked --all-features -- -D warnings
# A plain `cargo build` (tcp only, no C dependency) must keep working too.
echo "== cargo clippy, default features only"
cargo clippy --workspace --all-targets --locked -- -D warnings
echo "== cargo doc (every library's documentation, links checked)"
RUSTDOCFLAGS="-D warnings" cargo doc --no-deps --workspace --all-features --lib --locked
echo "== build (binaries, examples, tests)"
cargo build --workspace --all-targets --locked "${FEATURES[@]}"
echo "== tests"
# The multi-host tests need root, iproute2 and sshd, all installed above: they must
# run, not skip.
export DUCTILE_TEST_REQUIRE_HOSTS=1
cargo test --workspace --locked "${FEATURES[@]}"
# Over shm, large messages go as bulk payloads only when they fan out (see the fabric
# backend's `Bulk`); the conformance suite's pairs read them. Its second pass sends
# every large message as bulk, on both providers where possible.
echo "== conformance suite, every large fabric message as a bulk payload"
DUCTILE_FABRIC_BULK=always cargo test -p ductile-transport --locked "${FEATURES[@]}" --test conformance fabric
# Over shm, readers copy a peer's memory themselves (the fabric backend's `direct`);
# a third pass keeps the provider's own reads (`fi_read`) covered there.
echo "== conformance suite over shm, reading with fi_read instead of direct copies"
DUCTILE_FABRIC_DIRECT=never cargo test -p ductile-transport --locked "${FEATURES[@]}" --test conformance fabric_shm
echo "== benches compile"
cargo bench --workspace --locked --no-run "${FEATURES[@]}"
