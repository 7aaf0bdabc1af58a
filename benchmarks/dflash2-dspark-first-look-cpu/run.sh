#!/bin/bash
# usage: run.sh VARIANT...  (from a folder holding replies.jsonl and heldout.jsonl)
# Trains, then evaluates, each variant in turn on one thread; this comparison ran two queues at once:
# `run.sh dflash2 dflash` and `run.sh dspark dflare`.
export OMP_NUM_THREADS=1
mkdir -p logs
for v in "$@"; do
  nice -n 19 diffdraft train fit --target default --variant "$v" --data replies.jsonl \
    --held-out 0 --output-dir "runs/$v" --dtype bfloat16 --compute-dtype bfloat16 --num-layers 2 \
    --block-size 8 --batch-size 2 --max-steps 200 --learning-rate 6e-4 --max-length 512 --seed 0 \
    --labels target --save-every 100 > "logs/fit-$v.log" 2>&1
  nice -n 19 diffdraft train eval --target default --data heldout.jsonl --held-out 15 \
    --drafter "runs/$v/final" --dtype float32 --budgets 8 32 --max-new-tokens 32 --out "eval-$v.json" \
    > "logs/eval-$v.log" 2>&1
done
