"""The verifiers. Greedy: the longest greedy path, against brute force over random trees. Sampling,
checked exactly: speculative sampling over any tree must leave the model's distribution untouched,
and typical acceptance must be (and is labelled) lossy.

A "model" here is a table: for every prefix of guessed tokens, the distribution p of the next token.
A verify step emits some tokens; continuing from them by sampling the model itself up to a fixed
length must give exactly the model's own joint distribution of sequences of that length. That is
checked two ways: by enumerating every outcome of the verifier's random choices (exact, in float64),
and by Monte Carlo with a fixed seed against a chi-square test.
"""

import random
from collections import Counter

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import (VOCAB_OF_TREES, assert_same_distribution, cheap, chi_square_p_value,
                     model_joint, outcomes, random_table_model, tree_probs, trees)
from sampling import Sampling, target_probs
from tree import Tree
from verify import Chance, TypicalAcceptance, verify, verify_greedy, verify_speculative, verify_typical



# ---- greedy ---------------------------------------------------------------------------------------

@cheap  # milliseconds per example
@given(trees(), st.data())
def test_greedy_verification_reports_what_the_pass_proposed_and_whether_it_ended_at_a_rejection(tree, data):
    """(The accepted path itself, against brute force, is course/a4_greedy_loop's grader.)"""
    logits = torch.tensor(data.draw(st.lists(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=VOCAB_OF_TREES, max_size=VOCAB_OF_TREES),
        min_size=len(tree), max_size=len(tree))), dtype=torch.float64)
    verdict = verify_greedy(tree, logits)
    assert verdict.proposed == len(tree) - 1
    assert verdict.rejected == any(tree.parents[n] == verdict.path[-1] for n in range(len(tree)))


def test_parallel_branches_with_a_shared_first_token_take_the_deeper_one():
    # branches [1, 2] and [1, 3] laid side by side; the model continues 1, 3, 0
    tree = Tree.from_branches(0, [[1, 2], [1, 3]], budget=4, merge=False)
    logits = torch.full((len(tree), 4), -1.0)
    wanted_after = {0: 1, 1: 3, 2: 0, 3: 3, 4: 0}  # node -> the model's next token
    for node, token in wanted_after.items():
        logits[node, token] = 1.0
    verdict = verify_greedy(tree, logits)
    assert verdict.path == [0, 3, 4] and verdict.tokens == [1, 3, 0]


# ---- exact speculative sampling (that any tree and any draft chain keep the model's distribution
# exactly, by enumeration, is course/a6_speculative_sampling's grader, run on this code by
# tests/test_course.py) ----------------------------------------------------------------------------

def test_a_rejected_token_never_returns_as_the_bonus():
    probs = torch.tensor([[0.5, 0.3, 0.2]], dtype=torch.float64).repeat(3, 1)
    tree = Tree([0, 1, 2], [-1, 0, 0])  # both children of the root guess tokens 1 and 2
    emitted = outcomes(lambda chance: verify_speculative(tree, probs, chance))
    assert emitted[(0,)] == pytest.approx(0.5)  # token 0 can only come as the bonus
    assert set(emitted) == {(0,), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)}


def test_monte_carlo_with_a_seed_passes_a_chi_square_test():
    """The real random source: 20 000 verify steps over a merged tree with sibling choices."""
    rng = random.Random(3)
    model = random_table_model(rng, max_depth=3)
    tree = Tree.from_branches(0, [[1, 2, 0], [1, 0], [2, 2], [0, 1, 1]], budget=9)
    probs = tree_probs(tree, model)
    generator = torch.Generator().manual_seed(1)
    counts = Counter()
    for _ in range(20_000):
        tokens = tuple(verify_speculative(tree, probs, Chance(generator)).tokens)
        while len(tokens) < 4:  # continue by sampling the model itself
            tokens += (int(torch.multinomial(model[tokens], 1, generator=generator)),)
        counts[tokens] += 1
    assert chi_square_p_value(counts, model_joint(model, 4)) > 1e-3


def test_verify_shapes_p_exactly_like_vanilla_sampling():
    """Temperature, top-k and top-p reach the verifier through the one target_probs: with a guess the
    model can never produce (cut by top-p), the pass's token follows vanilla's p."""
    logits = torch.tensor([[2.0, 1.0, 0.5, -1.0]] * 2, dtype=torch.float64)
    sampling = Sampling(temperature=0.7, top_k=3, top_p=0.8)
    p = target_probs(logits[0], sampling)
    assert p[3] == 0 and p[2] == 0  # top-k cuts token 3, top-p then token 2
    tree = Tree.chain(0, [2])
    generator = torch.Generator().manual_seed(0)
    counts = Counter(verify(tree, logits, sampling, generator).tokens[0] for _ in range(4000))
    assert counts[2] == counts[3] == 0
    assert chi_square_p_value(counts, {t: float(p[t]) for t in range(4)}) > 1e-3


# ---- typical acceptance: lossy, and labelled so ------------------------------------------------

def test_typical_thresholds_follow_medusa():
    typical = TypicalAcceptance(epsilon=0.09, delta=0.3)
    peaked = torch.tensor([0.97, 0.01, 0.01, 0.01], dtype=torch.float64)
    flat = torch.full((4,), 0.25, dtype=torch.float64)
    entropy = -(peaked * peaked.log()).sum()
    assert typical.thresholds(torch.stack([peaked, flat])).tolist() == pytest.approx(
        [min(0.09, 0.3 * float(torch.exp(-entropy))), min(0.09, 0.3 * 0.25)])


def test_typical_acceptance_takes_the_longest_passing_path():
    probs = torch.tensor([[0.05, 0.5, 0.45], [0.9, 0.05, 0.05], [0.8, 0.1, 0.1], [0.3, 0.3, 0.4]],
                         dtype=torch.float64)
    tree = Tree([0, 2, 1, 0], [-1, 0, 0, 2])  # root -> 2 ; root -> 1 -> 0
    verdict = verify_typical(tree, probs, TypicalAcceptance(), Chance(torch.Generator().manual_seed(0)))
    assert verdict.path == [0, 2, 3]  # both first guesses pass (0.45, 0.5 > 0.09); 1 -> 0 is deeper
    assert verdict.tokens[:2] == [1, 0]


def test_typical_acceptance_without_guesses_samples_p():
    probs = torch.tensor([[0.2, 0.3, 0.5]], dtype=torch.float64)
    emitted = outcomes(lambda chance: verify_typical(Tree([1], [-1]), probs, TypicalAcceptance(), chance))
    assert_same_distribution(emitted, {(0,): 0.2, (1,): 0.3, (2,): 0.5})


def test_typical_acceptance_is_lossy():
    """It accepts any guess above its threshold, so a likely guess is emitted more often than p says:
    here token 1 (p = 0.6 at the root) is always accepted, making it certain."""
    probs = torch.tensor([[0.4, 0.6, 0.0], [0.2, 0.3, 0.5]], dtype=torch.float64)
    tree = Tree.chain(0, [1])
    emitted = outcomes(lambda chance: verify_typical(tree, probs, TypicalAcceptance(), chance))
    first = Counter()
    for tokens, w in emitted.items():
        first[tokens[0]] += w
    assert first[1] == pytest.approx(1.0)  # vanilla sampling: 0.6
    exact = outcomes(lambda chance: verify_speculative(tree, probs, chance))
    assert sum(w for tokens, w in exact.items() if tokens[0] == 1) == pytest.approx(0.6)


def test_typical_acceptance_checks_its_parameters():
    from errors import UserError

    for bad in [dict(epsilon=0), dict(epsilon=1.5), dict(delta=0)]:
        with pytest.raises(UserError):
            TypicalAcceptance(**bad)
