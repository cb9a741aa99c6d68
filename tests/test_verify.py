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

import verify as verify_module
from helpers import (VOCAB_OF_TREES, assert_same_distribution, cheap, chi_square_p_value,
                     continued, deterministic_trees, draft_chain_outcomes, model_joint, outcomes, path_to,
                     random_table_model, tree_probs, trees)
from sampling import Sampling, target_probs
from tree import Tree
from verify import Chance, TypicalAcceptance, verify, verify_greedy, verify_speculative, verify_typical



# ---- greedy ---------------------------------------------------------------------------------------

@cheap  # milliseconds per example
@given(trees(), st.data())
def test_greedy_verification_accepts_the_longest_greedy_path(tree, data):
    logits = torch.tensor(data.draw(st.lists(
        st.lists(st.floats(-5, 5, allow_nan=False), min_size=VOCAB_OF_TREES, max_size=VOCAB_OF_TREES),
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
                              for a, b in zip(path_to(tree, n), path_to(tree, n)[1:]))]
    assert verdict.accepted_guesses == max(accepted_depths)
    # and what the pass proposed, and whether it ended at a rejected guess, for the loop's statistics
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


# ---- exact speculative sampling ------------------------------------------------------------------

@given(deterministic_trees(), st.integers(0, 2**32))
def test_tree_rule_keeps_the_model_distribution_exactly(tree, seed):
    model = random_table_model(random.Random(seed), max_depth=3)
    probs = tree_probs(tree, model)
    emitted = outcomes(lambda chance: verify_speculative(tree, probs, chance))
    assert sum(emitted.values()) == pytest.approx(1.0, abs=1e-12)
    length = max(tree.depths) + 1
    assert_same_distribution(continued(emitted, model, length), model_joint(model, length))


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_draft_model_rule_keeps_the_model_distribution_exactly(seed, gamma):
    rng = random.Random(seed)
    target, draft = random_table_model(rng, gamma), random_table_model(rng, gamma)
    emitted = draft_chain_outcomes(target, draft, gamma)
    assert_same_distribution(continued(emitted, target, gamma + 1), model_joint(target, gamma + 1))


def test_a_wrong_residual_is_caught(monkeypatch):
    """The classic mistake: after a rejection, draw from p itself instead of norm(max(0, p - q))."""
    rng = random.Random(0)
    target, draft = random_table_model(rng, 2, zeros=False), random_table_model(rng, 2, zeros=False)
    right = continued(draft_chain_outcomes(target, draft, 2), target, 3)
    monkeypatch.setattr(verify_module, "residual_after_rejection", lambda p, q: p)
    wrong = continued(draft_chain_outcomes(target, draft, 2), target, 3)
    truth = model_joint(target, 3)
    assert max(abs(right[s] - truth[s]) for s in truth) < 1e-12
    assert max(abs(wrong[s] - truth[s]) for s in truth) > 0.01


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
