"""A cut or foreign .gguf file is named as one from its header alone; an intact one passes."""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter, quants

from diffdraft.errors import CheckpointError
from diffdraft.target.gguf_file import FIX, check_gguf_file


def write_gguf(path: Path, alignment: int = 64) -> Path:
    """A small GGUF with every kind of header entry the walk skips: scalars, strings, a string array
    (a vocabulary), a number array, a non-default alignment, and a dense and a block tensor."""
    writer = GGUFWriter(str(path), "llama")
    writer.add_custom_alignment(alignment)
    writer.add_token_list(["<s>", "hello", "wörld"])
    writer.add_array("llama.rope.sections", [1, 2, 3])
    writer.add_float32("llama.rope.freq_base", 10000.0)
    writer.add_tensor("token_embd.weight", np.arange(3 * 32, dtype=np.float32).reshape(3, 32))
    weights = np.linspace(-1, 1, 2 * 64, dtype=np.float32).reshape(2, 64)
    raw = quants.quantize(weights, GGMLQuantizationType.Q8_0)
    writer.add_tensor("output.weight", raw, raw_dtype=GGMLQuantizationType.Q8_0)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_an_intact_file_passes_and_every_cut_into_its_data_is_named_truncated(tmp_path):
    path = write_gguf(tmp_path / "model.gguf")
    whole = path.read_bytes()
    check_gguf_file(path)
    data_end = max(t.data_offset + t.n_bytes for t in GGUFReader(path).tensors)
    assert data_end < len(whole)  # the writer pads the last tensor: losing only padding loses nothing
    cut = tmp_path / "cut.gguf"
    for length in range(data_end, len(whole)):
        cut.write_bytes(whole[:length])
        check_gguf_file(cut)
    for length in range(data_end):
        cut.write_bytes(whole[:length])
        with pytest.raises(CheckpointError) as info:
            check_gguf_file(cut)
        message = str(info.value)
        assert message.startswith(f"{cut} is truncated") and message.endswith(FIX), (length, message)
        assert "\n" not in message


def test_a_file_that_is_not_a_gguf_says_so(tmp_path):
    other = tmp_path / "model.gguf"
    other.write_bytes(b"PK\x03\x04 a zip archive, not a model" * 4)
    with pytest.raises(CheckpointError, match=f"{other} is not a GGUF file .*download it again"):
        check_gguf_file(other)


def test_a_version_the_walk_does_not_know_is_left_to_the_loader(tmp_path):
    path = write_gguf(tmp_path / "model.gguf")
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 1)  # v1 counted in 32 bits: its header reads differently
    path.write_bytes(bytes(data[:200]))
    check_gguf_file(path)  # no claim the walk cannot back
