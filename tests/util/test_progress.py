"""Progress bars stay readable in log files."""

from __future__ import annotations

import io

from diffdraft.util.progress import LOG_INTERVAL_SECONDS, progress_bar


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


def test_off_a_terminal_postfix_updates_wait_for_the_timed_redraw():
    log = io.StringIO()
    with progress_bar(total=1000, file=log) as bar:
        for step in range(1000):
            bar.update(1)
            bar.set_postfix_str(f"{step} tok/s")
            bar.set_postfix(loss=step)
    assert log.getvalue().count("\r") <= 3
