"""DraftTree's ancestor mask: node i sees exactly itself and the nodes on its path to the root."""

from __future__ import annotations

import torch
from hypothesis import given
from hypothesis import strategies as st

from diffdraft.trees.tree import DraftTree


@st.composite
def trees(draw: st.DrawFn) -> DraftTree:
    """A random tree of 1-300 nodes, parents before children (wide, deep and mixed shapes)."""
    size, reach = draw(st.integers(1, 300)), draw(st.sampled_from([1, 3, 300]))  # a chain ... wide
    parents = [-1] + [draw(st.integers(max(0, node - reach), node - 1)) for node in range(1, size)]
    depths = [0] * size
    for node in range(1, size):
        depths[node] = depths[parents[node]] + 1
    return DraftTree(torch.arange(size), torch.tensor(parents), torch.tensor(depths))


@given(trees())
def test_each_row_of_the_ancestor_mask_is_the_path_to_the_root(tree):
    mask = tree.ancestor_mask()
    size = tree.tokens.shape[0]
    assert mask.dtype == torch.bool and mask.shape == (size, size)
    parents = tree.parents.tolist()
    for node in range(size):
        path, climb = set(), node
        while climb >= 0:
            path.add(climb)
            climb = parents[climb]
        assert set(mask[node].nonzero().flatten().tolist()) == path
