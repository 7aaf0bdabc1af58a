#!/usr/bin/env bash
# Serve-load rows (issue 32): four servers up at once on the default target (ar, ddtree:auto,
# ddtree+pld:auto and the fixed budget FIXED, default ddtree+pld:6: the best fixed one at batch 1
# in the batch benches, as the bar weighs the auto against the better of ar and it), each
# warmed up, then for every client count 1-8 and each of PASSES passes the four are loaded one
# after another, so drift of this shared machine hits every method alike, the one to go first
# rotating from pass to pass (no method always runs right after another's load).
# CLIENTS picks the client counts (default: 1-8). Writes <method>-c<clients>-p<pass>.json to $OUT
# (default: here); summarize with summary.py $OUT (--plot PNG also draws it).
# PER_CLIENT requests a client a load (default 18): loads of 2-3 s (8 a client) swung +-15% on a
# shared 2-core machine, so more passes of shorter loads measured worse than fewer long ones.
set -euo pipefail
OUT=${OUT:-$(dirname "$0")}
mkdir -p "$OUT"
cd "$OUT"
PASSES=${PASSES:-2}
PER_CLIENT=${PER_CLIENT:-18}
CLIENTS=${CLIENTS:-1 2 3 4 5 6 7 8}  # the client counts to load, in order
FIXED=${FIXED:-6}  # the fixed ddtree+pld budget beside the autos
fixed=ddtree+pld-$FIXED
declare -A PORT=([ar]=8013 [ddtree-auto]=8014 [ddtree+pld-auto]=8015 [$fixed]=8016)
declare -A ARGS=([ar]="--method ar" [ddtree-auto]="--method ddtree --budget auto"
                 [ddtree+pld-auto]="--method ddtree+pld --budget auto" [$fixed]="--method ddtree+pld --budget $FIXED")
methods=(ar ddtree-auto ddtree+pld-auto "$fixed")
pids=()
trap 'kill "${pids[@]}" 2>/dev/null || true' EXIT
for m in "${methods[@]}"; do
  # one at a time: an auto server measures (or spot-checks) the batch cost curve before it serves,
  # and two measuring at once would each time the other's load
  # shellcheck disable=SC2086
  diffdraft serve --target default ${ARGS[$m]} --dtype bfloat16 --port "${PORT[$m]}" --max-batch-size 8 \
    > "server-$m.log" 2>&1 &
  pids+=($!)
  until curl -sf "http://127.0.0.1:${PORT[$m]}/v1/models" > /dev/null; do sleep 2; done
done
load() {  # method clients requests json
  diffdraft serve-load --url "http://127.0.0.1:${PORT[$1]}" --concurrency "$2" --requests "$3" \
    --max-tokens 64 --ignore-eos --stream --json "$4" > /dev/null
}
for m in "${methods[@]}"; do load "$m" 8 32 /dev/null; done  # warm-up, not kept
first=0
for c in $CLIENTS; do
  for p in $(seq 1 "$PASSES"); do
    for k in "${!methods[@]}"; do
      m=${methods[$(((first + k) % ${#methods[@]}))]}
      load "$m" "$c" $((PER_CLIENT * c)) "$m-c$c-p$p.json"
      echo "$(date +%T) $m clients $c pass $p"
    done
    first=$(((first + 1) % ${#methods[@]}))
  done
done
