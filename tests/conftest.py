"""Settings every test runs under. What tests share lives in :mod:`diffdraft_testing`, not here: a test
module imports nothing from conftest or from another test module."""

from __future__ import annotations

import torch

# Tiny models are dominated by per-op overhead: one thread is several times faster than two.
torch.set_num_threads(1)
