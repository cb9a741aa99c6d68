"""Grader of a8: a node of rank path (r1, .., rd) is accepted with the product of its ranks' accuracies,
a tree's expected accepted guesses are the sum over its nodes (PPD proposition 4.1), and your sparse tree
of n nodes is the best of all prefix-closed trees of n nodes at most max_depth deep (brute force; Medusa
section 2.1.2)."""

import itertools
import math

import pytest
from helpers import accuracy_tables, all_paths
from hypothesis import example, given, strategies as st

import adapters

path_probability = adapters.implementation("a8_sparse_trees", "path_probability")
expected_accepted = adapters.implementation("a8_sparse_trees", "expected_accepted")
best_sparse_tree = adapters.implementation("a8_sparse_trees", "best_sparse_tree")


@given(accuracy_tables, st.data())
def test_a_path_is_accepted_with_the_product_of_its_accuracies(accuracy, data):
    path = data.draw(st.sampled_from(all_paths(accuracy, len(accuracy))))
    expected = math.prod(accuracy[d][r] for d, r in enumerate(path))
    assert path_probability(accuracy, path) == pytest.approx(expected), (
        f"accuracy {accuracy}: path {path} is accepted with {' x '.join(str(accuracy[d][r]) for d, r in enumerate(path))}")


@given(accuracy_tables, st.data())
def test_the_expected_accepted_guesses_sum_over_the_nodes(accuracy, data):
    paths = all_paths(accuracy, len(accuracy))
    spec = [p for p in paths if data.draw(st.booleans()) and all(p[:i] in paths for i in range(1, len(p)))]
    spec = [p for p in spec if all(p[:i] in spec for i in range(1, len(p)))]  # prefix-closed
    expected = sum(math.prod(accuracy[d][r] for d, r in enumerate(p)) for p in spec)
    got = expected_accepted(accuracy, spec)
    assert got == pytest.approx(expected), (
        f"accuracy {accuracy}, tree {spec}: the expected accepted guesses are the sum over the nodes of their "
        f"acceptance probabilities, {expected:.4f}, not {got:.4f} (the root is no guess: an empty tree gives 0)")


@given(accuracy_tables, st.integers(0, 5), st.none() | st.integers(0, 3))
@example([[0.9, 0.1], [0.9, 0.1]], 2, 1)  # at the depth limit: a deep guess would be the better one
def test_your_tree_is_the_best_tree_of_its_size(accuracy, size, max_depth):
    spec = [tuple(p) for p in best_sparse_tree(accuracy, size, max_depth)]
    depth = len(accuracy) if max_depth is None else min(max_depth, len(accuracy))
    too_deep = [p for p in spec if len(p) > depth]
    assert too_deep == [], f"max_depth {max_depth}: no node deeper than {depth}, but {too_deep} are"
    paths = all_paths(accuracy, depth)
    assert len(spec) == min(size, len(paths)) and len(set(spec)) == len(spec), (
        f"{size} distinct nodes (or all {len(paths)} there are), not {spec}")
    assert all(p[:-1] == () or p[:-1] in spec[:i] for i, p in enumerate(spec)), f"{spec}: a node's parent comes first"
    best, best_spec = max((sum(math.prod(accuracy[d][r] for d, r in enumerate(p)) for p in subset), subset)
                          for subset in itertools.combinations(paths, len(spec))
                          if all(p[:-1] == () or p[:-1] in subset for p in subset))
    value = sum(math.prod(accuracy[d][r] for d, r in enumerate(p)) for p in spec)
    assert value == pytest.approx(best), (
        f"accuracy {accuracy}, max_depth {max_depth}: the best tree of {len(spec)} nodes, {list(best_spec)}, accepts "
        f"{best:.4f} guesses on "
        f"average; yours, {spec}, accepts {value:.4f} (a node's worth is the product of the accuracies on its path)")
