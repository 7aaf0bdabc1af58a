"""Skip markers for tests of kernels that need an instruction set this CPU may lack."""

from __future__ import annotations

import pytest
import torch

from diffdraft.kernels.packed_linear import packing_supported
from diffdraft.kernels.quantized.kernel_build import cpu_supported

needs_packing = pytest.mark.skipif(
    not packing_supported(torch.bfloat16, torch.device("cpu")), reason="no oneDNN bfloat16 on this CPU"
)
"""For tests of diffdraft's packed CPU kernels."""


needs_block_kernel = pytest.mark.skipif(not cpu_supported(), reason="no AVX2 on this CPU")
"""For tests of the Q4_1 kernel (:mod:`diffdraft.kernels.quantized`)."""
