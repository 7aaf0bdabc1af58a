"""Drafters: sources of draft tokens. See :mod:`diffdraft.drafters.base` for the interface."""

from diffdraft.drafters.base import Drafter, Proposal

__all__ = ["Drafter", "Proposal"]
