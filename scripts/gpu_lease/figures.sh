#!/usr/bin/env bash
# The lease's call after training (README.md beside this file): issue 31's GPU figures, with the wheels
# device.sh's last call installed in /tmp/site (transformers, dflash). Brings back $OUT/bench.tar.gz:
# the synthetic round benchmark on Qwen3-8B's shape with random weights, verification graphed, each
# beside the official dflash loop on the same weights, once with torch's choice of attention backend
# and once without cuDNN's (on the 2026-11-27 H100 lease the drafter's stage took 9-10 ms in some
# methods and 33-84 ms in others at the same context: per-shape cuDNN plans are the suspect), and
# the trainer's throughput on the default target's shape with random data. A separate call so that
# the training call's ten-minute limit holds the training, and so that a failure here costs no
# drafter. About 3 minutes.
set -uo pipefail
LEASE=/tmp/diffdraft-lease
OUT=${OUT:-$LEASE/out}
export PYTHONUNBUFFERED=1 PYTHONPATH=/tmp/site:$PWD/src
[ -d /tmp/site/dflash ] || { echo "figures: no wheels in /tmp/site; run the lease's training call first"; exit 1; }
BENCH=$LEASE/bench
rm -rf $BENCH && mkdir -p $BENCH "$OUT"
SYNTH=(python3 scripts/synthetic_round_bench.py --device cuda --shape qwen3-8b)
timeout 150 "${SYNTH[@]}" --budgets 8,16,32 --repeats 2 --cuda-graphs --out $BENCH/8b-random-graphs
timeout 150 "${SYNTH[@]}" --budgets 8,16,32 --repeats 2 --cuda-graphs \
  --sdpa-backends flash_attention,efficient_attention,math --out $BENCH/8b-random-graphs-no-cudnn
timeout 100 python3 scripts/micro_batch_throughput.py --target default-shape --device cuda --batch-size 128 \
  --micro 64 128 64 --steps 24 --out $BENCH/trainer-b128-micro64-128-64.json
tar czf "$OUT/bench.tar.gz" -C $LEASE bench
