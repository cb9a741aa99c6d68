"""The guess-and-verify loop (decode.py). It stops exactly where vanilla decoding stops, and it is
lossless: on random tiny float64 models, every drafter, including adversarial ones, yields exactly
vanilla greedy's tokens, stop reason and length. On the real default model in float32, ANPD and
Lookahead equal vanilla on a few prompts. (Sampling through the loop: test_sampling_decode.py.)"""

import random
from unittest.mock import patch

import pytest
import torch
from hypothesis import given, strategies as st

from helpers import random_model, tiny_hf_config, tiny_model, vanilla_answer
from decode import Answer, generate, prefill
from drafters import Drafter, NGramDrafter, TrieDrafter
from methods.recycling import RecyclingDrafter
from errors import UserError
from sampling import Sampling
from kv_cache import KVCache
from tree import ExtraInputs, Tree

VOCAB = 16  # small, so random models repeat themselves and n-gram guesses get accepted
MODEL_SEEDS = range(4)


# ---- stopping exactly ------------------------------------------------------------------------------

def test_stops_exactly_at_max_new_tokens():
    model = random_model(tiny_hf_config(vocab=32))
    for limit in (1, 2, 7):
        gen = generate(model, [3, 4, 5], max_new_tokens=limit, eos_ids=set())
        assert len(gen.token_ids) == limit and gen.stop_reason == "max_new_tokens"
        assert gen.counts.forward_passes == limit  # the prefill pass yields the first token


def test_stops_exactly_at_the_first_eos():
    model = random_model(tiny_hf_config(vocab=32), seed=3)
    free = generate(model, [3, 4, 5], max_new_tokens=20, eos_ids=set()).token_ids
    for k, eos in enumerate(free):
        first = free.index(eos)
        gen = generate(model, [3, 4, 5], max_new_tokens=20, eos_ids={eos})
        assert gen.token_ids == free[:first + 1] and gen.stop_reason == "eos", k


def test_stops_at_the_context_limit():
    model = random_model(tiny_hf_config(vocab=32, max_position_embeddings=12))
    gen = generate(model, [1] * 9, max_new_tokens=50, eos_ids=set())
    assert len(gen.token_ids) == 3 and gen.stop_reason == "context"


def test_a_prompt_that_fills_the_context_is_refused_and_one_token_shorter_gets_one_token():
    model = random_model(tiny_hf_config(vocab=32, max_position_embeddings=12))
    with pytest.raises(UserError, match="context is 12"):
        generate(model, [1] * 12, max_new_tokens=5, eos_ids=set())
    gen = generate(model, [1] * 11, max_new_tokens=5, eos_ids=set())
    assert len(gen.token_ids) == 1 and gen.stop_reason == "context"


def test_the_prefill_scores_the_prompt_but_its_last_token_alone_whatever_rides_on_that_token():
    """Every method's prompt K/V are vanilla's bit for bit: the prompt but its last token goes in a plain pass
    of its own (a product over many rows rounds each row by the rows beside it), then the last token with the
    extra inputs hung on it (PPD's soft tokens), whose K/V are dropped."""
    model = random_model(tiny_hf_config(vocab=32), dtype=torch.float32)  # (in one pass, MKL's GEMM on 2 EPYC cores
    # rounded these 94 prompt rows apart with 3 more rows beside them)
    prompt_ids, soft = torch.randint(3, 32, (94,), generator=torch.Generator().manual_seed(0)).tolist(), 3
    P = len(prompt_ids)
    extra = ExtraInputs(node=(P - 1,) * soft, offset=(1, 2, 3), follows=(-1, 0, 1),
                        embeddings=torch.randn(soft, model.config.hidden_size))
    passes = []
    def recorded(*args, **kwargs):
        passes.append(kwargs["embeds"].shape[1])
        return type(model).hidden_states(model, *args, **kwargs)
    chain, caches = Tree.chain(prompt_ids[0], prompt_ids[1:]), []
    for prompt in (chain, chain.with_extra(extra)):
        cache = KVCache.for_model(model, capacity=P + soft)
        with patch.object(model, "hidden_states", recorded), torch.inference_mode():
            done = prefill(model, cache, prompt, Sampling(), None, Answer(5, 5, set()))
        assert cache.length == P and done.hidden.shape[0] == prompt.input_count
        caches.append(cache)
    assert torch.equal(caches[0].keys[..., :P - 1, :], caches[1].keys[..., :P - 1, :])
    assert torch.equal(caches[0].values[..., :P - 1, :], caches[1].values[..., :P - 1, :])
    assert passes == [P - 1, 1, P - 1, 1 + soft]
    with pytest.raises(ValueError, match="last token only"):
        prefill(model, KVCache.for_model(model, capacity=P + 1),
                chain.with_extra(ExtraInputs(node=(2,), offset=(1,), follows=(-1,))), Sampling(), None, Answer(5, 5, set()))


def test_sampling_is_reproducible_with_a_seed():
    model = random_model(tiny_hf_config(vocab=32))
    def draw(seed):
        return generate(model, [3, 4], max_new_tokens=10, eos_ids=set(), sampling=Sampling(1.0),
                        generator=torch.Generator().manual_seed(seed)).token_ids
    assert draw(7) == draw(7)
    assert len({tuple(draw(s)) for s in range(5)}) > 1


# ---- every drafter equals vanilla greedy -----------------------------------------------------------

class RandomGuesses(Drafter):
    """Trees of random shape and random tokens: almost every guess is wrong."""

    max_extra_inputs = 12

    def __init__(self, seed):
        self.rng = random.Random(seed)

    def propose(self):
        size = self.rng.randrange(self.max_extra_inputs + 1)
        parents = [-1] + [self.rng.randrange(node) for node in range(1, size + 1)]
        return Tree([self.history[-1]] + [self.rng.randrange(VOCAB) for _ in range(size)], parents)


class CorruptedOracle(Drafter):
    """Knows the true continuation; guesses a random stretch of it with random corruptions, plus
    random side branches, so every acceptance length (0 to the whole guess) occurs."""

    max_extra_inputs = 14

    def __init__(self, seed, truth):
        self.rng, self.truth = random.Random(seed), truth

    def begin(self, request):
        super().begin(request)
        self.prompt_length = len(request.prompt_ids)

    def propose(self):
        done = len(self.history) - self.prompt_length
        guess = self.truth[done:done + self.rng.randrange(9)]
        guess = [self.rng.randrange(VOCAB) if self.rng.random() < 0.15 else t for t in guess]
        tokens, parents = [self.history[-1], *guess], list(range(-1, len(guess)))
        while len(tokens) <= self.max_extra_inputs and self.rng.random() < 0.5:
            parents.append(self.rng.randrange(len(tokens)))
            tokens.append(self.rng.randrange(VOCAB))
        return Tree(tokens, parents)


def drafters(seed, truth):
    return {
        "anpd": NGramDrafter(n=4, k=5),
        "anpd-bigram": NGramDrafter(n=2, k=3),
        "lookahead": TrieDrafter(decoding_length=8, branch_length=4),
        "lookahead-parallel": TrieDrafter(decoding_length=8, branch_length=4, hierarchical=False),
        "recycling": RecyclingDrafter(VOCAB, 12),
        "random": RandomGuesses(seed),
        "oracle": CorruptedOracle(seed, truth),
    }


@given(model_seed=st.sampled_from(MODEL_SEEDS), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_new_tokens=st.integers(1, 40), eos_pick=st.integers(-1, 40), seed=st.integers(0, 2**16))
def test_every_drafter_equals_vanilla_greedy(model_seed, prompt, max_new_tokens, eos_pick, seed):
    model = tiny_model(model_seed, vocab=VOCAB)
    free_run = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=set()).token_ids
    # an end-of-sequence token vanilla meets at a chosen point (or never, for -1)
    eos_ids = {free_run[eos_pick]} if 0 <= eos_pick < len(free_run) else set()
    vanilla = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids)

    for name, drafter in drafters(seed, vanilla.token_ids).items():
        gen = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids, drafter=drafter)
        assert gen.token_ids == vanilla.token_ids, name
        assert gen.stop_reason == vanilla.stop_reason, name
        assert gen.counts.forward_passes <= vanilla.counts.forward_passes, name
        # each pass adds its accepted guesses and a bonus token (the last pass's may be cut off)
        assert gen.counts.guesses_accepted == sum(gen.from_draft)
        assert 0 <= gen.counts.guesses_accepted - (len(gen.token_ids) - gen.counts.forward_passes) <= 1


def test_guesses_stop_at_the_context_limit_like_vanilla():
    model = tiny_model(0, vocab=VOCAB)  # 64 positions
    prompt = [1, 2, 3] * 19  # 57 tokens: 7 positions left
    vanilla = generate(model, prompt, max_new_tokens=50, eos_ids=set())
    assert vanilla.stop_reason == "context" and len(vanilla.token_ids) == 7
    oracle = CorruptedOracle(0, vanilla.token_ids)
    gen = generate(model, prompt, max_new_tokens=50, eos_ids=set(), drafter=oracle)
    assert gen.token_ids == vanilla.token_ids and gen.stop_reason == "context"


def test_a_perfect_guesser_needs_few_passes():
    model = tiny_model(1, vocab=VOCAB)
    vanilla = generate(model, [4, 5], max_new_tokens=30, eos_ids=set())

    class Perfect(CorruptedOracle):
        def propose(self):
            done = len(self.history) - self.prompt_length
            return Tree.chain(self.history[-1], self.truth[done:done + 9])

    gen = generate(model, [4, 5], max_new_tokens=30, eos_ids=set(), drafter=Perfect(0, vanilla.token_ids))
    assert gen.token_ids == vanilla.token_ids
    assert gen.counts.forward_passes == 1 + 3  # prefill, then 10 tokens (9 guesses + bonus) per pass: 1+10+10+9


def test_guesses_accepted_past_the_end_of_sequence_are_not_counted():
    """A perfect guesser's pass runs past the first end-of-sequence token: the output stops there, and
    only the guesses that became output count as accepted."""
    model = tiny_model(1, vocab=VOCAB)
    free = generate(model, [4, 5], max_new_tokens=30, eos_ids=set()).token_ids
    first = next(i for i in range(3, len(free)) if free.index(free[i]) == i)  # a token new at i >= 3
    eos = free[first]
    vanilla = generate(model, [4, 5], max_new_tokens=30, eos_ids={eos})

    class Perfect(CorruptedOracle):
        def propose(self):
            done = len(self.history) - self.prompt_length
            return Tree.chain(self.history[-1], free[done:done + 9])

    gen = generate(model, [4, 5], max_new_tokens=30, eos_ids={eos}, drafter=Perfect(0, free))
    assert gen.token_ids == vanilla.token_ids == free[:first + 1] and gen.counts.forward_passes == 2
    assert gen.counts.guesses_accepted == sum(gen.from_draft) == len(gen.token_ids) - 1


# ---- the real default model --------------------------------------------------------------------

PROMPTS = [
    "Summarize: The city council met on Tuesday to discuss the new park. The park will have a lake, "
    "a playground and a small cafe. The council approved the plan, and building starts in May.",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is the capital of France? Answer in one sentence.",
]



@pytest.mark.parametrize("method", ["anpd", "lookahead", "recycling"])
def test_default_model_methods_equal_vanilla(default_model, default_tokenizer, method):
    drafter = {"anpd": NGramDrafter, "lookahead": TrieDrafter,
               "recycling": lambda: RecyclingDrafter(default_model.config.vocab_size, 15)}[method]()
    total_passes = total_tokens = 0
    for text in PROMPTS:  # one drafter for all prompts: Lookahead's trie carries over
        prompt = default_tokenizer.prompt_ids(text, raw=False)
        vanilla = vanilla_answer(default_model, prompt, 48, default_tokenizer.eos_ids)
        gen = generate(default_model, prompt, drafter=drafter, max_new_tokens=48, eos_ids=default_tokenizer.eos_ids)
        assert gen.token_ids == vanilla.token_ids, text
        total_passes += gen.counts.forward_passes
        total_tokens += len(gen.token_ids)
    assert total_passes < total_tokens  # some guesses were accepted
