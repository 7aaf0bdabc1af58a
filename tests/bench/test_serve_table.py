"""The pure parts of ``benchmarks/vllm-serving/serve_table.py``: a server's error line, vLLM's
counters, the resume check and the table."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "vllm-serving" / "serve_table.py"


def load_script():
    spec = importlib.util.spec_from_file_location("serve_table", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


serve_table = load_script()


def test_error_line_prefers_the_exception_then_error_lines():
    log = (
        "INFO starting\n"
        "(EngineCore pid=1) ERROR 12-07 11:00:00 [core.py:1] EngineCore failed to start.\n"
        "Traceback (most recent call last):\n"
        '  File "x.py", line 1, in <module>\n'
        "(EngineCore pid=1) ValueError: DFlash needs an attention backend with non-causal attention\n"
        "INFO shutting down\n"
    )
    assert serve_table.error_line(log).endswith(
        "ValueError: DFlash needs an attention backend with non-causal attention"
    )
    assert serve_table.error_line("a\nERROR: port in use\nbye\n") == "ERROR: port in use"
    assert serve_table.error_line("only this\n") == "only this"
    assert serve_table.error_line("") == "(the log is empty)"


def test_acceptance_length_from_vllm_counters():
    text = (
        "# TYPE vllm:spec_decode_num_drafts counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0"} 10.0\n'
        'vllm:spec_decode_num_drafts_created{engine="0"} 1.79e+09\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0"} 7.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",position="0"} 5.0\n'
    )
    after = serve_table.parse_counters(text)
    assert after == {"vllm:spec_decode_num_drafts": 10.0, "vllm:spec_decode_num_accepted_tokens": 7.0}
    before = {"vllm:spec_decode_num_drafts": 6.0, "vllm:spec_decode_num_accepted_tokens": 1.0}
    assert serve_table.acceptance_length(before, after) == 1 + 6 / 4
    assert serve_table.acceptance_length(after, after) is None


def cell(tok_s: float, ttft: float | None) -> dict:
    return {"requests": 2, "prompt_tokens": 72, "output_tokens_per_second": tok_s, "ttft_p50": ttft}


def test_table_marks_failed_and_missing_cells():
    results = {
        "settings": {"clients": [1, 4], "servers": ["vllm-dflash", "diffdraft-chain"]},
        "cells": {
            "vllm-dflash/1": {"error": "exited with code 1", "server_failed": True},
            "diffdraft-chain/1": cell(12.34, 0.1456),
        },
    }
    assert serve_table.table(results) == [
        "| server | 1 client | 4 clients |",
        "|---|---|---|",
        "| vLLM, dflash (default-dflash) | failed | not run |",
        "| diffdraft serve, chain (default-dflash) | 12.3 tok/s, 146 ms | not run |",
    ]


def test_resume_keeps_finished_cells_of_the_same_settings(tmp_path):
    measured = {
        "clients": [1],
        "requests_per_client": 1,
        "threads": 2,
        "max_tokens": 64,
        "vllm_compile": False,
        "iomp": True,
    }
    cells = {"diffdraft-ar/1": cell(8.0, 0.3), "vllm-plain/1": {"error": "exited with code 1"}}
    path = tmp_path / "serve-table.json"
    path.write_text(json.dumps({"settings": measured | {"date": "then"}, "cells": cells}))
    assert serve_table.previous_cells(path, measured) == {"diffdraft-ar/1": cells["diffdraft-ar/1"]}
    assert serve_table.previous_cells(path, measured | {"threads": 1}) == {}
    assert serve_table.previous_cells(tmp_path / "none.json", measured) == {}
