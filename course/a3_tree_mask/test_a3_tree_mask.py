"""Grader of a3: a node sits at cache length + its depth and attends to the cache and its own ancestors,
and the decoding loop run with your mask and positions gives exactly vanilla greedy's tokens."""

import tree as tree_module
from helpers import ancestors_or_self, assert_decodes_as_naive_greedy, cheap, tiny_model, trees
from hypothesis import given, strategies as st

import adapters
import decode
from drafters import TrieDrafter

Tree = adapters.implementation("a3_tree_mask", "Tree")


def yours(tree):
    return Tree(tree.tokens, tree.parents)


@cheap
@given(trees(), st.integers(0, 50))
def test_a_node_sits_at_cache_length_plus_its_depth(tree, cached):
    positions = yours(tree).positions(cached).tolist()
    assert len(positions) == len(tree), f"one position per node: {len(tree)} nodes, {len(positions)} positions"
    for node, position in enumerate(positions):
        depth = len(ancestors_or_self(tree, node)) - 1
        assert position == cached + depth, (
            f"parents {tree.parents}: node {node} is {depth} deep, so its position must be cache length "
            f"{cached} + {depth} = {cached + depth}, not {position}")


@cheap
@given(trees())
def test_a_node_attends_to_itself_and_its_ancestors_only(tree):
    mask = yours(tree).ancestor_mask()
    assert tuple(mask.shape) == (len(tree), len(tree)), f"the mask is [N, N] = {len(tree)} x {len(tree)}"
    for i in range(len(tree)):
        for j in range(len(tree)):
            should = j in ancestors_or_self(tree, i)
            assert bool(mask[i, j]) == should, (
                f"parents {tree.parents}: node {i} attends to node {j}, which is not its ancestor" if not should
                else f"parents {tree.parents}: node {i} must attend to node {j}, its ancestor (or itself)")


@cheap
@given(trees(), st.integers(0, 50))
def test_every_node_sees_the_whole_cache_then_its_ancestors(tree, cached):
    mask = yours(tree).attention_mask(cached)
    assert tuple(mask.shape) == (len(tree), cached + len(tree)), \
        f"[N, cache + N] = {len(tree)} x {cached + len(tree)}, not {tuple(mask.shape)}"
    assert mask[:, :cached].all(), "every node sees every cached token (the first cache_length columns)"
    assert (mask[:, cached:] == yours(tree).ancestor_mask()).all(), "after the cache: the ancestor mask"


def test_decoding_with_your_mask_and_positions_is_vanilla_greedy(monkeypatch):
    adapters.install(monkeypatch, "a3_tree_mask", "Tree", tree_module)
    for seed, prompt in [(0, [1, 2, 3, 1, 2, 3, 1, 2]), (1, [5, 4, 5, 4, 5, 4]), (2, [7, 1, 7, 1, 7])]:
        assert_decodes_as_naive_greedy(decode.generate, tiny_model(seed), prompt, 24,
                                       TrieDrafter(decoding_length=8, branch_length=4), "decoding with your mask")
