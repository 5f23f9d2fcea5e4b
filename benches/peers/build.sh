#!/usr/bin/env bash
# Build the Open MPI comparison peers (benches/peers/pingpong.c, spawn.c, redist.c).
#
# If mpicc/mpirun are missing, installs Debian's openmpi-bin and
# libopenmpi-dev (root only). Output goes to ${OUT_DIR:-<repo>/target/peers}.
# Prints the path of each built binary, one per line: spawn, redist, then pingpong.
# The last line is always the pingpong path (backwards compatible).
set -euo pipefail

script_dir="$(cd -- "$(dirname -- "${BASH_SOURCE[0]}")" && pwd)"
repo_root="$(cd -- "${script_dir}/../.." && pwd)"
out_dir="${OUT_DIR:-${repo_root}/target/peers}"

if ! command -v mpicc >/dev/null 2>&1 || ! command -v mpirun >/dev/null 2>&1; then
    if [[ "$(id -u)" -ne 0 ]]; then
        echo "build.sh: mpicc/mpirun not found; install Open MPI first" \
             "(e.g. 'sudo apt-get install -y openmpi-bin libopenmpi-dev')" >&2
        exit 1
    fi
    echo "build.sh: mpicc/mpirun not found; installing openmpi-bin libopenmpi-dev" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update >&2
    apt-get install -y openmpi-bin libopenmpi-dev >&2
fi

mkdir -p -- "${out_dir}"
for peer in spawn redist pingpong; do
    mpicc -std=c11 -O2 -Wall -Wextra -o "${out_dir}/${peer}" \
        "${script_dir}/${peer}.c" >&2
done
# pingpong must stay the last line: callers take the last line as its path.
echo "${out_dir}/spawn"
echo "${out_dir}/redist"
echo "${out_dir}/pingpong"
