"""Grader of a6: exact speculative sampling. Every random choice of your verifier is enumerated (exact,
in float64): the tokens it emits, continued by the model itself, must have exactly the model's own
distribution, for deterministic guesses over any tree and for a chain sampled from a draft model;
and a seeded run passes a chi-square test against it (Leviathan et al. 2023, section 2.3; Chen et al.
2023, Algorithm 2)."""

import random
from collections import Counter

import pytest
import torch
from helpers import (assert_same_distribution, chi_square_p_value, continued, deterministic_trees, draft_chain_outcomes,
                     model_joint, outcomes, random_table_model, tree_probs)
from hypothesis import given, strategies as st

import adapters
import verify
from tree import Tree

verify_speculative = adapters.implementation("a6_speculative_sampling", "verify_speculative")
residual_after_rejection = adapters.implementation("a6_speculative_sampling", "residual_after_rejection")
RULE = ("a guess x drawn from q is accepted with probability min(1, p(x) / q(x)); after a rejection the next "
        "try, or the bonus token, is drawn from the residual norm(max(0, p - q))")


@pytest.fixture(autouse=True)
def your_residual(monkeypatch):
    adapters.install(monkeypatch, "a6_speculative_sampling", "residual_after_rejection", verify)


@given(st.integers(0, 2**32))
def test_the_residual_is_the_normalised_positive_part_of_p_minus_q(seed):
    rng = random.Random(seed)
    p, q = (torch.tensor([rng.random() for _ in range(5)], dtype=torch.float64) for _ in range(2))
    p, q = p / p.sum(), q / q.sum()
    expected = (p - q).clamp(min=0) / (p - q).clamp(min=0).sum()
    got = residual_after_rejection(p, q)
    assert torch.allclose(got, expected, atol=1e-12), (
        f"p = {p.tolist()}, q = {q.tolist()}: after rejecting a guess drawn from q, the residual is "
        f"norm(max(0, p - q)) = {expected.tolist()}, not {got.tolist()}")


@pytest.mark.parametrize("p", [[0.0, 1.0, 0.0], [0.5, 0.25, 0.25]])
def test_the_residual_is_a_distribution_when_nothing_of_p_is_above_q(p):
    p = torch.tensor(p, dtype=torch.float64)
    got = residual_after_rejection(p, p.clone())
    weights = [round(w, 6) for w in got.tolist()]
    assert bool(torch.isfinite(got).all()) and abs(float(got.sum()) - 1) < 1e-9, (
        f"p = q = {p.tolist()}: max(0, p - q) is all zeros, and the residual {weights} is not a distribution "
        "(0 / 0 is nan); rounding makes this happen when q is p up to float error: fall back to p, the rule's limit")
    assert torch.allclose(got, p), f"p = q = {p.tolist()}: with nothing of p above q the residual is p, not {weights}"


def assert_models_distribution(emitted, model, length, what):
    assert sum(emitted.values()) == pytest.approx(1.0, abs=1e-12), f"{what}: the outcomes' probabilities sum to 1"
    try:
        assert_same_distribution(continued(emitted, model, length), model_joint(model, length))
    except AssertionError as err:
        raise AssertionError(f"{what}: the output's distribution is not the model's ({err}); {RULE}") from None


@given(deterministic_trees(), st.integers(0, 2**32))
def test_deterministic_guesses_over_any_tree_keep_the_models_distribution(tree, seed):
    model = random_table_model(random.Random(seed), max_depth=3)
    emitted = outcomes(lambda chance: verify_speculative(tree, tree_probs(tree, model), chance))
    assert_models_distribution(emitted, model, max(tree.depths) + 1, f"tree {tree}")


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("gamma", [1, 2, 3])
def test_a_chain_sampled_from_a_draft_model_keeps_the_models_distribution(seed, gamma):
    rng = random.Random(seed)
    target, draft = random_table_model(rng, gamma), random_table_model(rng, gamma)
    emitted = draft_chain_outcomes(target, draft, gamma, verify_speculative)
    assert_models_distribution(emitted, target, gamma + 1, f"a draft chain of {gamma} (seed {seed})")


@pytest.mark.parametrize("seed", range(3))
def test_a_draft_identical_to_the_target_has_every_guess_accepted(seed):
    target = random_table_model(random.Random(seed), 2)
    emitted = draft_chain_outcomes(target, target, 2, verify_speculative)
    short = {tokens: round(weight, 6) for tokens, weight in emitted.items() if len(tokens) != 3 and weight > 0}
    assert not short, (f"a draft identical to the target (q = p, seed {seed}): each guess is accepted with probability "
                       f"min(1, p(x) / q(x)) = 1, so every pass yields its 2 guesses and the bonus token; these "
                       f"outcomes (tokens: probability) are shorter: {short}")
    assert_models_distribution(emitted, target, 3, f"a draft identical to the target (seed {seed})")


def test_a_seeded_run_passes_a_chi_square_test():
    rng = random.Random(7)
    target, draft = random_table_model(rng, 2, zeros=False), random_table_model(rng, 2, zeros=False)
    generator = torch.Generator().manual_seed(0)
    counts = Counter()
    for _ in range(3000):
        guess, probs = [], []
        for _ in range(2):
            q = draft[tuple(guess)]
            guess.append(int(torch.multinomial(q, 1, generator=generator)))
            probs.append(q)
        tree = Tree.chain(7, guess, torch.stack(probs))
        tokens = verify_speculative(tree, tree_probs(tree, target), verify.Chance(generator)).tokens
        counts[tokens[0]] += 1
    expected = {token: float(target[()][token]) for token in range(len(target[()]))}
    p_value = chi_square_p_value(counts, expected)
    assert p_value > 1e-4, f"3000 runs: first tokens {dict(counts)} against p = {expected} (p-value {p_value:.2g}); {RULE}"
