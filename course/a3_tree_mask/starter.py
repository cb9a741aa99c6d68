"""Assignment a3_tree_mask: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a3_tree_mask
"""

import torch
import tree


class Tree(tree.Tree):
    def positions(self, cache_length: int, device=None) -> torch.Tensor:
        """[N] RoPE positions: a node sits as far after the cache as it is deep in the tree."""
        raise NotImplementedError("a3_tree_mask: implement positions")

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
        raise NotImplementedError("a3_tree_mask: implement ancestor_mask")

    def attention_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N, cache_length + N] bool: every node sees the whole cache, then its ancestors."""
        raise NotImplementedError("a3_tree_mask: implement attention_mask")
