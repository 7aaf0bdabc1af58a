#!/usr/bin/env bash
# Device side of a GPU lease (README.md beside this file): every `run` call that stage.py prints
# runs `bash scripts/gpu_lease/device.sh CALL`. Calls before the last only store their payload
# parts; the last rebuilds and checks the files, installs the wheels, and continues the shipped
# DFlare drafter on the packed data for LEASE_MINUTES, bringing back under $OUT: the trained drafter
# (bf16, refreshed from the checkpoints as they land), metrics.jsonl, held-out evals of the shipped
# and the new drafter, summary.json (tokens/s, the comparison) and log.txt. figures.sh, the call
# after it, measures issue 31's inference figures with the wheels this call installed.
#
# Knobs (environment): LEASE_MINUTES (training wall time, default 5), LEASE_BATCH (sequences per
# step, 64), LEASE_MICRO (per forward, 64), LEASE_LR (peak, 6e-4), LEASE_SEED (8), LEASE_INIT
# (drafter to continue, "default"), LEASE_DEVICE (cuda; cpu rehearses the call here, slowly).
set -uo pipefail
CALL=${1:?usage: bash scripts/gpu_lease/device.sh CALL}
LEASE=/tmp/diffdraft-lease
OUT=${OUT:-$LEASE/out}
export PYTHONUNBUFFERED=1
HERE=scripts/gpu_lease

python3 $HERE/payload.py receive "$CALL"
status=$?
[ $status -eq 10 ] && exit 0  # later calls bring the rest
[ $status -ne 0 ] && exit $status

mkdir -p "$OUT"
exec > >(tee "$OUT/log.txt") 2>&1
MINUTES=${LEASE_MINUTES:-5}
FILES=$LEASE/files
TARGET=$LEASE/target
python3 $HERE/payload.py assemble $FILES || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
  $FILES/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
if [ -f $FILES/default-drafter.safetensors ]; then  # untracked by stage.py --shrink-tree
  cp $FILES/default-drafter.safetensors src/diffdraft/default_drafter/model.safetensors
fi
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader 2>/dev/null
[ -f $TARGET/config.json ] || python3 $HERE/device.py convert $FILES/target.gguf $TARGET || exit 1

FIT=(python3 -m diffdraft.cli train fit --data $FILES/train.safetensors --target $TARGET
  --init-drafter "${LEASE_INIT:-default}" --held-out 0 --batch-size "${LEASE_BATCH:-64}"
  --micro-batch-size "${LEASE_MICRO:-64}" --learning-rate "${LEASE_LR:-6e-4}" --gamma-0 1.5
  --gamma-max 1.5 --seed "${LEASE_SEED:-8}" --labels target --dtype bfloat16 --compute-dtype bfloat16
  --device "${LEASE_DEVICE:-cuda}" --save-every 1000000)
rm -rf $LEASE/probe $LEASE/run
echo "== probe: 12 steps to measure tokens/s"
timeout 240 "${FIT[@]}" --output-dir $LEASE/probe --max-steps 12 || exit 1
STEPS=$(python3 $HERE/device.py steps $LEASE/probe "$MINUTES") || exit 1
echo "== training: $STEPS steps planned for $MINUTES minutes"
( while sleep 60; do python3 $HERE/device.py export $LEASE/run "$OUT/drafter"; done ) &
EXPORTER=$!
timeout $(((${MINUTES%.*} + 3) * 60)) "${FIT[@]}" --output-dir $LEASE/run --max-steps "$STEPS" \
  --max-minutes "$(python3 -c "print($MINUTES + 0.5)")" --save-every-minutes 2
kill $EXPORTER 2>/dev/null
wait $EXPORTER 2>/dev/null
python3 $HERE/device.py export $LEASE/run "$OUT/drafter" || exit 1
cp $LEASE/run/metrics.jsonl "$OUT/metrics.jsonl"

echo "== held-out eval (the model card's file and settings, float32 target on the GPU)"
EVAL=(python3 -m diffdraft.cli train eval --data benchmarks/drafter-ablation/heldout.jsonl --held-out 15
  --budgets 8 32 --max-new-tokens 32 --dtype float32 --max-length 512 --target $TARGET --device "${LEASE_DEVICE:-cuda}")
timeout 150 "${EVAL[@]}" --drafter default --out "$OUT/eval-shipped.json" > /dev/null
timeout 150 "${EVAL[@]}" --drafter "$OUT/drafter" --out "$OUT/eval-new.json" > /dev/null
python3 $HERE/device.py summary $LEASE/run $LEASE/probe "$OUT"
