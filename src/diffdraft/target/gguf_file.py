"""Telling a truncated or foreign ``.gguf`` file apart before anything loads it.

A download cut short or a file that is not a GGUF at all reached transformers' reader, which failed
with a ``struct.error`` traceback where the header was cut, or only after seconds of loading with a
reshape error where the tensor data was. Walking the header costs a fraction of a second (its
string arrays are skipped, not decoded; the tensor data is never read) and knows how many bytes
the tensors need, so a cut file is named as one, with the fix.

The walk only refuses what it is sure of: a file of another GGUF version or with a value or tensor
type it does not know passes, and the loader's own error names what it cannot read.
"""

from __future__ import annotations

import mmap
import struct
from math import prod
from pathlib import Path

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from diffdraft.errors import CheckpointError

MAGIC = b"GGUF"
HEADER_BYTES = 24
"""The magic, the version (u32) and the tensor and metadata counts (u64 each)."""
FIX = "download it again, or convert the model to GGUF again (llama.cpp's convert_hf_to_gguf.py)"
_VERSIONS = (2, 3)
"""The versions whose layout the walk knows (v1 counted in 32 bits; no file in use has it)."""
_SCALAR_BYTES = {0: 1, 1: 1, 7: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_ALIGNMENT_KEY = "general.alignment"
_DEFAULT_ALIGNMENT = 32


class _Unknown(Exception):
    """The header holds something this walk does not know: the loader decides."""


def check_gguf_file(path: Path) -> None:
    """Raise a :class:`CheckpointError` naming ``path`` when it is not a GGUF file, or is shorter than
    its own header says (cut off while downloading or copying); return quietly otherwise."""
    size = path.stat().st_size
    with path.open("rb") as file:
        magic = file.read(len(MAGIC))
        if size < HEADER_BYTES and MAGIC.startswith(magic):
            raise _truncated(path, f"it has {size} bytes, fewer than the {HEADER_BYTES} of a GGUF header")
        if magic != MAGIC:
            raise CheckpointError(f"{path} is not a GGUF file (it does not start with the bytes GGUF); {FIX}")
        with mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) as blob:
            try:
                end = _end_of_tensor_data(blob)
            except (struct.error, UnicodeDecodeError) as error:
                why = f"its header runs past the end of the file ({size} bytes)"
                raise _truncated(path, why, damaged=True) from error
            except _Unknown:
                return
    if end > size:
        raise _truncated(path, f"its tensors end at byte {end}, but the file has {size} bytes")


def _truncated(path: Path, why: str, damaged: bool = False) -> CheckpointError:
    state = "truncated or damaged" if damaged else "truncated"
    return CheckpointError(f"{path} is {state}: {why}; {FIX}")


def _end_of_tensor_data(blob: mmap.mmap) -> int:
    """Where the last tensor's bytes end, from the header alone."""
    version, tensor_count, metadata_count = struct.unpack_from("<IQQ", blob, len(MAGIC))
    if version not in _VERSIONS:
        raise _Unknown
    pos = HEADER_BYTES
    alignment = _DEFAULT_ALIGNMENT
    for _ in range(metadata_count):
        (length,) = struct.unpack_from("<Q", blob, pos)
        key = bytes(blob[pos + 8 : pos + 8 + length]).decode("utf-8")
        (value_type,) = struct.unpack_from("<I", blob, pos + 8 + length)
        pos = pos + 12 + length
        if key == _ALIGNMENT_KEY and value_type == 4:
            (alignment,) = struct.unpack_from("<I", blob, pos)
        pos = _skip_value(blob, pos, value_type)
    end = 0
    for _ in range(tensor_count):
        (length,) = struct.unpack_from("<Q", blob, pos)
        pos += 8 + length
        (dims,) = struct.unpack_from("<I", blob, pos)
        shape = struct.unpack_from(f"<{dims}Q", blob, pos + 4)
        ggml_type, offset = struct.unpack_from("<IQ", blob, pos + 4 + 8 * dims)
        pos += 16 + 8 * dims
        try:
            block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise _Unknown from None
        end = max(end, offset + prod(shape) // block * block_bytes)
    data_start = -(-pos // max(alignment, 1)) * max(alignment, 1)
    return data_start + end


def _skip_value(blob: mmap.mmap, pos: int, value_type: int) -> int:
    """The offset just past a metadata value of ``value_type`` at ``pos``."""
    if value_type in _SCALAR_BYTES:
        struct.unpack_from(f"<{_SCALAR_BYTES[value_type]}x", blob, pos)  # raises past the end
        return pos + _SCALAR_BYTES[value_type]
    if value_type == _STRING:
        (length,) = struct.unpack_from("<Q", blob, pos)
        return pos + 8 + length
    if value_type == _ARRAY:
        element_type, count = struct.unpack_from("<IQ", blob, pos)
        pos += 12
        if element_type in _SCALAR_BYTES:
            return pos + count * _SCALAR_BYTES[element_type]
        for _ in range(count):
            pos = _skip_value(blob, pos, element_type)
        return pos
    raise _Unknown
