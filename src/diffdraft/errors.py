"""Errors users can act on. Each message names the problem and the fix."""


class DiffdraftError(Exception):
    """Base class for every error diffdraft raises on purpose."""


class InvalidRequestError(DiffdraftError, ValueError):
    """A generation request is malformed (bad sampling parameters, prompt too long, bad messages)."""


class CheckpointError(DiffdraftError):
    """A model or drafter checkpoint is missing, corrupt or in an unknown layout."""


class IncompatibleDrafterError(DiffdraftError):
    """A drafter does not fit its target (hidden size, vocabulary, layer ids)."""


class UnsupportedModelError(DiffdraftError):
    """The target uses an architecture feature speculative verification cannot reproduce exactly."""


class TrainingDivergedError(DiffdraftError):
    """Drafter training produced a non-finite loss; the last checkpoint is intact and resumable."""


class ExportError(DiffdraftError):
    """A drafter cannot be exported for a serving engine: the engine cannot run one of its features."""
