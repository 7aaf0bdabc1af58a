"""DART's continuity-aware tree pruning (DART paper, Algorithm 1 and Appendix D).

The drafter's per-position distributions are independent, so combining their top tokens freely
yields sequences that no text would contain. DART grows a beam level by level: every kept
sequence is extended by each of the level's top-k draft tokens, scored by the draft log-prob and
by an N-gram model's probability of that token after the sequence's last tokens, and the best
``beam_width`` extensions go on. Every extension ever scored is a candidate node; the tree is the
``tree_size`` best of them.

Score of a node at level ``l`` (0 for the first drafted token), summed along its path:
``(l + 1) ** level_exponent * (logit_decay ** l * log(p_draft + eps) + ngram_weight * log(p_ngram + eps))``.
Both log terms are capped at 0, so a child never outscores its parent and the best nodes always
form a tree. The tree is a deterministic candidate set: greedy and sampling-walk verification keep
the output exact whatever it contains.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from diffdraft.errors import InvalidRequestError
from diffdraft.trees.round import TreeRound
from diffdraft.trees.tree import MAX_TREE_NODES, DraftTree

if TYPE_CHECKING:
    from diffdraft.ngram import NgramTrie


@dataclass(frozen=True)
class DartTreeSettings:
    """Algorithm 1's knobs; the defaults are the paper's (Appendix D)."""

    tree_size: int = 59
    """theta: drafted nodes kept for verification."""
    top_k: int = 25
    """k_i: candidate tokens per level (the same at every level, as in the paper)."""
    beam_width: int = 20
    """w: sequences extended from one level to the next."""
    logit_decay: float = 0.9
    ngram_weight: float = 0.5
    level_exponent: float = -0.7
    eps: float = 1e-10

    def __post_init__(self) -> None:
        for name in ("tree_size", "top_k", "beam_width"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"DART tree {name} must be an integer >= 1, got {value!r}")
        if self.tree_size > MAX_TREE_NODES:
            raise InvalidRequestError(
                f"DART tree tree_size must be at most {MAX_TREE_NODES} nodes (a larger tree costs more to "
                f"verify than any round can gain), got {self.tree_size}; pass e.g. --budget 59"
            )


class DartTreeBuilder:
    """Beam search over the drafter's per-position top-k, pruned by an N-gram trie (optional)."""

    def __init__(self, settings: DartTreeSettings | None = None, ngram: NgramTrie | None = None) -> None:
        self.settings = settings or DartTreeSettings()
        self.ngram = ngram

    def build(self, tree_round: TreeRound) -> DraftTree:
        """Reads the round's ``root_token`` and ``proposal`` (its ``prefix``, when set, is the N-gram's
        history); ``sampling``, ``generator``, ``context``, ``stats`` and ``budget`` are unused: the tree
        is deterministic, of at most ``settings.tree_size`` nodes."""
        root_token, proposal = tree_round.root_token, tree_round.proposal
        if not proposal.has_distributions:
            if proposal.tokens is not None:
                raise InvalidRequestError(
                    "the DART tree needs a drafter that gives distributions; "
                    "use --method chain for prompt lookup"
                )
            return DraftTree.root_only(root_token)
        s = self.settings
        values, ids = proposal.top(s.top_k)
        device = values.device
        if values.shape[0] == 0:
            return DraftTree.root_only(root_token, device)
        candidates = ids.cpu().numpy()
        log_eps = np.log(s.eps)
        draft_scores = np.minimum(np.logaddexp(values.float().cpu().numpy(), log_eps), 0.0)
        keep = self.ngram.order - 1 if self.ngram is not None else 0  # N-gram context length
        history = proposal.prefix if proposal.prefix is not None else torch.tensor([root_token])
        k = candidates.shape[1]

        # Candidate nodes, level by level; node 0 is the root.
        parents, tokens, scores = [np.array([-1])], [np.array([root_token])], [np.array([0.0])]
        tails = [history[-keep:].tolist() if keep else []]  # per beam entry: its N-gram context
        beam, beam_scores = np.array([0]), np.array([0.0])  # node ids and scores of the sequences to extend
        count = 1
        for level in range(candidates.shape[0]):
            increments = np.broadcast_to(s.logit_decay**level * draft_scores[level], (len(beam), k))
            if self.ngram is not None:
                ngram = self.ngram.log_probs_many(tails, candidates[level])
                increments = increments + s.ngram_weight * np.minimum(np.logaddexp(ngram, log_eps), 0.0)
            level_scores = beam_scores[:, None] + (level + 1) ** s.level_exponent * increments
            parents.append(np.repeat(beam, k))
            tokens.append(np.tile(candidates[level], len(beam)))
            scores.append(level_scores.reshape(-1))
            # Only beam entries with a child among the tree's nodes matter, and a level-``level`` node
            # with a kept child has ``level`` kept ancestors and that child, so it ranks below
            # ``tree_size - level - 1`` in its level: a wider beam would give the same tree, slower.
            width = min(s.beam_width, s.tree_size - level - 1)
            if width <= 0:
                break
            best = np.argsort(-scores[-1], kind="stable")[:width]
            tails = [_last([*tails[i // k], int(tokens[-1][i])], keep) for i in best]
            beam, beam_scores = count + best, scores[-1][best]
            count += len(scores[-1])
        return _best_nodes(
            np.concatenate(parents), np.concatenate(tokens), np.concatenate(scores), s.tree_size, device
        )


def _last(tokens: list[int], count: int) -> list[int]:
    return tokens[max(0, len(tokens) - count) :]


def _best_nodes(
    parents: np.ndarray, tokens: np.ndarray, scores: np.ndarray, size: int, device: torch.device
) -> DraftTree:
    """The root and the ``size`` best candidates, which form a tree because scores never rise
    from parent to child (ties keep creation order, and parents are created first)."""
    chosen = np.sort(np.argsort(-scores[1:], kind="stable")[:size] + 1)
    kept = np.concatenate([[0], chosen])
    renumber = np.full(len(tokens), -1)
    renumber[kept] = np.arange(len(kept))
    new_parents = renumber[parents[kept]]
    new_parents[0] = -1
    if (new_parents[1:] < 0).any():
        raise AssertionError("DART tree pruning kept a node without its parent")
    depths = np.zeros(len(kept), dtype=np.int64)
    for i in range(1, len(kept)):
        depths[i] = depths[new_parents[i]] + 1
    return DraftTree(
        tokens=torch.as_tensor(tokens[kept], dtype=torch.long, device=device),
        parents=torch.as_tensor(new_parents, dtype=torch.long, device=device),
        depths=torch.as_tensor(depths, device=device),
    )
