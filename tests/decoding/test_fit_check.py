"""A drafter that does not fit its target is reported once, early; a fitting one and prompt lookup never."""

from __future__ import annotations

import torch

from diffdraft.decoding.fit_check import JUDGED_ROUNDS
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder

from diffdraft_testing.drafters import tiny_drafter
from diffdraft_testing.engine import OracleDrafter, run_engine
from diffdraft_testing.targets import hf_greedy, tiny_target

WARNING = "drafted tokens a round: this drafter does not fit this target"


def test_a_drafter_made_for_another_target_is_reported_once(capsys):
    target = tiny_target("llama", seed=1, vocab=512)
    other = tiny_target("llama", seed=2, vocab=512)  # same shape, other weights: its drafter loads
    drafter = DFlashDrafter(tiny_drafter(other, seed=2, block_size=4), TargetModel(target))
    engine_output, stats = run_engine(
        target, drafter, ChainBuilder(), [3, 9, 4, 1], 2 * JUDGED_ROUNDS, 10_000
    )
    assert engine_output == hf_greedy(target, [3, 9, 4, 1], 2 * JUDGED_ROUNDS, None)  # still lossless
    assert stats.rounds >= JUDGED_ROUNDS
    err = capsys.readouterr().err
    assert err.count(WARNING) == 1 and "another target or tokenizer" in err and "diffdraft train eval" in err


def test_a_fitting_drafter_and_prompt_lookup_stay_silent(capsys):
    target = tiny_target("llama", seed=1, vocab=512)
    prompt = [3, 9, 4, 1]
    reference = hf_greedy(target, prompt, 3 * JUDGED_ROUNDS, None)
    oracle = OracleDrafter(reference, len(prompt), 512, 3, seed=0)
    run_engine(target, oracle, ChainBuilder(), prompt, 3 * JUDGED_ROUNDS, 10_000)
    g = torch.Generator().manual_seed(0)
    unrepeated = torch.randperm(500, generator=g)[:40].add(1).tolist()  # nothing for lookup to copy
    run_engine(target, PromptLookupDrafter(3), ChainBuilder(), unrepeated, 3 * JUDGED_ROUNDS, 10_000)
    assert WARNING not in capsys.readouterr().err
