"""tree.py, property-tested: builders keep every branch, truncation keeps the shallow nodes with their
soft tokens, and soft tokens get their ensemble mask and positions. The mask and positions of any tree
(against brute force) and the optimality of the greedy sparse tree are the course's graders
(course/a3_tree_mask, course/a8_sparse_trees), which tests/test_course.py runs against this code."""


import pytest
import torch
from hypothesis import given, strategies as st

from helpers import VOCAB_OF_TREES, cheap, path_to, trees
from tree import ExtraInputs, Tree


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


# ---- extra inputs (PPD's soft tokens; their layout is tested in test_ppd.py) ----------------------

def test_extra_inputs_see_their_node_its_ancestors_and_the_row_they_follow():
    """Root r with child c; extra rows: x0 on r, x1 on c, x2 on c following x1."""
    extra = ExtraInputs(node=(0, 1, 1), offset=(1, 1, 2), follows=(-1, -1, 1), embeddings=torch.zeros(3, 4))
    tree = Tree([7, 8], [-1, 0], extra=extra)
    assert tree.input_count == 5 and tree.extra_rows(1) == [3, 4] and tree.inputs_of(1) == 3
    assert tree.input_positions(10).tolist() == [10, 11, 11, 12, 13]
    expected = torch.tensor([
        # r  c  x0 x1 x2
        [1, 0, 0, 0, 0],  # r
        [1, 1, 0, 0, 0],  # c: nodes never see extra inputs
        [1, 0, 1, 0, 0],  # x0 on r
        [1, 1, 0, 1, 0],  # x1 on c
        [1, 1, 0, 1, 1],  # x2 on c, following x1
    ], dtype=torch.bool)
    assert torch.equal(tree.input_mask(3)[:, 3:], expected) and tree.input_mask(3)[:, :3].all()
    assert torch.equal(tree.ancestor_mask(), expected[:2, :2])  # the nodes alone


def test_extra_inputs_are_checked_when_made():
    with pytest.raises(ValueError):
        ExtraInputs(node=(0, 1), offset=(1, 1), follows=(-1, 0))  # follows a row on another node
    with pytest.raises(ValueError):
        ExtraInputs(node=(0,), offset=(1,), follows=(-1,), embeddings=torch.zeros(2, 4))
    with pytest.raises(ValueError):
        Tree([7], [-1], extra=ExtraInputs(node=(1,), offset=(1,), follows=(-1,)))  # no node 1


def test_truncation_keeps_the_extra_inputs_of_the_kept_nodes():
    """Nodes 0, 1, 3 are at most 1 deep; node 2 (depth 2) goes, and with it its extra inputs' rows."""
    extra = ExtraInputs(node=(0, 1, 2, 2, 3), offset=(1, 1, 1, 2, 1), follows=(-1, -1, -1, 2, -1),
                        embeddings=torch.arange(5.0)[:, None])
    cut = Tree([5, 6, 7, 8], [-1, 0, 1, 0], extra=extra).truncated(1)
    assert cut.tokens == [5, 6, 8] and cut.extra.embeddings[:, 0].tolist() == [0, 1, 4]
    assert cut.extra.node == (0, 1, 2) and cut.extra.follows == (-1, -1, -1)


# ---- sparse trees from accuracies ---------------------------------------------------------------



