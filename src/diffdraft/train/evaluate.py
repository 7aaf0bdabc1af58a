"""How good is a drafter for its target: teacher-forced accuracy per block position, and tau.

Accuracy says where in the block the drafter fails; tau (mean accepted length with the bonus
token, from real greedy decoding with chain and DDTree) is what speed follows.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass

import torch

from diffdraft.decoding.engine import SpeculativeEngine
from diffdraft.decoding.sequence_spec import SequenceSpec
from diffdraft.drafters.families import DraftModel, make_drafter
from diffdraft.ngram import NgramTrie
from diffdraft.runtime.stats import GenerationStats
from diffdraft.runtime.stopping import StopConditions
from diffdraft.target.model import TargetModel
from diffdraft.train.batch import TrainingBatch
from diffdraft.train.blocks import sample_anchors
from diffdraft.train.dataset import TrainingSample
from diffdraft.train.features import OnlineFeatures
from diffdraft.train.objectives import make_objective
from diffdraft.trees import ChainBuilder, DDTreeBuilder
from diffdraft.trees.dart import DartTreeBuilder, DartTreeSettings
from diffdraft.util.progress import progress_bar


@dataclass(frozen=True)
class DartTrees:
    """Also measure tau of DART's tree (``dart-B`` per budget B) with this N-gram trie (None: without
    the N-gram term)."""

    ngram: NgramTrie | None = None


@dataclass
class DrafterEvaluation:
    accuracy_by_position: list[float]
    """Teacher-forced top-1 accuracy of drafted positions 1 .. max_depth on held-out sequences."""
    agreement_by_position: list[float]
    """How often the drafter's top-1 at drafted positions 1 .. max_depth is the target's own top-1 given the
    same prefix: what greedy acceptance follows, without the noise of sampled held-out text."""
    target_accuracy: float
    """The target's own teacher-forced top-1 accuracy on the held-out responses: the ceiling of
    ``accuracy_by_position`` (held-out text is sampled, so even the target misses some of it)."""
    tau: dict[str, float]
    """Mean acceptance length per tree rule ("chain", "ddtree-8", "dart-8", ...), greedy decoding."""
    sequences: int

    def to_dict(self) -> dict:
        return asdict(self)


@torch.no_grad()
def evaluate_drafter(
    drafter: DraftModel,
    target: TargetModel,
    samples: list[TrainingSample],
    budgets: tuple[int, ...] = (8, 32, 128),
    max_new_tokens: int = 64,
    dart: DartTrees | None = None,
) -> DrafterEvaluation:
    # a copy in the target's dtype: the caller's drafter (maybe mid-training) stays as it is
    drafter = copy.deepcopy(drafter).to(device=target.device, dtype=target.dtype).eval()
    objective = make_objective(drafter, target.model)
    features = OnlineFeatures(target, drafter.target_layer_ids)
    hits = torch.zeros(drafter.max_depth + 1)
    agreements = torch.zeros(drafter.max_depth + 1)
    counts = torch.zeros(drafter.max_depth + 1)
    target_hits = target_counts = 0
    for sample in progress_bar(samples, desc="drafter accuracy", unit="seq"):
        ids = sample.token_ids
        anchors = sample_anchors(
            sample.response_start, ids.shape[0], ids.shape[0], torch.Generator().manual_seed(0)
        )
        taps, logits = features.with_logits(ids)
        taps = None if taps is None else taps[None]
        one = TrainingBatch(ids[None], [ids.shape[0]], [anchors], [sample.response_start], taps, logits[None])
        _, h, a, n = objective(one, 1.0)
        hits += h.cpu()
        agreements += a.cpu()
        counts += n.cpu()
        predicted = logits[sample.response_start - 1 : -1].argmax(-1).cpu()
        target_hits += int((predicted == ids[sample.response_start :]).sum())
        target_counts += predicted.shape[0]

    rules = {"chain": ChainBuilder(), **{f"ddtree-{b}": DDTreeBuilder(b) for b in budgets}}
    if dart is not None:
        rules |= {f"dart-{b}": DartTreeBuilder(DartTreeSettings(tree_size=b), dart.ngram) for b in budgets}
    tau = {}
    for name, builder in rules.items():
        engine = SpeculativeEngine(target, make_drafter(drafter, target), builder)
        stats = GenerationStats()
        for sample in progress_bar(samples, desc=f"tau ({name})", unit="prompt"):
            prompt = sample.token_ids[: sample.response_start].tolist()
            stop = StopConditions([], max_new_tokens, target.max_context, len(prompt))
            for _ in engine.run(SequenceSpec(prompt, stop, stats=stats)):
                pass
        tau[name] = stats.tau
    accuracy = (hits / counts.clamp_min(1))[1:].tolist()
    agreement = (agreements / counts.clamp_min(1))[1:].tolist()
    return DrafterEvaluation(accuracy, agreement, target_hits / max(target_counts, 1), tau, len(samples))
