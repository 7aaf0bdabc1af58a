"""diffdraft: lossless speculative decoding with one-pass parallel drafters and optimal draft trees."""

from diffdraft.decoding.method_table import METHODS
from diffdraft.errors import CheckpointError, DiffdraftError, IncompatibleDrafterError, InvalidRequestError
from diffdraft.generator import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculativeGenerator,
    load,
)
from diffdraft.runtime.logprobs import TokenLogprob
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats

__all__ = [
    "METHODS",
    "CheckpointError",
    "DiffdraftError",
    "GenerationChunk",
    "GenerationRequest",
    "GenerationResult",
    "GenerationStats",
    "IncompatibleDrafterError",
    "InvalidRequestError",
    "SamplingParams",
    "SpeculativeGenerator",
    "TokenLogprob",
    "load",
]
__version__ = "0.1.0"
