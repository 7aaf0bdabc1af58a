"""``diffdraft bench``: every method on the same target and prompts, timed, lossless-checked, reported.

datasets -> methods (a registry of named runners) -> runner (interleaved, warmed-up timing) ->
lossless (divergences explained in float32) -> summary -> report (results.json, report.md, PNGs).
The verification cost curve and the ``auto`` budget live in :mod:`diffdraft.budget` (core uses them).
"""
