"""Grader of a4: greedy verification accepts exactly the deepest path of guesses that are the model's
own choices (brute force over every node), and your loop, with any drafter, gives vanilla greedy's
tokens, also when the accepted path is not the first nodes of the tree, and counts every pass and guess;
when sampling, its first token follows the model's distribution (chi-square)."""

from collections import Counter

import torch
from helpers import (VOCAB_OF_TREES, RandomGuesses, WrongBranchFirst, assert_decodes_as_naive_greedy, cheap,
                     chi_square_p_value, full_logits, naive_greedy, path_to, tiny_model, trees)
from hypothesis import given, strategies as st

import adapters
import verify
from drafters import Drafter
from sampling import Sampling

verify_greedy = adapters.implementation("a4_greedy_loop", "verify_greedy")
longest_path = adapters.implementation("a4_greedy_loop", "longest_path")
generate = adapters.implementation("a4_greedy_loop", "generate")


def is_right_path(tree, node, right) -> bool:
    return all(right(n) for n in path_to(tree, node)[1:])


@cheap
@given(trees(), st.data())
def test_greedy_verification_accepts_the_deepest_path_of_the_models_choices(tree, data):
    logits = torch.tensor(data.draw(st.lists(st.lists(st.floats(-5, 5), min_size=VOCAB_OF_TREES,
                                                      max_size=VOCAB_OF_TREES), min_size=len(tree), max_size=len(tree))))
    choice = logits.argmax(-1).tolist()
    verdict = verify_greedy(tree, logits)
    where = f"tokens {tree.tokens}, parents {tree.parents}, the model's choice after each node {choice}"
    for a, b in zip(verdict.path, verdict.path[1:]):
        assert tree.parents[b] == a, f"{where}: your path {verdict.path} is not a root-to-node path"
        assert tree.tokens[b] == choice[a], (f"{where}: you accepted node {b}, but its token {tree.tokens[b]} "
                                             f"is not the model's choice after its parent {a} ({choice[a]})")
    deepest = max(tree.depths[n] for n in range(len(tree))
                  if is_right_path(tree, n, lambda m: tree.tokens[m] == choice[tree.parents[m]]))
    assert len(verdict.path) - 1 == deepest, (f"{where}: there is a deeper path of right guesses ({deepest} "
                                              f"deep) than yours, {verdict.path}")
    assert verdict.tokens == [tree.tokens[n] for n in verdict.path[1:]] + [choice[verdict.path[-1]]], (
        f"{where}: the new tokens are the accepted guesses, then the bonus token: the model's choice after "
        f"the last accepted node")


@cheap
@given(trees(), st.data())
def test_the_longest_path_goes_as_deep_as_right_guesses_go(tree, data):
    right = data.draw(st.lists(st.booleans(), min_size=len(tree), max_size=len(tree)))
    path = longest_path(tree, lambda node: right[node])
    where = f"parents {tree.parents}, right guesses {[n for n in range(1, len(tree)) if right[n]]}"
    assert path[0] == 0 and all(tree.parents[b] == a and right[b] for a, b in zip(path, path[1:])), (
        f"{where}: {path} is not a path of right guesses from the root")
    deepest = max(tree.depths[n] for n in range(len(tree)) if is_right_path(tree, n, lambda m: right[m]))
    assert len(path) - 1 == deepest, f"{where}: there is a deeper path of right guesses ({deepest} deep) than {path}"


def test_your_loop_gives_vanilla_greedy_tokens_with_every_drafter(monkeypatch):
    for name in ("verify_greedy", "longest_path"):  # the loop verifies with your verification too
        adapters.install(monkeypatch, "a4_greedy_loop", name, verify)
    for seed, prompt in [(0, [1, 2, 3, 1, 2, 3, 1, 2]), (1, [5, 4, 5, 4, 5, 4]), (3, [9, 9, 2, 9, 9, 2])]:
        model = tiny_model(seed)
        vanilla = naive_greedy(model, prompt, 24)
        vocab = model.config.vocab_size
        for drafter in [Drafter(), WrongBranchFirst(vanilla, vocab), RandomGuesses(vanilla, vocab, seed),
                        RandomGuesses(vanilla, vocab, seed + 10, nodes=9, right=0.9)]:
            assert_decodes_as_naive_greedy(generate, model, prompt, 24, drafter, "your loop")


def test_when_sampling_the_first_token_follows_the_models_distribution():
    model, prompt, draws = tiny_model(2), [3, 1, 4, 1, 5], 1500
    p = torch.softmax(full_logits(model, prompt)[-1], dim=-1)  # temperature 1: the model's own distribution
    expected = {token: float(q) for token, q in enumerate(p)}
    generator = torch.Generator().manual_seed(0)
    counts = Counter(generate(model, prompt, max_new_tokens=1, eos_ids=set(), sampling=Sampling(temperature=1.0),
                              generator=generator).token_ids[0] for _ in range(draws))
    p_value = chi_square_p_value(counts, expected)
    most = sorted(expected, key=lambda token: -expected[token])[:4]
    assert p_value > 1e-4, (
        f"{draws} runs at temperature 1: the first new token (the prefill's) must be drawn from the model's p, "
        f"not chosen greedily; p-value {p_value:.2g}; " + ", ".join(
            f"token {t}: expected {expected[t] * draws:.0f}, got {counts[t]}" for t in most))


def test_your_loop_counts_every_pass_and_guess():
    model, prompt = tiny_model(0), [1, 2, 3, 1, 2, 3, 1, 2]
    passes, drafter = [], RandomGuesses(naive_greedy(model, prompt, 24), model.config.vocab_size)
    gen = generate(model, prompt, max_new_tokens=24, eos_ids=set(), drafter=drafter, on_pass=passes.append)
    seen = {"forward_passes": len(passes) + 1, "guesses_proposed": sum(p.guesses_proposed for p in passes),
            "guesses_accepted": sum(p.guesses_kept for p in passes), "rejections": sum(p.rejected for p in passes)}
    counted = {name: getattr(gen.counts, name) for name in seen}
    assert counted == seen, (
        f"your Generation.counts {counted}, but on_pass saw {seen}: count every forward pass (the prefill too, "
        "which yields the first token but verifies no guess), the guesses each pass sent, those that became "
        "output, and the passes that ended at a rejected guess")


def test_your_loop_tells_the_drafter_how_long_the_text_may_grow():
    """A drafter with a cache of its own (the draft model) sizes it by the request's max_length."""
    model = tiny_model(0)  # its context: 64 positions
    for prompt, max_new_tokens in [([1, 2, 3], 24), (list(range(8)) * 6, 24)]:
        drafter = RandomGuesses(naive_greedy(model, prompt, 1), model.config.vocab_size)
        generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=set(), drafter=drafter)
        longest = min(len(prompt) + max_new_tokens, model.config.max_positions)
        assert drafter.request.max_length == longest, (
            f"a prompt of {len(prompt)} tokens, max_new_tokens={max_new_tokens}, a context of "
            f"{model.config.max_positions}: the drafter's Request must say the text may grow to {longest} tokens "
            f"(the prompt and the new tokens, within the context), not {drafter.request.max_length}")


def test_your_loop_records_each_pass_as_it_happened():
    """What the loop hands the drafter after a pass (a Pass) is what that pass did: its tree, where its
    inputs went in the cache, the accepted path, the tokens emitted, the hidden states and logits of its
    inputs, and its seconds, which cost-aware drafting reads as a measurement of L(n)."""
    model, prompt = tiny_model(0), [1, 2, 3, 1, 2, 3, 1, 2]
    passes, drafter = [], RandomGuesses(naive_greedy(model, prompt, 24), model.config.vocab_size, 0, nodes=5)
    gen = generate(model, prompt, max_new_tokens=24, eos_ids=set(), drafter=drafter, on_pass=passes.append)
    length = len(prompt)  # what the cache holds before each pass: the prompt, then every accepted token
    for index, done in enumerate(passes):
        where = f"pass {index + 1} after the prefill (tree tokens {done.tree.tokens}, parents {done.tree.parents})"
        assert done.cache_length == length, (
            f"{where}: Pass.cache_length is what the cache held before it, {length}, not {done.cache_length}")
        assert done.path[0] == 0 and all(done.tree.parents[b] == a for a, b in zip(done.path, done.path[1:])), (
            f"{where}: Pass.path {done.path} must be the accepted root-to-node path (the verdict's)")
        assert tuple(done.hidden.shape) == (done.tree.input_count, model.config.hidden_size), (
            f"{where}: Pass.hidden holds the pass's final hidden states, one row per input: "
            f"{(done.tree.input_count, model.config.hidden_size)}, not {tuple(done.hidden.shape)}")
        assert done.logits.shape[0] == done.tree.input_count - done.logits_start, (
            f"{where}: Pass.logits holds the logits of the inputs from logits_start on")
        assert done.emitted == gen.token_ids[length - len(prompt) + 1:][:len(done.emitted)] and done.emitted, (
            f"{where}: Pass.emitted is the tokens this pass added to the answer")
        assert done.seconds > 0, f"{where}: Pass.seconds is the pass's measured time (the meter's 'forward')"
        length += len(done.path)
    assert gen.prefill_seconds > 0 and gen.forward_seconds > 0 and gen.draft_seconds > 0, (
        "time the loop's parts as the reference does (Meter): the prefill, the forward passes after it, and "
        f"the drafter's proposing and learning; yours: {gen.prefill_seconds}, {gen.forward_seconds}, {gen.draft_seconds}")
    assert gen.decode_seconds >= gen.prefill_seconds + gen.forward_seconds, "decode_seconds is the whole generation"
