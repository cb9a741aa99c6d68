"""Grader of a10: EAGLE-2's draft tree (Li et al. 2024, "EAGLE-2", section 4). A node's value is the
product of the draft's confidences on its path; each depth expands the `expand` most valuable of the
nodes the last one drafted; the reranked tree of n nodes is, of all trees of n drafted nodes, the one
whose values sum highest (brute force over every tree); and EAGLE decoding with your tree gives vanilla
greedy's tokens on tiny random models."""

import itertools
import math
import random

import pytest
from helpers import assert_equals_vanilla_greedy, random_eagle_head, tiny_model
from hypothesis import example, given, strategies as st

import adapters
from methods import eagle

DraftTree = adapters.implementation("a10_eagle_trees", "DraftTree")

# ties (1.0 after 1.0, equal halves) are where a tree most easily breaks
confidences = st.sampled_from([1.0, 0.5, 0.25, 0.1]) | st.floats(0.01, 1.0)


def path_of(parents: list[int], node: int) -> list[int]:
    """The nodes from the root's first child down to `node`."""
    path = []
    while node > 0:
        path.append(node)
        node = parents[node]
    return path[::-1]


def brute_values(parents: list[int], node_confidences: list[float]) -> list[float]:
    """Each node's value, by walking its path: the product of the confidences on it."""
    return [math.prod(node_confidences[n] for n in path_of(parents, node)) for node in range(len(parents))]


@st.composite
def drafted_trees(draw, max_nodes: int = 9):
    """(parents, confidences) of a random draft tree, nodes numbered in the order drafted (a parent first)."""
    count = draw(st.integers(0, max_nodes))
    parents = [-1] + [draw(st.integers(0, node - 1)) for node in range(1, count + 1)]
    return parents, [1.0] + [draw(confidences) for _ in range(count)]


def given_tree(parents: list[int], node_confidences: list[float]):
    """A DraftTree holding this tree as the reference's `grow` would have built it."""
    tree = DraftTree(0)
    tree.tokens = list(range(len(parents)))
    tree.parents = list(parents)
    tree.depths = [len(path_of(parents, node)) for node in range(len(parents))]
    tree.confidences = list(node_confidences)
    tree.values = brute_values(parents, node_confidences)
    return tree


@given(st.data())
def test_a_nodes_value_is_the_product_of_the_confidences_on_its_path(data):
    tree = DraftTree(7)
    tokens, parents, node_confidences = [7], [-1], [1.0]
    for _ in range(data.draw(st.integers(1, 4))):
        expanded = data.draw(st.lists(st.integers(0, len(tokens) - 1), min_size=1, max_size=3, unique=True))
        children = [data.draw(st.lists(st.tuples(st.integers(0, 50), confidences), min_size=1, max_size=3))
                    for _ in expanded]
        added = tree.grow(expanded, children)
        expected = list(range(len(tokens), len(tokens) + sum(map(len, children))))
        assert added == expected, f"grow({expanded}, {children}) adds nodes {expected}, in order, and returns them; yours returned {added}"
        for parent, drafted in zip(expanded, children):
            for token, confidence in drafted:
                tokens.append(token)
                parents.append(parent)
                node_confidences.append(confidence)
    depths = [len(path_of(parents, node)) for node in range(len(parents))]
    for name, got, want in [("tokens", tree.tokens, tokens), ("parents", tree.parents, parents),
                            ("depths", tree.depths, depths), ("confidences", tree.confidences, node_confidences)]:
        assert got == want, f"after growing, the tree's {name} are {want}, not {got}"
    for node, want in enumerate(brute_values(parents, node_confidences)):
        on_path = " x ".join(f"{node_confidences[n]:.3g}" for n in path_of(parents, node)) or "nothing: the root"
        assert tree.values[node] == pytest.approx(want), (
            f"node {node}'s value is the product of the confidences on its path, {on_path} = {want:.4g}, "
            f"not {tree.values[node]:.4g}: the draft's estimate that every guess down to it is right")


@st.composite
def trees_and_new_nodes(draw):
    """(parents, confidences, nodes): a random draft tree and some of its drafted nodes, as if just drafted."""
    parents, node_confidences = draw(drafted_trees())
    return parents, node_confidences, draw(st.lists(st.integers(1, len(parents) - 1), unique=True, max_size=6)
                                           if len(parents) > 1 else st.just([]))


@given(trees_and_new_nodes(), st.integers(1, 5))
@example(([-1, 0, 0, 1], [1.0, 0.4, 0.6, 0.9], [2, 3]), 1)  # node 3: the most confident, not the most valuable
def test_the_frontier_is_the_most_valuable_of_the_new_nodes(tree_and_nodes, expand):
    parents, node_confidences, nodes = tree_and_nodes
    tree = given_tree(parents, node_confidences)
    values = tree.values
    frontier = tree.frontier(list(nodes), expand)
    assert len(frontier) == len(set(frontier)) == min(expand, len(nodes)) and set(frontier) <= set(nodes), (
        f"the frontier is {min(expand, len(nodes))} distinct nodes of {nodes}, not {frontier}")
    left_out = [node for node in nodes if node not in frontier]
    by_value = sorted(nodes, key=lambda node: (-values[node], node))
    for kept in frontier:
        for other in left_out:
            assert values[other] <= values[kept], (
                f"nodes {nodes} with values {[round(values[n], 4) for n in nodes]} (confidences "
                f"{[round(node_confidences[n], 4) for n in nodes]}): the frontier of {expand} is the nodes of highest value, "
                f"{by_value[:expand]}; yours, {frontier}, keeps node {kept} ({values[kept]:.4g}) over node {other} "
                f"({values[other]:.4g}): a path's value, not its last confidence, is its chance of being accepted")
    assert [values[node] for node in frontier] == sorted((values[node] for node in frontier), reverse=True), (
        f"the frontier comes the most valuable first: {by_value[:expand]}, not {frontier}")


def oracle(rng_seed: int, top_k: int):
    """A draft for the expansion test: for each path of tokens, `top_k` (token, confidence) children, the
    most confident first, confidences summing to at most 1, fixed by the path."""
    def children(path: tuple[int, ...]) -> list[tuple[int, float]]:
        rng = random.Random(f"{rng_seed}:{path}")
        weights = sorted((rng.random() for _ in range(top_k + 1)), reverse=True)
        tokens = rng.sample(range(30), top_k)
        return [(token, weight / sum(weights)) for token, weight in zip(tokens, weights[:top_k])]
    return children


@given(st.integers(0, 10**6), st.integers(1, 3), st.integers(1, 4), st.integers(1, 4))
def test_the_expansion_drafts_the_children_of_each_depths_most_valuable_nodes(seed, top_k, expand, depth):
    """Driven as EagleDrafter.drafted drives it: grow the expanded nodes' children, then take the frontier
    of what was just drafted. Compared, as sets of token paths, with every path of the full tree of depth
    `depth` the draft could give (brute force), keeping at each depth the children of the previous depth's
    `expand` most valuable nodes only."""
    draft = oracle(seed, top_k)
    tree, expanded = DraftTree(0), [0]
    for _ in range(depth):
        paths = {node: tuple(tree.tokens[n] for n in path_of(tree.parents, node)) for node in expanded}
        added = tree.grow(expanded, [draft(paths[node]) for node in expanded])
        expanded = tree.frontier(added, expand)
    drafted = {tuple(tree.tokens[n] for n in path_of(tree.parents, node)): tree.values[node]
               for node in range(1, len(tree.tokens))}

    full = {(): 1.0}  # every path of the full tree, with its value
    for d in range(depth):
        full |= {path + (token,): full[path] * confidence for path in list(full) if len(path) == d
                 for token, confidence in draft(path)}
    want, level = {}, [()]
    for d in range(1, depth + 1):
        new = [path for path in full if len(path) == d and path[:-1] in level]
        want |= {path: full[path] for path in new}
        level = sorted(new, key=lambda path: -full[path])[:expand]
    assert set(drafted) == set(want), (
        f"top_k {top_k}, expand {expand}, depth {depth}: the drafted paths should be {sorted(want)}, each depth "
        f"the children of the {expand} most valuable nodes the depth before drafted; yours are {sorted(drafted)}")
    for path, value in want.items():
        assert drafted[path] == pytest.approx(value), f"path {path}: value {value:.4g}, not {drafted[path]:.4g}"


@given(drafted_trees(), st.integers(0, 10))
@example(([-1, 0, 1, 0], [1.0, 0.5, 1.0, 0.5]), 1)  # a tie between a child and its parent
def test_your_reranked_tree_is_the_best_tree_of_its_size(tree_and_confidences, size):
    parents, node_confidences = tree_and_confidences
    tree = given_tree(parents, node_confidences)
    values = tree.values
    kept = tree.best(size)
    drafted = range(1, len(parents))
    assert 0 not in kept, f"best({size}) = {kept}: node 0, the root, is the history's last token, not a guess"
    assert len(kept) == len(set(kept)) == min(size, len(drafted)) and set(kept) <= set(drafted), (
        f"best({size}) is {min(size, len(drafted))} distinct drafted nodes of {list(drafted)}, not {kept}")
    assert kept == sorted(kept), f"best({size}) lists the nodes in the order they were drafted (a parent first): {sorted(kept)}, not {kept}"
    for node in kept:
        assert parents[node] == 0 or parents[node] in kept, (
            f"tree parents {parents}, values {[round(v, 4) for v in values]}: best({size}) = {kept} keeps node {node} "
            f"but not its parent, node {parents[node]}: a child's value never exceeds its parent's, so on a tie "
            f"the shallower node goes first and the kept nodes form a tree")
    trees = [subset for subset in itertools.combinations(drafted, len(kept))
             if all(parents[node] == 0 or parents[node] in subset for node in subset)]
    best = max(trees, key=lambda subset: sum(values[node] for node in subset))
    value = sum(values[node] for node in kept)
    assert value == pytest.approx(sum(values[node] for node in best)), (
        f"tree parents {parents}, values {[round(v, 4) for v in values]}: the best tree of {len(kept)} nodes, "
        f"{list(best)}, expects {sum(values[node] for node in best):.4f} accepted guesses; yours, {kept}, "
        f"{value:.4f} (reranking keeps the nodes of highest value)")


@pytest.mark.parametrize("seed, prompt, inputs, depth, expand, top_k", [
    (0, [1, 2, 3, 1, 2, 3, 1, 2], 8, 3, 2, 2), (1, [5, 4, 5, 4, 5, 4], 12, 4, 3, 3), (3, [9, 9, 2], 5, 2, 1, 4)])
def test_eagle_with_your_tree_gives_vanilla_greedy_tokens(monkeypatch, seed, prompt, inputs, depth, expand, top_k):
    adapters.install(monkeypatch, "a10_eagle_trees", "DraftTree", eagle)
    model = tiny_model(seed)
    drafter = eagle.EagleDrafter(model, random_eagle_head(model, seed, 12), inputs, depth, expand, top_k)
    assert_equals_vanilla_greedy(model, prompt, 32, set(), drafter)
