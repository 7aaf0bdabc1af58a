"""Draft trees read back as the token paths they hold."""

from __future__ import annotations

from diffdraft.trees import DraftTree


def prefixes(tree: DraftTree) -> list[tuple[int, ...]]:
    """Token sequence from the root's child down to each drafted node, found by walking parents."""
    tokens, parents = tree.tokens.tolist(), tree.parents.tolist()
    out = []
    for node in range(1, len(tokens)):
        seq = []
        while node > 0:
            seq.append(tokens[node])
            node = parents[node]
        out.append(tuple(reversed(seq)))
    return out
