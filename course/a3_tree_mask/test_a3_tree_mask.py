"""Grader of a3: a node sits at cache length + its depth and attends to the cache and its own ancestors,
so that ONE forward pass over a tree, with your mask and positions, scores every node exactly as a plain
pass over the text up to that node does."""

import torch
from helpers import ancestors_or_self, cheap, full_logits, path_to, tiny_model, trees
from hypothesis import given, settings, strategies as st

import adapters
from decode import score_tree
from kv_cache import KVCache

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


@settings(max_examples=60)
@given(trees(max_nodes=12), st.lists(st.integers(0, 15), min_size=1, max_size=6), st.integers(0, 2))
def test_one_pass_over_the_tree_scores_each_node_as_the_text_up_to_it(tree, prefix, seed):
    model, tree = tiny_model(seed), yours(tree)
    cache = KVCache.for_model(model, capacity=len(prefix) + len(tree))
    model.forward(torch.tensor([prefix]), positions=torch.arange(len(prefix)), cache=cache,
                  slots=cache.claim(len(prefix)))
    logits = model.logits(score_tree(model, cache, tree))  # your positions and mask, in the project's pass
    for node in range(len(tree)):
        text = prefix + [tree.tokens[n] for n in path_to(tree, node)]
        expected = full_logits(model, text)[-1]
        assert torch.allclose(logits[node], expected, rtol=1e-9, atol=1e-9), (
            f"parents {tree.parents}, {len(prefix)} cached tokens: in one pass over the tree, node {node} must "
            f"score what a plain pass over the cached tokens and its path {path_to(tree, node)} scores; it is off "
            f"by {float((logits[node] - expected).abs().max()):.3g} (it sees a token it must not, or misses one, "
            f"or sits at the wrong position)")
