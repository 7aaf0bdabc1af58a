"""Progress bars for long jobs that stay readable when their output goes to a log file.

On a terminal tqdm redraws one line in place; redirected, every redraw becomes a new line (a
regeneration log once reached 11k lines). Off a terminal the bar is redrawn at most every
``LOG_INTERVAL_SECONDS`` instead.
"""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_SECONDS = 10.0


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``, redrawn at most every ``LOG_INTERVAL_SECONDS`` off a terminal."""
    stream = kwargs.get("file") or sys.stderr
    if not (hasattr(stream, "isatty") and stream.isatty()):
        kwargs.setdefault("mininterval", LOG_INTERVAL_SECONDS)
        kwargs.setdefault("maxinterval", LOG_INTERVAL_SECONDS)
    return tqdm(iterable, **kwargs)
