"""scripts/micro_batch_throughput.py at CI size: the rates it writes and the agreement it relies on
(the same steps at every micro-batch size), never the speed."""

from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path

import pytest
from transformers import AutoConfig

from diffdraft.target.loading import default_model_dir

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "micro_batch_throughput.py"


def load_script():
    spec = importlib.util.spec_from_file_location("micro_batch_throughput", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_tiny_run_writes_a_rate_per_micro_batch_and_the_same_losses_for_each(tmp_path, capsys):
    out = tmp_path / "rates.json"
    argv = ["--target", "tiny", "--micro", "1", "4", "--batch-size", "4", "--steps", "3", "--out", str(out)]
    rates = load_script().main(argv)
    record = json.loads(out.read_text())
    assert set(rates) == {1, 4}
    assert record["tokens_per_second_by_micro_batch"] == {str(k): v for k, v in rates.items()}
    assert all(rate > 0 for rate in rates.values())
    assert record["device_name"] == "cpu"
    losses = re.findall(r"losses (\[.*\])", capsys.readouterr().out)
    assert len(losses) == 2
    first, second = (json.loads(line) for line in losses)
    assert first == pytest.approx(second, rel=1e-3)  # a micro-batch splits a step, not its maths


@pytest.mark.real_model
def test_the_default_shape_is_the_default_targets_architecture():
    config = AutoConfig.from_pretrained(default_model_dir())
    for name, value in load_script().SMOLLM2_135M.items():
        expected = value if isinstance(value, dict) else pytest.approx(value)
        assert getattr(config, name, None) == expected, name
