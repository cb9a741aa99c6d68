"""Assignment a3_tree_mask: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a3_tree_mask
"""

import torch
import tree


class Tree(tree.Tree):
    def positions(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + S] RoPE positions: a node sits as far after the cache as it is deep in the tree; its
        soft token at distance d sits d places after it, where the token it guesses would be."""
        raise NotImplementedError("a3_tree_mask: implement positions")

    def ancestor_mask(self) -> torch.Tensor:
        """[N + S, N + S] bool: mask[i, j] is True when row j is row i or one of its ancestors. A
        soft token's ancestors are its node, the node's ancestors, and the same node's soft tokens
        at smaller distances *in its own ensemble group* (PPD appendix B.5.1, the ensemble mask: the
        n-th EPT sees only the n-th EPTs before it). Nodes never see soft tokens."""
        raise NotImplementedError("a3_tree_mask: implement ancestor_mask")

    def attention_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + S, cache_length + N + S] bool: every row sees the whole cache, then its ancestors."""
        raise NotImplementedError("a3_tree_mask: implement attention_mask")
