"""Turning the target's logits over a draft tree into accepted tokens, exactly losslessly.

Every rule here makes the emitted tokens distributed exactly as plain decoding with the target:

- greedy: follow the child that carries the target's argmax;
- sampling walk (deterministic trees, e.g. DDTree): draw the target's own sample at each node and
  follow the child carrying it, so every emitted token *is* a target sample;
- rejection sampling (chains sampled from the drafter's q): accept x with prob min(1, p(x)/q(x))
  and, on the first rejection, draw from the residual max(0, p - q), which accepts more often than
  the walk when q is close to p.

Each rule does its tensor work for all rows in one batched call and one device-to-host copy, then
walks the tree in Python.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from diffdraft.kernels.quantized.row_argmax import greedy_rows
from diffdraft.runtime.sampling import SamplingParams, sample_from
from diffdraft.trees.tree import DraftTree


@dataclass
class Acceptance:
    path: list[int]
    """Accepted node indices in order, starting with the root 0."""
    next_token: int
    """The target's token after the last accepted node: the next round's root (bonus token)."""


def accept(
    tree: DraftTree,
    target_logits: torch.Tensor,
    sampling: SamplingParams,
    generator: torch.Generator | None,
) -> Acceptance:
    """Verify ``tree`` given ``target_logits`` [N + 1, V], row i being the target's logits after node i."""
    if target_logits.shape[0] != tree.tokens.shape[0]:
        raise ValueError(
            f"target_logits has {target_logits.shape[0]} rows but the tree has {tree.tokens.shape[0]} nodes"
        )
    if sampling.greedy:
        return _walk(tree, greedy_rows(target_logits).tolist())
    probs = sampling.probs(target_logits)
    if tree.draft_probs is not None:
        return _rejection_sample(tree, probs, generator)
    return _walk(tree, sample_from(probs, generator).tolist())


def _walk(tree: DraftTree, choices: list[int]) -> Acceptance:
    """Follow the child carrying the target's choice at each node; its first unmatched choice is next.

    Drawing a choice for every node up front is exact: only the choices on the walked path are used
    and the rows are independent.
    """
    tokens = tree.tokens.tolist()
    children = tree.children()
    path = [0]
    node = 0
    while True:
        want = choices[node]
        node = next((child for child in children[node] if tokens[child] == want), -1)
        if node < 0:
            return Acceptance(path=path, next_token=want)
        path.append(node)


def _rejection_sample(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator | None) -> Acceptance:
    """Speculative sampling on a chain whose node d was drawn from ``tree.draft_probs[d]``."""
    if not tree.is_chain:
        raise ValueError("rejection sampling needs a chain; verify trees without draft_probs (sampling walk)")
    n = tree.num_nodes
    drafted = tree.tokens[1:].unsqueeze(-1)
    p_drafted = probs[:-1].gather(-1, drafted).squeeze(-1)
    q_drafted = tree.draft_probs[1:].gather(-1, drafted).squeeze(-1)
    uniforms = torch.rand(n, generator=generator, device=probs.device)
    # u < p / q without dividing by a zero q.
    accepted = (uniforms * q_drafted < p_drafted).tolist()
    depth = next((d for d, ok in enumerate(accepted) if not ok), n)
    next_probs = probs[n] if depth == n else _residual(probs[depth], tree.draft_probs[depth + 1])
    return Acceptance(path=list(range(depth + 1)), next_token=int(sample_from(next_probs, generator)))


def _residual(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """The distribution to draw from after rejecting a sample of q: max(0, p - q), renormalized.

    A zero residual means p <= q everywhere, i.e. p == q, where rejection cannot happen except by
    rounding; p is then the right distribution.
    """
    residual = (p - q).clamp_min(0)
    total = residual.sum()
    return residual / total if total > 0 else p
