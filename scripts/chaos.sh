#!/usr/bin/env bash
# Fault injection against the malleable demo, for developers (not part of the test
# suite): runs the jacobi example growing and shrinking on simulated local nodes under
# `--on-failure shrink` and SIGKILLs one of its processes at a random moment (a rank,
# or one time in four a node's agent); with `-m leaving`, a process as it leaves in a
# shrink. Every job must end before its --timeout (no hang), with the checksum of a
# fixed-size run if it ends well, and leave none of its processes and no shared-memory
# region behind. One line per job (and what the launcher said of a job slower than
# 25 s); exits 1 if any job broke a rule.
#
#   scripts/chaos.sh [-n JOBS] [-t tcp|quic|fabric] [-m random|leaving] [-d MAX_DELAY_S]
#
# It kills only processes of the jobs it started. It found two hangs so far (a process
# killed as it left in a shrink; a quic process leaving after a failure waited 5 s).
set -euo pipefail
cd "$(dirname "$0")/.."
jobs=10 transport=tcp mode=random max_delay=1.5
while getopts "n:t:m:d:" o; do
    case $o in
    n) jobs=$OPTARG ;;
    t) transport=$OPTARG ;;
    m) mode=$OPTARG ;;
    d) max_delay=$OPTARG ;;
    *) sed -n '2,11p' "$0" >&2; exit 2 ;;
    esac
done
features=()
[ "$transport" = tcp ] || features=(--features "$transport")
cargo build --release --quiet "${features[@]}" -p ductile-launcher -p ductile-suite --bins --examples
bin=target/release
jacobi=("$bin/examples/jacobi" --points 1048576 --iters 3000 --every 60)
ref=$("$bin/ductile" run -n 2 -- "${jacobi[@]}" 2>&1 | grep -o 'checksum [0-9a-f]*')
echo "fixed-size run: $ref"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
descendants() {
    local c
    for c in $(cat /proc/"$1"/task/*/children 2>/dev/null); do
        echo "$c"
        descendants "$c"
    done
}
bad=0
for i in $(seq "$jobs"); do
    log=$work/$i.log report=$work/$i.json
    start=$(date +%s%N)
    "$bin/ductile" run --nodes 1 --slots 2 --max-nodes 8 --policy steps:2,8,4,1,3,6,2,5 \
        --on-failure shrink --transport "$transport" --timeout 120 --report "$report" \
        -- "${jacobi[@]}" >"$log" 2>&1 &
    job=$!
    victim=none
    if [ "$mode" = leaving ]; then
        # A process of a node world the status shows leaving.
        id=
        for _ in $(seq 100); do
            id=$(grep -o 'job [0-9a-f]*' "$log" | head -1 | cut -d' ' -f2) && [ -n "$id" ] && break
            sleep 0.01
        done
        for _ in $(seq 1000); do
            agent=$("$bin/ductile" status "$id" 2>/dev/null | grep leaving | grep -o 'agent pid [0-9]*' |
                awk '{print $3}' | shuf -n1 || true)
            if [ -n "$agent" ]; then
                v=$(descendants "$agent" | shuf -n1)
                [ -n "$v" ] && kill -KILL "$v" 2>/dev/null && victim="leaving:$v" && break
            fi
            kill -0 "$job" 2>/dev/null || break
            sleep 0.005
        done
    else
        sleep "$(awk -v m="$max_delay" -v r="$RANDOM" 'BEGIN { printf "%.2f", 0.05 + (m - 0.05) * r / 32767 }')"
        ranks=() agents=()
        for p in $(descendants "$job"); do
            case "$(readlink /proc/"$p"/exe 2>/dev/null)" in
            */examples/jacobi) ranks+=("$p") ;;
            */ductile) agents+=("$p") ;;
            esac
        done
        if [ $((RANDOM % 4)) = 0 ] && [ ${#agents[@]} -gt 1 ]; then
            v=${agents[$((1 + RANDOM % (${#agents[@]} - 1)))]} kind=agent
        elif [ ${#ranks[@]} -gt 0 ]; then
            v=${ranks[$((RANDOM % ${#ranks[@]}))]} kind=rank
        else
            v= kind=
        fi
        [ -n "$v" ] && kill -KILL "$v" 2>/dev/null && victim="$kind:$v"
    fi
    rc=0
    wait "$job" || rc=$?
    took=$(( ($(date +%s%N) - start) / 1000000 ))
    sum=$(grep -o 'checksum [0-9a-f]*' "$log" | sort -u || true)
    verdict=ok
    if [ "$rc" = 124 ]; then verdict="HANG (ended by --timeout)"; fi
    if [ "$rc" = 0 ] && [ "$sum" != "$ref" ]; then verdict="WRONG ($sum)"; fi
    sleep 0.5
    if [ -f "$report" ]; then
        for p in $(grep -o '"agent_pid": *[0-9]*\|"pids": *\[[0-9, ]*\]' "$report" | grep -o '[0-9][0-9]*'); do
            if [ -d /proc/"$p" ] && ! grep -q '^State:.*Z' /proc/"$p"/status 2>/dev/null; then
                verdict="$verdict; process $p left"
            fi
            if compgen -G "/dev/shm/$p:*" >/dev/null; then verdict="$verdict; /dev/shm/$p:* left"; fi
        done
    else
        verdict="$verdict; no report"
    fi
    echo "job $i: $transport, killed $victim, exit $rc after $took ms: $verdict"
    if [ "$verdict" = ok ] && [ "$rc" != 0 ]; then
        # Why the job could not recover, as the launcher said it.
        grep -m1 'cannot recover' "$log" | sed 's/^/    /' || true
    fi
    if [ "$verdict" = ok ] && [ "$took" -gt 25000 ]; then
        # Slow (a wait ran out somewhere): what the launcher said.
        echo "    slow; the launcher said:"
        grep '^ductile:' "$log" | grep -v 'control socket\|reconfigurations of job' | tail -6 | sed 's/^/      /'
    fi
    if [ "$verdict" != ok ]; then
        bad=1
        sed 's/^/    /' "$log" | grep -v '^ *[0-9]* *\(grow\|shrink\) ' | tail -5
    fi
done
exit $bad
