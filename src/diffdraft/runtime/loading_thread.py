"""A warning for CPU generation in another thread than the one that loaded the model.

PyTorch's CPU kernels run on GNU OpenMP, which keeps a pool of threads for every thread that ran a
parallel kernel. Once the pools' threads outnumber the cores, they sleep between kernels instead of
spinning, and each of a decoding round's hundreds of kernels waits for them to wake: on a 2-core CPU
a thread started after the load decoded far slower than the loading thread (docs/decisions.md,
"generate in the loading thread"). Nothing inside the
library can undo another thread's pool, so the user is told once, with the fix.
"""

from __future__ import annotations

import threading
import warnings

import torch

SLOW_THREAD_WARNING = (
    "diffdraft: this CPU model is generating in another thread than the one that loaded it, which "
    "runs several times slower (PyTorch's OpenMP thread pools then outnumber the cores and sleep "
    "between kernels). Generate in the loading thread, or hand requests to it: "
    "diffdraft.serve.scheduler.Scheduler.run() serves them there."
)


class LoadingThread:
    """The thread a model was loaded in (the one that makes this); :meth:`check` warns the first time
    another thread starts a sequence on it on a CPU (``generate``, ``stream``, their batch forms and a
    :meth:`~diffdraft.serve.scheduler.Scheduler.start` ed scheduler alike)."""

    def __init__(self, device: torch.device) -> None:
        self.ident = threading.get_ident()
        self.cpu = device.type == "cpu"
        self.warned = False

    def check(self) -> None:
        if self.warned or not self.cpu or threading.get_ident() == self.ident:
            return
        if torch.get_num_threads() < 2:
            return  # kernels run in the calling thread alone: no pool to wait for
        self.warned = True
        warnings.warn(SLOW_THREAD_WARNING, RuntimeWarning, stacklevel=2)
