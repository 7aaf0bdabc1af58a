"""DFlash2's candidate selector: at each drafted position the target's LM head proposes its top-K
tokens, and a rank-r bilinear term rescores each candidate given the token chosen just before it.

The score of candidate ``c`` after predecessor ``p`` at position ``l`` is
``unary[l, c] + sum_r pred[p, r] * proj(h_l)[r] * succ[c, r]``: ``unary`` the candidate's (scaled,
soft-capped) head logit, ``pred`` / ``succ`` two [V, r] codebooks indexed by token id, ``proj`` a
projection of the position's hidden state. Position 0's predecessor is the block's anchor; position
``l``'s is one of position ``l - 1``'s candidates. So a position's distribution (the softmax of its
scores over its K candidates, every other token at probability 0) depends on the token chosen before
it. A one-pass draft has no chosen tokens yet: :meth:`CandidateSelector.greedy_walk` conditions each
position on the argmax chain (what greedy drafting picks, and what vLLM's greedy walk picks).
Weight names and shapes are those vLLM reads."""

from __future__ import annotations

import torch
from torch import nn


class CandidateSelector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.successor_codebook = nn.Parameter(torch.randn(vocab_size, rank) * 0.02)
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    def edge_scores(
        self, hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, roots: torch.Tensor
    ) -> torch.Tensor:
        """Scores [b, d, K (predecessor), K (candidate)] of every candidate after every predecessor,
        from the hidden states [b, d, H], the candidates [b, d, K], their unary scores [b, d, K] and
        the anchors [b]."""
        predecessors = torch.cat([roots[:, None, None].expand(-1, 1, self.top_k), candidates[:, :-1]], dim=1)
        left = self.predecessor_codebook[predecessors] * self.hidden_projection(hidden)[:, :, None]
        pairwise = torch.einsum("blpr,blcr->blpc", left, self.successor_codebook[candidates])
        return unary[:, :, None] + pairwise.float()

    def scores_after(
        self, hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, previous: torch.Tensor
    ) -> torch.Tensor:
        """Scores [n, K] of each row's candidates after one given predecessor per row, from the hidden
        states [n, H], the candidates [n, K], their unary scores [n, K] and the predecessors [n]:
        :meth:`edge_scores` for the one predecessor training conditions on (the true previous token)."""
        left = self.predecessor_codebook[previous] * self.hidden_projection(hidden)  # [n, r]
        pairwise = torch.einsum("nr,nkr->nk", left, self.successor_codebook[candidates])
        return unary + pairwise.float()

    def greedy_walk(
        self, hidden: torch.Tensor, candidates: torch.Tensor, unary: torch.Tensor, roots: torch.Tensor
    ) -> torch.Tensor:
        """Each position's scores over its candidates [b, d, K] after the previous position's argmax
        candidate (position 0: after the anchor, which every row of its predecessor axis holds)."""
        scores = self.edge_scores(hidden, candidates, unary, roots)
        batch = torch.arange(scores.shape[0], device=scores.device)
        previous = torch.zeros_like(batch)
        rows = []
        for position in range(scores.shape[1]):
            row = scores[batch, position, previous]
            rows.append(row)
            previous = row.argmax(-1)
        return torch.stack(rows, dim=1) if rows else unary
