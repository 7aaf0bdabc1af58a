"""``diffdraft bench``: every method on the same target and prompts, timed, lossless-checked, reported.

datasets -> methods (a registry of named runners) -> runner (interleaved, warmed-up timing) ->
lossless (divergences explained in float32) -> summary -> report (results.json, report.md, PNGs).
cost_model measures the target's verification cost curve and picks the DDTree budget (``auto``).
"""
