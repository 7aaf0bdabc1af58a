"""Dense copies of a quantized GGUF: the same numbers our bf16 / f32 targets hold, metadata kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from diffdraft.bench.gguf_precision import dense_gguf
from diffdraft.errors import CheckpointError


def quantized_gguf(path: Path) -> Path:
    """A small Q4_1 GGUF: one matrix, one norm vector, a string list and a number of metadata."""
    rng = np.random.default_rng(0)
    writer = GGUFWriter(path, "llama")
    writer.add_block_count(1)
    writer.add_file_type(LlamaFileType.MOSTLY_Q4_1)
    writer.add_token_list(["<s>", "a", "b"])
    matrix = rng.standard_normal((8, 64)).astype(np.float32)
    writer.add_tensor(
        "blk.0.ffn_up.weight",
        quantize(matrix, GGMLQuantizationType.Q4_1),
        raw_dtype=GGMLQuantizationType.Q4_1,
    )
    writer.add_tensor("blk.0.ffn_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("precision", ["bf16", "f32"])
def test_dense_copy_holds_the_dequantized_weights(tmp_path: Path, precision: str) -> None:
    source = quantized_gguf(tmp_path / "model.Q4_1.gguf")
    dense = dense_gguf(source, precision, cache_dir=tmp_path / "cache")
    original, copy = GGUFReader(source), GGUFReader(dense)
    tensors = {t.name: t for t in copy.tensors}
    matrix = next(t for t in original.tensors if t.name == "blk.0.ffn_up.weight")
    expected = torch.from_numpy(dequantize(matrix.data, matrix.tensor_type).copy())
    written = tensors["blk.0.ffn_up.weight"]
    if precision == "bf16":
        assert written.tensor_type == GGMLQuantizationType.BF16
        values = torch.from_numpy(written.data.copy().view(np.int16)).view(torch.bfloat16).reshape(8, 64)
        assert torch.equal(values, expected.to(torch.bfloat16))  # torch's rounding, bit for bit
    else:
        assert written.tensor_type == GGMLQuantizationType.F32
        assert torch.equal(torch.from_numpy(written.data.copy()).reshape(8, 64), expected)
    assert tensors["blk.0.ffn_norm.weight"].tensor_type == GGMLQuantizationType.F32  # vectors stay f32
    assert copy.fields["tokenizer.ggml.tokens"].contents() == ["<s>", "a", "b"]
    assert copy.fields["llama.block_count"].contents() == 1
    expected_type = LlamaFileType.MOSTLY_BF16 if precision == "bf16" else LlamaFileType.ALL_F32
    assert copy.fields["general.file_type"].contents() == expected_type


def test_dense_copy_is_written_once(tmp_path: Path) -> None:
    source = quantized_gguf(tmp_path / "model.gguf")
    first = dense_gguf(source, "bf16", cache_dir=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert dense_gguf(source, "bf16", cache_dir=tmp_path) == first
    assert first.stat().st_mtime_ns == stamp
    assert not list(tmp_path.glob(".*partial"))


def test_bad_inputs_name_the_fix(tmp_path: Path) -> None:
    source = quantized_gguf(tmp_path / "model.gguf")
    with pytest.raises(CheckpointError, match="choose one of bf16, f32"):
        dense_gguf(source, "q8", cache_dir=tmp_path)
    corrupt = tmp_path / "corrupt.gguf"
    corrupt.write_bytes(b"not a gguf" * 20)
    with pytest.raises(CheckpointError, match=r"intact \.gguf"):
        dense_gguf(corrupt, "bf16", cache_dir=tmp_path / "cache")
    assert not list((tmp_path / "cache").glob("*"))  # nothing half-written left behind


def test_a_damaged_or_unsealed_dense_copy_is_written_again(tmp_path: Path, capsys) -> None:
    source = quantized_gguf(tmp_path / "model.gguf")
    first = dense_gguf(source, "bf16", cache_dir=tmp_path / "cache")
    clean = first.read_bytes()
    first.write_bytes(clean[:-8] + bytes(8))  # the last tensor's bytes zeroed
    capsys.readouterr()
    assert dense_gguf(source, "bf16", cache_dir=tmp_path / "cache").read_bytes() == clean
    assert f"failed its check ({first.name} digest mismatch); writing it again" in capsys.readouterr().err
    first.with_name(f"{first.name}.manifest").unlink()  # killed after the rename, before its manifest
    assert dense_gguf(source, "bf16", cache_dir=tmp_path / "cache").read_bytes() == clean
    assert "failed its check (no manifest" in capsys.readouterr().err
