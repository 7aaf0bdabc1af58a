"""Progress bars stay readable in log files."""

from __future__ import annotations

import io

from diffdraft.progress import LOG_INTERVAL_SECONDS, progress_bar


def test_off_a_terminal_the_bar_redraws_at_most_every_few_seconds():
    log = io.StringIO()
    bar = progress_bar(range(1000), file=log)
    assert bar.mininterval == LOG_INTERVAL_SECONDS
    for _ in bar:
        pass
    assert log.getvalue().count("\r") <= 3  # first draw, maybe one timed redraw, the final one


def test_on_a_terminal_tqdm_keeps_its_own_interval():
    class Terminal(io.StringIO):
        def isatty(self) -> bool:
            return True

    assert progress_bar(range(3), file=Terminal()).mininterval < LOG_INTERVAL_SECONDS
