"""DFlash2's candidate selector: at each drafted position the target's LM head proposes its top-K
tokens, and a rank-r bilinear term rescores each candidate given the token chosen just before it.

The score of candidate ``c`` after predecessor ``p`` at position ``l`` is
``unary[l, c] + sum_r pred[p, r] * proj(h_l)[r] * succ[c, r]``: ``unary`` the candidate's (scaled,
soft-capped) head logit, ``pred`` / ``succ`` two [V, r] codebooks indexed by token id, ``proj`` a
projection of the position's hidden state. Position 0's predecessor is the block's anchor; position
``l``'s is one of position ``l - 1``'s candidates. So a position's distribution (the softmax of its
scores over its K candidates, every other token at probability 0) depends on the token chosen before
it. :class:`SelectorConditionals` scores a position after any predecessor from what the forward
computed once (candidates, unary scores, projected state), so a draft tree ranks each drafted
token's own successors. Weight names and shapes are those vLLM reads."""

from __future__ import annotations

import torch
from torch import nn

from diffdraft.drafters.conditionals import Conditionals


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def scores_after(
        self, hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """Scores [n, K] of each row's candidates after one given predecessor per row, from the hidden
        states [n, H], the candidates [n, K], their unary scores [n, K] and the predecessors [n]: the
        one predecessor training conditions on (the true previous token), a position per row."""
        left = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [n, r]
        pairwise = torch.einsum("nr,nkr->nk", left, self.successor_codebook[candidates])
        return unary + pairwise.float()

    def scores_given(
        self, projected: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """Scores [n, K] of one position's candidates [K] (unary scores [K], projected state [r])
        after each of the predecessors ``previous`` [n]: what a draft tree asks of each drafted token."""
        left = self.predecessor_codebook[previous] * projected  # [n, r]
        pairwise = torch.einsum("nr,kr->nk", left, self.successor_codebook[candidates])
        return unary + pairwise.float()


class SelectorConditionals(Conditionals):
    """One DFlash2 proposal's rows: each position's softmax over its candidates after a predecessor."""

    vocab = None

    def __init__(
        self,
        selector: CandidateSelector,
        projected: torch.Tensor,
        candidates: torch.Tensor,
        unary: torch.Tensor,
        width: int,
    ) -> None:
        """``projected`` [d, r]: the positions' hidden states through the selector's projection;
        ``candidates`` [d, K] token ids, their ``unary`` scores [d, K]; ``width``: the vocabulary's
        size."""
        self.selector, self.projected, self.candidates, self.unary = selector, projected, candidates, unary
        self.width = width

    @property
    def depth(self) -> int:
        return int(self.candidates.shape[0])

    @property
    def device(self) -> torch.device:
        return self.candidates.device

    @torch.inference_mode()
    def rows(self, position: int, previous: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        candidates = self.candidates[position]
        scores = self.selector.scores_given(
            self.projected[position], candidates, self.unary[position], previous
        )
        return scores.log_softmax(-1), candidates
