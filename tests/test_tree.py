"""tree.py, property-tested: builders keep every branch, truncation keeps the shallow nodes with their
soft tokens, and soft tokens get their ensemble mask and positions. The mask and positions of any tree
(against brute force) and the optimality of the greedy sparse tree are the course's graders
(course/a3_tree_mask, course/a8_sparse_trees), which tests/test_course.py runs against this code."""


import pytest
import torch
from hypothesis import given, strategies as st

from helpers import VOCAB_OF_TREES, cheap, path_to, trees
from tree import Tree


def token_paths(tree):
    """The token sequence from the root (excluded) to every node."""
    return {tuple(tree.tokens[n] for n in path_to(tree, node)[1:]) for node in range(len(tree))}


branches = st.lists(st.lists(st.integers(0, VOCAB_OF_TREES - 1), min_size=1, max_size=6), max_size=8)



@cheap  # milliseconds per example
@given(branches, st.integers(0, 40))
def test_merged_branches_share_prefixes_and_keep_every_branch(branch_list, budget):
    tree = Tree.from_branches(9, branch_list, budget, merge=True)
    assert tree.tokens[0] == 9 and tree.draft_size <= budget
    for node in range(len(tree)):  # merged: no two siblings carry the same token
        sibling_tokens = [tree.tokens[c] for c in tree.children[node]]
        assert len(sibling_tokens) == len(set(sibling_tokens))
    prefixes = {()} | {tuple(b[:i]) for b in branch_list for i in range(len(b) + 1)}
    assert token_paths(tree) <= prefixes
    if len(prefixes) - 1 <= budget:  # everything fits: every branch is a path of the tree
        assert token_paths(tree) == prefixes


@given(branches, st.integers(0, 40))
def test_parallel_branches_are_laid_out_whole_until_the_budget(branch_list, budget):
    tree = Tree.from_branches(9, branch_list, budget, merge=False)
    laid_out = [t for b in branch_list for t in b][:budget]
    assert tree.tokens[1:] == laid_out
    assert all(tree.depths[n] == 1 for n in tree.children[0])
    assert len(tree.children[0]) == len([b for b in branch_list if b]) or tree.draft_size == budget


@given(st.lists(st.lists(st.integers(0, 99), min_size=3, max_size=3), min_size=1, max_size=4),
       st.data())
def test_topk_tree_follows_the_spec(candidates, data):
    depth = len(candidates)
    all_paths = [()]
    for _ in range(depth):
        all_paths += [p + (r,) for p in all_paths if len(p) == len(all_paths[-1]) for r in range(3)]
    spec = sorted(data.draw(st.sets(st.sampled_from(all_paths[1:]), max_size=12)), key=len)
    spec = [p for p in spec if all(p[:i] in spec for i in range(1, len(p)))]  # prefix-closed
    tree = Tree.from_topk(5, candidates, spec)
    assert tree.draft_size == len(spec)
    for node, path in enumerate(spec, start=1):
        assert tree.depths[node] == len(path)
        assert tree.tokens[node] == candidates[len(path) - 1][path[-1]]


def test_topk_spec_errors():
    with pytest.raises(ValueError, match="prefix"):
        Tree.from_topk(0, [[1, 2], [3, 4]], [(0, 1)])
    with pytest.raises(ValueError, match="does not exist"):
        Tree.from_topk(0, [[1, 2]], [(2,)])


@given(trees(), st.integers(0, 6))
def test_truncation_keeps_the_shallow_nodes(tree, max_depth):
    cut = tree.truncated(max_depth)
    assert max(cut.depths) <= max_depth
    assert token_paths(cut) == {p for p in token_paths(tree) if len(p) <= max_depth}
    assert len(cut) == sum(d <= max_depth for d in tree.depths)


# ---- soft tokens -------------------------------------------------------------------------------

def test_ensemble_mask_and_positions_by_hand():
    """Root r with one child c; r carries 2 soft tokens, c carries 1, each in 2 EPT groups.
    Rows: r, c, then (r,d1,g0) (r,d1,g1) (r,d2,g0) (r,d2,g1) (c,d1,g0) (c,d1,g1)."""
    tree = Tree([7, 8], [-1, 0], soft_counts=[2, 1], ensembles=2)
    assert tree.soft_slots() == [(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 1, 0), (1, 1, 1)]
    assert tree.positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12, 12]
    expected = torch.tensor([
        # r  c  r10 r11 r20 r21 c10 c11
        [1, 0, 0, 0, 0, 0, 0, 0],  # r
        [1, 1, 0, 0, 0, 0, 0, 0],  # c: nodes never see soft tokens
        [1, 0, 1, 0, 0, 0, 0, 0],  # r's distance-1 EPT, group 0
        [1, 0, 0, 1, 0, 0, 0, 0],  # group 1: not group 0's
        [1, 0, 1, 0, 1, 0, 0, 0],  # distance 2, group 0: sees distance 1 of group 0 only
        [1, 0, 0, 1, 0, 1, 0, 0],  # distance 2, group 1
        [1, 1, 0, 0, 0, 0, 1, 0],  # c's soft token: c's ancestors, not r's soft tokens
        [1, 1, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.attention_mask(3).shape == (8, 11)
    assert tree.soft_rows(0) == [2, 3, 4, 5] and tree.soft_rows(1) == [6, 7]


def test_truncation_keeps_soft_counts():
    tree = Tree([1, 2, 3], [-1, 0, 1], soft_counts=[1, 2, 3], ensembles=2)
    cut = tree.truncated(1)
    assert cut.soft_counts == [1, 2] and cut.ensembles == 2 and len(cut.soft_slots()) == 6


# ---- sparse trees from accuracies ---------------------------------------------------------------





def test_truncation_keeps_the_soft_inputs_of_the_kept_nodes():
    """Nodes 0, 1, 3 are at most 1 deep; node 2 (depth 2) goes, and with it its soft token's input row."""
    tree = Tree([5, 6, 7, 8], [-1, 0, 1, 0], soft_counts=[1, 1, 1, 1], soft_inputs=torch.arange(4.0)[:, None])
    cut = tree.truncated(1)
    assert cut.tokens == [5, 6, 8] and cut.soft_inputs[:, 0].tolist() == [0, 1, 3]
    assert len(cut.soft_inputs) == len(cut.soft_slots())
