"""Assignment a8_sparse_trees: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a8_sparse_trees
"""

from collections.abc import Iterable, Sequence


def path_probability(accuracy: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """How often the node of rank path `path` is accepted: the product of its ranks' accuracies."""
    raise NotImplementedError("a8_sparse_trees: implement path_probability")


def expected_accepted(accuracy: Sequence[Sequence[float]], spec: Iterable[Sequence[int]]) -> float:
    """f(T): the expected number of accepted guesses of the sparse tree `spec`."""
    raise NotImplementedError("a8_sparse_trees: implement expected_accepted")


def best_sparse_tree(accuracy: Sequence[Sequence[float]], size: int, max_depth: int | None = None) -> list[tuple]:
    """The `size`-node sparse tree (spec of rank paths, parents first) of the largest expected number
    of accepted guesses, at most `max_depth` deep: grow greedily by the most probable path whose
    parent is already in. A child is never more probable than its parent, so the `size` most
    probable paths are prefix-closed and the greedy choice is the optimum (Medusa's construction)."""
    raise NotImplementedError("a8_sparse_trees: implement best_sparse_tree")
