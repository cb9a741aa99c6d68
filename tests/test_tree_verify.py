"""tree.py and verify.py, property-tested against brute force: masks and positions are those of the
tree, builders keep every branch, and greedy verification accepts exactly the greedy continuation,
as far down the tree as it goes."""

import pytest
import torch
from hypothesis import given, strategies as st

from tree import Tree
from verify import verify_greedy

VOCAB = 4  # few tokens, so guesses are often right and sibling tokens often repeat


@st.composite
def trees(draw, max_nodes=24):
    size = draw(st.integers(1, max_nodes))
    parents = [-1] + [draw(st.integers(0, node - 1)) for node in range(1, size)]
    tokens = draw(st.lists(st.integers(0, VOCAB - 1), min_size=size, max_size=size))
    return Tree(tokens, parents)


def ancestors_or_self(tree, node):
    found = {node}
    while tree.parents[node] != -1:
        node = tree.parents[node]
        found.add(node)
    return found


@given(trees(), st.integers(0, 50))
def test_mask_and_positions_are_those_of_the_tree(tree, cached):
    mask = tree.attention_mask(cached)
    assert mask.shape == (len(tree), cached + len(tree))
    assert mask[:, :cached].all()  # every node sees the whole cache
    for i in range(len(tree)):
        for j in range(len(tree)):
            assert bool(mask[i, cached + j]) == (j in ancestors_or_self(tree, i))
        assert int(tree.positions(cached)[i]) == cached + len(ancestors_or_self(tree, i)) - 1


@given(trees())
def test_paths_are_every_root_to_leaf_path(tree):
    paths = tree.paths()
    leaves = {n for n in range(len(tree)) if n not in tree.parents}
    assert {p[-1] for p in paths} == leaves and len(paths) == len(leaves)
    for path in paths:
        assert path[0] == 0
        assert all(tree.parents[b] == a for a, b in zip(path, path[1:]))


def token_paths(tree):
    """The token sequence from the root (excluded) to every node."""
    return {tuple(tree.tokens[n] for n in tree.path_to(node)[1:]) for node in range(len(tree))}


branches = st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=6), max_size=8)


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


@given(trees(), st.data())
def test_greedy_verification_accepts_the_longest_greedy_path(tree, data):
    logits = torch.tensor(data.draw(st.lists(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=VOCAB, max_size=VOCAB),
        min_size=len(tree), max_size=len(tree))), dtype=torch.float64)
    choice = logits.argmax(-1).tolist()
    verdict = verify_greedy(tree, logits)

    assert verdict.path[0] == 0
    assert all(tree.parents[b] == a for a, b in zip(verdict.path, verdict.path[1:]))
    # the tokens are the greedy continuation: each one is the model's choice after the previous
    assert verdict.tokens == [choice[a] for a in verdict.path]
    assert verdict.tokens[:-1] == [tree.tokens[n] for n in verdict.path[1:]]
    # and no accepted path reaches deeper (brute force over all nodes)
    accepted_depths = [tree.depths[n] for n in range(len(tree))
                       if all(tree.tokens[b] == choice[a]
                              for a, b in zip(tree.path_to(n), tree.path_to(n)[1:]))]
    assert verdict.accepted_guesses == max(accepted_depths)


def test_parallel_branches_with_a_shared_first_token_take_the_deeper_one():
    # branches [1, 2] and [1, 3] laid side by side; the model continues 1, 3, 0
    tree = Tree.from_branches(0, [[1, 2], [1, 3]], budget=4, merge=False)
    logits = torch.full((len(tree), 4), -1.0)
    wanted_after = {0: 1, 1: 3, 2: 0, 3: 3, 4: 0}  # node -> the model's next token
    for node, token in wanted_after.items():
        logits[node, token] = 1.0
    verdict = verify_greedy(tree, logits)
    assert verdict.path == [0, 3, 4] and verdict.tokens == [1, 3, 0]
