"""The decoding loop as the exactness tests drive it: one sequence through the engine, and every method
(drafter and tree builder) by name, including oracle drafters that know the right continuation."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch

import diffdraft
from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.base import Proposal
from diffdraft.drafters.checkpoint import save_draft_model
from diffdraft.drafters.dflash import DFlashDrafter
from diffdraft.drafters.dflash_model import DFLARE, DFLASH
from diffdraft.drafters.lookup_boost import LookupBoostedDrafter
from diffdraft.drafters.prompt_lookup import PromptLookupDrafter
from diffdraft.runtime.sampling import SamplingParams
from diffdraft.runtime.stats import GenerationStats
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.loading import load_target
from diffdraft.target.model import TargetModel
from diffdraft.trees import ChainBuilder, DDTreeBuilder

from diffdraft_testing.checkpoints import make_checkpoint
from diffdraft_testing.drafters import tiny_drafter

METHODS = [
    "ar",
    "pld",
    "chain",
    "ddtree-1",
    "ddtree-4",
    "ddtree-32",
    "ddtree-256",
    "oracle-ddtree",
    "oracle-chain",
    "chain+pld",
    "ddtree-8+pld",
]
"""Every method :func:`make_method` builds: plain decoding, prompt lookup, DFlash chains and trees of
several budgets, oracles, and DFlash boosted by prompt lookup."""


class OracleDrafter:
    """Knows the right continuation and ranks it first or second at random, so trees get accepted
    along paths that are not prefixes (exercising KV compaction), and chains get long accepts."""

    target_layer_ids: list[int] = []  # noqa: RUF012

    def __init__(self, reference: list[int], prompt_len: int, vocab: int, max_depth: int, seed: int) -> None:
        self.reference, self.prompt_len, self.vocab, self.max_depth = reference, prompt_len, vocab, max_depth
        self.rng = torch.Generator().manual_seed(seed)

    def reset(self) -> None:
        pass

    def extend_context(self, hidden, start: int) -> None:
        pass

    def propose(self, token_ids: torch.Tensor, depth: int) -> Proposal:
        done = token_ids.shape[0] - self.prompt_len
        logits = torch.randn(depth, self.vocab, generator=self.rng, dtype=torch.float64)
        for d in range(depth):
            if done + d < len(self.reference):
                boost = 8.0 if torch.rand((), generator=self.rng) < 0.7 else 4.0
                logits[d, self.reference[done + d]] += boost
                if boost < 8.0:
                    logits[d, torch.randint(self.vocab, (), generator=self.rng)] += 6.0
        return Proposal(log_probs=logits.float().log_softmax(-1))


def run_engine(target, drafter, builder, prompt, max_new_tokens, eos, sampling=None, seed=None):
    """``target`` (a transformers model) decoding ``prompt`` with ``drafter`` and ``builder`` through the
    engine: (its tokens, its stats)."""
    stats = GenerationStats()
    stop = StopConditions([eos], max_new_tokens, target.config.max_position_embeddings, len(prompt))
    engine = SpeculativeEngine(TargetModel(target), drafter, builder)
    out = [
        t
        for chunk in engine.run(SequenceSpec(prompt, stop, sampling or SamplingParams(), stats, seed))
        for t in chunk
    ]
    return out, stats


def make_method(method: str, target, reference, prompt, block_size, seed):
    """(drafter, tree builder) for a name of :data:`METHODS` (a ``ddtree-N`` of any budget); the
    oracles know ``reference``, DFlash drafters are random, seeded by ``seed``."""
    if method == "ar":
        return None, ChainBuilder()
    if method == "pld":
        return PromptLookupDrafter(max_depth=block_size - 1), ChainBuilder()
    if method.startswith("oracle"):
        drafter = OracleDrafter(reference, len(prompt), target.config.vocab_size, block_size - 1, seed)
        return drafter, DDTreeBuilder(8) if method == "oracle-ddtree" else ChainBuilder()
    variant = DFLARE if seed % 2 else DFLASH
    vocab = target.config.vocab_size
    # every third drafter scores only a random half of the vocabulary (a draft vocabulary)
    draft_vocab = torch.randperm(vocab, generator=torch.Generator().manual_seed(seed))[: vocab // 2]
    drafter = DFlashDrafter(
        tiny_drafter(
            target,
            seed,
            block_size=block_size,
            variant=variant,
            draft_vocab=draft_vocab.tolist() if seed % 3 == 0 else None,
        ),
        TargetModel(target),
    )
    if method.endswith("+pld"):
        drafter, method = LookupBoostedDrafter(drafter), method.removesuffix("+pld")
    if method == "chain":
        return drafter, ChainBuilder()
    return drafter, DDTreeBuilder(int(method.split("-")[1]))


def speculated_tokens(target, drafter, builder, prompt: list[int], max_new_tokens: int) -> list[int]:
    """The greedy tokens the engine commits for ``prompt`` with ``drafter`` (None: plain decoding) and
    tree ``builder`` on a :class:`TargetModel` ``target``, stopping at EOS or ``max_new_tokens``."""
    config = target.model.config
    stop = StopConditions([config.eos_token_id], max_new_tokens, config.max_position_embeddings, len(prompt))
    engine = SpeculativeEngine(target, drafter, builder)
    return [t for chunk in engine.run(SequenceSpec(prompt, stop)) for t in chunk]


def saved_drafter_matches_ar(
    make_network: Callable[[torch.nn.Module], torch.nn.Module],
    folder: Path,
    methods: tuple[str, ...] = ("chain", "ddtree", "chain+pld"),
) -> None:
    """Save the random drafter ``make_network`` makes for a tiny Qwen3 target (saved beside it in
    ``folder``) as a checkpoint and assert that every method drafting with it through the generator
    gives ``ar``'s greedy tokens: the path a user's checkpoint takes, loading included."""
    loaded = load_target(make_checkpoint(folder / "target", "qwen3"), dtype="float32")
    save_draft_model(make_network(loaded.model).float(), folder / "drafter")
    prompt = dict(prompt="hello world, the quick", max_new_tokens=12, ignore_eos=True)
    plain = diffdraft.SpeculativeGenerator(loaded, "ar").generate(**prompt)
    for method in methods:
        drafting = diffdraft.SpeculativeGenerator(loaded, method, folder / "drafter", budget=6)
        assert drafting.generate(**prompt).token_ids == plain.token_ids, method
