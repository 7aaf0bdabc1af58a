"""diffdraft: lossless speculative decoding with one-pass parallel drafters and optimal draft trees."""

from diffdraft.errors import CheckpointError, DiffdraftError, IncompatibleDrafterError, InvalidRequestError
from diffdraft.generator import (
    GenerationChunk,
    GenerationRequest,
    GenerationResult,
    SpeculativeGenerator,
    load,
)
from diffdraft.logprobs import TokenLogprob
from diffdraft.method_table import METHODS
from diffdraft.sampling import SamplingParams
from diffdraft.stats import GenerationStats

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
