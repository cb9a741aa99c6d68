"""Assignment a10_eagle_trees: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a10_eagle_trees
"""

import methods.eagle


class DraftTree(methods.eagle.DraftTree):
    def grow(self, expanded: list[int], children: list[list[tuple[int, float]]]) -> list[int]:
        """Give each node of `expanded` its drafted children, `children[i]` for `expanded[i]`: (token, the
        draft's confidence) pairs, added in that order (section 4.1, "Expansion"). -> the new nodes."""
        raise NotImplementedError("a10_eagle_trees: implement grow")

    def frontier(self, nodes: list[int], expand: int) -> list[int]:
        """The `expand` nodes of `nodes` of highest value, the highest first (ties: the earlier node): the
        nodes the next draft step expands (section 4.1: the likeliest paths, not the likeliest last steps)."""
        raise NotImplementedError("a10_eagle_trees: implement frontier")

    def best(self, size: int) -> list[int]:
        """The `size` drafted nodes of highest value (section 4.2, "Reranking"), in the order they were
        drafted. A child's value is never above its parent's, so with ties going to the shallower node they
        form a tree: of all trees of `size` drafted nodes, the one whose values sum highest."""
        raise NotImplementedError("a10_eagle_trees: implement best")
