"""A GGUF file rewritten with dense weights: the same model at another precision, for llama.cpp rows.

A quantized GGUF (the default target ships as Q4_1) dequantizes to exactly the float32 weights our
targets load. Comparing engines "at the same precision" needs llama.cpp to run those weights too:
this writes them as a bfloat16 (or float32) GGUF, rounding each float32 value to the nearest bfloat16
as ``torch.Tensor.to(torch.bfloat16)`` does, so llama.cpp's bf16 file and our bf16 target hold the same
numbers. Metadata is copied unchanged but for the file type; 1-D tensors (norms) stay float32, as
llama.cpp's converters write them.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

from diffdraft.errors import CheckpointError
from diffdraft.util.cache import cache_root
from diffdraft.util.cache_digest import intact, sealed_file

DENSE_TYPES = {
    "bf16": (GGMLQuantizationType.BF16, LlamaFileType.MOSTLY_BF16),
    "f32": (GGMLQuantizationType.F32, LlamaFileType.ALL_F32),
}
"""Precisions a dense copy can have: name -> (tensor type of the matrices, file type recorded)."""
_WRITER_KEYS = ("GGUF.", "general.architecture", "general.file_type")
"""Keys the writer sets itself (or that this module rewrites)."""


def dense_gguf(source: str | os.PathLike, precision: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """``source`` as a dense GGUF of ``precision`` (one of :data:`DENSE_TYPES`), written once into
    ``cache_dir`` (default: diffdraft's cache) and reused while its digest matches; written to a
    temporary name first and sealed (:func:`diffdraft.util.cache_digest.sealed_file`), so a killed run
    or a damaged copy is written again, never used."""
    if precision not in DENSE_TYPES:
        raise CheckpointError(
            f"no dense GGUF precision {precision!r}: choose one of {', '.join(DENSE_TYPES)}"
        )
    source = Path(source)
    stat = source.stat()
    folder = Path(cache_dir) if cache_dir is not None else cache_root() / "gguf"
    # the source's size and mtime in the name: a changed source gets a fresh copy
    dest = folder / f"{source.stem}.{stat.st_size}-{int(stat.st_mtime)}.{precision}.gguf"
    if intact(dest, f"the cached {precision} copy of {source.name}", "writing it again"):
        return dest
    with sealed_file(dest) as written:
        write_dense_gguf(source, written, precision)
    return dest


def write_dense_gguf(source: Path, dest: Path, precision: str) -> None:
    """Write ``source``'s model to ``dest`` with every matrix dequantized to ``precision``."""
    try:
        reader = GGUFReader(source)
        architecture = reader.fields["general.architecture"].contents()
    except (ValueError, KeyError, OSError) as error:
        raise CheckpointError(
            f"{source}: cannot read this GGUF file ({error}); pass an intact .gguf model file"
        ) from error
    tensor_type, file_type = DENSE_TYPES[precision]
    writer = GGUFWriter(dest, architecture)
    for name, field in reader.fields.items():
        if name.startswith(_WRITER_KEYS):
            continue
        value_type = field.types[0]
        sub_type = field.types[-1] if value_type == GGUFValueType.ARRAY else None
        writer.add_key_value(name, field.contents(), value_type, sub_type)
    writer.add_file_type(file_type)
    for tensor in reader.tensors:
        weights = dequantize(tensor.data, tensor.tensor_type).astype(np.float32, copy=False)
        if weights.ndim < 2 or tensor_type == GGMLQuantizationType.F32:
            writer.add_tensor(tensor.name, weights)
        else:
            writer.add_tensor(tensor.name, quantize(weights, tensor_type), raw_dtype=tensor_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
