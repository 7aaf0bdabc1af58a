"""Progress bars for long jobs that stay readable when their output goes to a log file.

On a terminal tqdm redraws one line in place; redirected, every redraw becomes a new line (a
regeneration log once reached 11k lines). Off a terminal the bar is redrawn at most every
``LOG_INTERVAL_SECONDS`` instead, and postfix updates wait for that redraw (tqdm's
``set_postfix`` redraws at once by default, which bypassed the interval on every sample).
"""

from __future__ import annotations

import sys

from tqdm import tqdm

LOG_INTERVAL_SECONDS = 10.0


class _LogBar(tqdm):
    """A tqdm whose postfix updates show on the next timed redraw instead of forcing one."""

    def set_postfix(self, ordered_dict=None, refresh: bool = False, **kwargs) -> None:
        super().set_postfix(ordered_dict, refresh=refresh, **kwargs)

    def set_postfix_str(self, s: str = "", refresh: bool = False) -> None:
        super().set_postfix_str(s, refresh=refresh)


def progress_bar(iterable=None, **kwargs) -> tqdm:
    """``tqdm(iterable, **kwargs)``, redrawn at most every ``LOG_INTERVAL_SECONDS`` off a terminal."""
    stream = kwargs.get("file") or sys.stderr
    if hasattr(stream, "isatty") and stream.isatty():
        return tqdm(iterable, **kwargs)
    kwargs.setdefault("mininterval", LOG_INTERVAL_SECONDS)
    kwargs.setdefault("maxinterval", LOG_INTERVAL_SECONDS)
    return _LogBar(iterable, **kwargs)
