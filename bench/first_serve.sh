#!/usr/bin/env bash
# The first `make serve` on a fresh clone, timed: clone this checkout into a temporary folder,
# run `make serve` with an empty cache and pip's cache off, and report when the sidecar reported
# SERVING and when it started serving the distilled head built in the background. Nothing else
# should run on the machine meanwhile. Usage: bench/first_serve.sh [repository] (default: .)
set -euo pipefail
repo=$(cd "${1:-.}" && pwd)
work=$(mktemp -d /tmp/limelight-first-serve.XXXX)
git clone -q "$repo" "$work/repo"
cd "$work/repo"
export LIMELIGHT_CACHE_DIR="$work/cache" PIP_NO_CACHE_DIR=1
start=$(date +%s)
# Every line of `make serve` with the seconds since the start in front. `setsid`: make, the
# sidecar and its background build form one process group, stopped together at the end.
setsid make serve > >(python3 -u -c '
import sys, time
t0 = float(sys.argv[1])
for line in sys.stdin:
    print("%7.1f %s" % (time.time() - t0, line.rstrip()[-300:]), flush=True)
' "$start" > "$work/serve.log") 2>&1 &
group=$!
trap 'kill -INT -- -"$group" 2> /dev/null || true' EXIT
echo "log: $work/serve.log" >&2
until grep -q "default inline method is distilled" "$work/serve.log"; do
    if ! kill -0 "$group" 2> /dev/null; then
        echo "make serve stopped before serving the head (log: $work/serve.log)" >&2; exit 1
    fi
    sleep 5
done
minutes() { awk -v s="$1" 'BEGIN { printf "%.1f", s / 60 }'; }
installed=$(grep -m1 "limelight serve" "$work/serve.log" | awk '{print $1}')
serving=$(grep -m1 "SERVING" "$work/serve.log" | awk '{print $1}')
head=$(grep -m1 "default inline method is distilled" "$work/serve.log" | awk '{print $1}')
echo "install $(minutes "$installed") min, SERVING after $(minutes "$serving") min, distilled head served after $(minutes "$head") min"
card=$(ls "$work"/cache/models/*/limelight_distilled/card.json)
python3 -c '
import json, sys
t = json.load(open(sys.argv[1]))["training"]
print("head: labels %.1f min, training %.1f min" % (t["label_seconds"] / 60, t["seconds"] / 60))
' "$card"
