"""Stage timers: wall time per stage, split among the sequences that shared it, and profiler ranges
only while a profiler records."""

from __future__ import annotations

import time

import torch

from diffdraft.runtime.stats import GenerationStats, StageTimer


def test_a_shared_stage_is_split_evenly_and_named_in_a_profile():
    together = [GenerationStats(), GenerationStats()]
    timer = StageTimer(together, torch.device("cpu"))
    with timer("draft"):
        time.sleep(0.01)
    assert timer.last >= 0.01
    assert all(s.timings["draft"] == timer.last / 2 for s in together)
    with torch.profiler.profile() as profile, timer("verify"):
        torch.ones(4).sum()
    assert "diffdraft.verify" in {event.name for event in profile.events()}
    assert all(s.timings["verify"] > 0 for s in together)
