"""Token Recycling's adjacency matrix: each input's row becomes the top-k of its own logits after a
pass (rejected guesses' rows too), and a proposal reads the tree of rank paths through it. That its
output equals vanilla's is tests/test_decode.py's and tests/test_sampling_decode.py's."""

import torch

from drafters import Pass, Request
from methods.recycling import RANK_ACCEPTANCE, TOP_K, RecyclingDrafter
from tree import Tree, Verdict

VOCAB = 32


def logits_favouring(rows: list[list[int]]) -> torch.Tensor:
    """[R, VOCAB] logits whose top-k of row r is rows[r] in that order (then the rest)."""
    logits = torch.zeros(len(rows), VOCAB)
    for r, favourites in enumerate(rows):
        for rank, token in enumerate(favourites):
            logits[r, token] = 100.0 - rank
    return logits


def started(drafter: RecyclingDrafter, prompt: list[int]) -> RecyclingDrafter:
    drafter.begin(Request(prompt))
    return drafter


def test_each_input_gets_the_top_k_of_its_own_logits_rejected_guesses_too():
    drafter = started(RecyclingDrafter(VOCAB, 8), [1, 2])
    tree = Tree([2, 5, 6, 7], [-1, 0, 0, 1])  # root 2; 5 and 6 its children; 7 under 5
    rows = [[5, 9, 10, 11, 12, 13, 14, 15], [1, 7, 3, 4, 8, 16, 17, 18],
            [20, 21, 22, 23, 24, 25, 26, 27], [30, 29, 28, 3, 4, 8, 1, 0]]
    path = [0, 1]  # the model chose 5 after 2 (accepted; 6 rejected) and 1 after 5 (7 rejected): bonus 1
    done = Pass(tree, 2, path, [5, 1], torch.zeros(4, 4), logits_favouring(rows), Verdict.of(tree, path, 1))
    drafter.after_pass(done)
    for node, token in enumerate(tree.tokens):
        assert drafter.matrix[token].tolist() == rows[node], token  # 6 and 7 were rejected: kept all the same
    assert (drafter.matrix[3] == -1).all()  # never an input: no row


def test_a_proposal_follows_the_rank_paths_through_the_matrix():
    drafter = started(RecyclingDrafter(VOCAB, 6), [4])
    drafter.matrix[4] = torch.tensor([8, 9, 10, 11, 12, 13, 14, 15], dtype=torch.int32)
    drafter.matrix[8] = torch.tensor([16, 17, 18, 19, 20, 21, 22, 23], dtype=torch.int32)
    tree = drafter.propose()
    token_of = {}
    for path, node in zip(drafter.spec, range(1, len(tree))):
        token_of[path] = tree.tokens[node]
    assert tree.tokens[0] == 4
    assert token_of[(0,)] == 8 and token_of[(0, 0)] == 16 and token_of[(1,)] == 9
    # 16 and 9 have no rows: nothing grows under them, and the tree is shorter than the spec
    assert all(tree.tokens[tree.parents[node]] in (4, 8) for node in range(1, len(tree)))
    assert len(tree) - 1 == sum(1 for path in drafter.spec if len(path) == 1 or path[:-1] == (0,))
    node = tree.tokens.index(17)
    assert tree.evidence[node] == ((("recycling", 1), RANK_ACCEPTANCE[1]),)


def test_no_row_no_guess():
    drafter = started(RecyclingDrafter(VOCAB, 6), [4])
    assert len(drafter.propose()) == 1


def test_the_matrix_outlives_a_prompt():
    """The paper's hot start: a later prompt inherits what earlier ones recorded."""
    drafter = started(RecyclingDrafter(VOCAB, 6), [4])
    prefill = Tree.chain(1, [4])
    drafter.after_pass(Pass(prefill, 0, [0, 1], [8], torch.zeros(2, 4), logits_favouring([[8] + list(range(TOP_K - 1))]),
                            logits_start=1))
    started(drafter, [3, 4])
    assert drafter.propose().tokens[1] == 8
