"""End to end: sampling with guesses leaves the model's output distribution exactly as it is.

On a tiny float64 model with 8 tokens, the joint distribution of the first generated tokens is
computed exactly (by running the model on every prefix); each method then generates them many
times with fixed seeds, and a chi-square test compares the counts with it. A correct method passes
at a threshold of 1e-3; the same test fails a deliberately wrong rule (the classic mistake of
drawing from p itself after a rejection), so it has the power to catch a biased verifier. Greedy
speculative decoding must equal vanilla greedy token for token (tiny models and the real one).
"""

from collections import Counter

import pytest
import torch
from hypothesis import given, strategies as st

import verify as verify_module
from helpers import chi_square_p_value, random_hf_weights, tiny_hf_config, tiny_model
from methods.combined import CombinedDrafter, SoftTokensOnRoot
from methods.cost_aware import CostAware, Costs
from methods.latency import Latency
from decode import generate
import drafters as drafters_module
from drafters import DraftModelDrafter, NGramDrafter, TrieDrafter, first_layers, logits_after
from methods.recycling import RecyclingDrafter
from methods.medusa import MedusaDrafter, MedusaHeads
from checkpoint import build_model, config_from_hf
from methods.eagle import EagleDrafter, EagleHead
from methods.ppd import PPDDrafter, SoftTokenCosts, SoftTokens, best_dynamic_sparse_tree
from sampling import Sampling, target_probs

VOCAB = 8
LENGTH = 3  # generated tokens whose joint distribution is compared
RUNS = 1000
ALPHA = 1e-3
# top-k and top-p cut tokens to probability 0: a method that shaped p differently from vanilla
# would emit sequences the exact distribution gives probability 0, failing the test outright
SAMPLING = Sampling(temperature=0.8, top_k=6, top_p=0.95)
CONFIG = tiny_hf_config(vocab=VOCAB, max_position_embeddings=64)


@pytest.fixture(scope="module")
def model():
    return tiny_model(0, vocab=VOCAB)


@pytest.fixture(scope="module")
def prompt(model):
    """The model's own greedy text, so n-gram and trie guesses agree with it often."""
    return generate(model, [0], max_new_tokens=15, eos_ids=set()).token_ids


@pytest.fixture(scope="module")
def other_draft():
    """Another checkpoint with the same vocabulary: the model's weights, perturbed by noise."""
    weights = random_hf_weights(CONFIG, seed=0)
    noise = torch.Generator().manual_seed(1)
    weights = {name: w + 0.2 * w.std() * torch.randn(w.shape, generator=noise, dtype=w.dtype)
               for name, w in weights.items()}
    return build_model(config_from_hf(CONFIG), weights, torch.float64)


def exact_joint(model, prompt, sampling, length) -> dict:
    """{first `length` generated tokens: probability}, from the model's p on every prefix (each prefix's
    p computed once: 1 + 8 + 64 passes for three tokens, not three for each of the 512 sequences)."""
    def extend(generated, prob, joint):
        if len(generated) == length:
            joint[tuple(generated)] = prob
            return joint
        tokens = prompt + generated
        logits, _ = model(torch.tensor([tokens]), positions=torch.arange(len(tokens)))
        p = target_probs(logits[0, -1], sampling)
        for token in range(VOCAB):
            extend(generated + [token], prob * float(p[token]), joint)
        return joint

    return extend([], 1.0, {})


@pytest.fixture(scope="module")
def joint(model, prompt):
    return exact_joint(model, prompt, SAMPLING, LENGTH)


def sampled_counts(model, prompt, drafter, runs=RUNS):
    counts, accepted = Counter(), 0
    for seed in range(runs):
        gen = generate(model, prompt, max_new_tokens=LENGTH, eos_ids=set(), drafter=drafter,
                       sampling=SAMPLING, generator=torch.Generator().manual_seed(seed))
        counts[tuple(gen.token_ids)] += 1
        accepted += gen.counts.guesses_accepted
    return counts, accepted


# top-k guesses: four at distance 1, then fewer; the accuracy table only shapes the sparse tree
ACCURACY = [[0.3, 0.2, 0.15, 0.1], [0.3, 0.2, 0.1, 0.05], [0.3, 0.2, 0.1, 0.05]]


def medusa(model):
    """Heads as Medusa starts them (ResBlocks zero, so every head guesses the next token's top-k),
    plus noise so the heads differ."""
    heads = MedusaHeads(model.config.hidden_size, 3).double()
    torch.manual_seed(0)
    for p in heads.parameters():
        p.data += 0.1 * torch.randn_like(p)
    return MedusaDrafter(model, heads, ACCURACY, inputs=10)


def ppd(model):
    embeddings = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(0),
                             dtype=torch.float64)
    return PPDDrafter(model, SoftTokens(embeddings), best_dynamic_sparse_tree(ACCURACY, 16, 3, 2), ACCURACY)


def eagle(model):
    """An EAGLE head that guesses the next feature is the last one (its fc passes the feature through, its
    layer adds nothing): it guesses again what the model just chose, often right on a tiny vocabulary."""
    head = EagleHead(model.config, torch.arange(model.config.vocab_size)).double()
    D = model.config.hidden_size
    with torch.no_grad():
        head.fc.weight.copy_(torch.cat([torch.zeros(D, D), torch.eye(D)], dim=1))
        head.fc.bias.zero_()
        head.layer.attention.wo.weight.zero_()
        head.layer.mlp.w_down.weight.zero_()
    return EagleDrafter(model, head.use_lm_head(model.lm_head), inputs=8, depth=2, expand=2, top_k=3)


def cost_aware(make, latency):
    """make(costs)'s drafter, cut by the same costs."""
    costs = SoftTokenCosts(latency)  # (a subclass: the same cuts, and PPD's soft tokens too)
    return CostAware(make(costs), costs)


def drafters(model, other_draft):
    return {
        "anpd": lambda: NGramDrafter(n=3, k=3),
        "lookahead": lambda: TrieDrafter(decoding_length=6, branch_length=3),
        "recycling": lambda: RecyclingDrafter(model.config.vocab_size, 6),
        "speculative-self": lambda: DraftModelDrafter(first_layers(model, 1), gamma=3),
        "speculative-other": lambda: DraftModelDrafter(other_draft, gamma=2),
        "medusa": lambda: medusa(model),
        "ppd": lambda: ppd(model),
        "eagle": lambda: eagle(model),
        # cost-aware (a pass of 4 inputs costs 1.3 of one) and combined: n-grams, trie, soft tokens on the root
        "speculative-cost-aware": lambda: cost_aware(lambda costs: DraftModelDrafter(other_draft, gamma=3, costs=costs),
                                                     Latency({1: 1, 4: 1.3})),
        "auto": lambda: cost_aware(lambda costs: CombinedDrafter(
            [NGramDrafter(n=3, k=3), TrieDrafter(decoding_length=6, branch_length=3)], SoftTokensOnRoot(ppd(model)), costs),
            Latency({1: 1.0, 4: 1.3})),
    }


@pytest.mark.parametrize("method", ["anpd", "lookahead", "recycling", "speculative-self", "speculative-other", "medusa",
                                    "ppd", "eagle", "speculative-cost-aware", "auto"])
def test_sampled_tokens_follow_the_model(model, prompt, joint, other_draft, method):
    counts, accepted = sampled_counts(model, prompt, drafters(model, other_draft)[method]())
    assert accepted > RUNS // 8  # guesses were accepted often, so the verifier was really tested
    assert chi_square_p_value(counts, joint) > ALPHA


def test_vanilla_sampling_passes_the_same_test(model, prompt, joint):
    """The reference itself: plain sampling through the same loop (a sanity check of the test)."""
    counts, _ = sampled_counts(model, prompt, None)
    assert chi_square_p_value(counts, joint) > ALPHA


@pytest.mark.parametrize("method", ["anpd", "recycling", "speculative-other", "ppd", "eagle"])
def test_a_deliberately_wrong_rule_is_caught(model, prompt, joint, other_draft, method, monkeypatch):
    """After a rejection, draw from p instead of the residual: guessed tokens come out too often."""
    monkeypatch.setattr(verify_module, "residual_after_rejection", lambda p, q: p)
    counts, _ = sampled_counts(model, prompt, drafters(model, other_draft)[method]())
    assert chi_square_p_value(counts, joint) < ALPHA


# ---- greedy speculative decoding equals vanilla greedy ---------------------------------------------

def small_model(seed, layers):
    return tiny_model(seed, vocab=16, layers=layers)


@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, 15), min_size=1, max_size=12),
       max_new_tokens=st.integers(1, 40), eos_pick=st.integers(-1, 40), gamma=st.integers(1, 6),
       draft_layers=st.integers(1, 2), separate_draft=st.booleans())
def test_greedy_speculative_equals_vanilla(seed, prompt, max_new_tokens, eos_pick, gamma, draft_layers,
                                           separate_draft):
    model = small_model(seed, layers=3)
    draft = small_model(seed + 10, draft_layers) if separate_draft else first_layers(model, draft_layers)
    free_run = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=set()).token_ids
    eos_ids = {free_run[eos_pick]} if 0 <= eos_pick < len(free_run) else set()
    vanilla = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids)
    gen = generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=eos_ids,
                   drafter=DraftModelDrafter(draft, gamma))
    assert gen.token_ids == vanilla.token_ids
    assert gen.stop_reason == vanilla.stop_reason


@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, 15), min_size=1, max_size=12),
       max_new_tokens=st.integers(2, 30), gamma=st.integers(1, 5), draft_layers=st.integers(1, 2),
       temperature=st.sampled_from([0.0, 0.9]))
def test_a_self_draft_reading_the_loops_cache_guesses_as_with_its_own(seed, prompt, max_new_tokens, gamma,
                                                                      draft_layers, temperature):
    """The model's first layers as a draft read their K/V of the history from the loop's cache: every
    proposal is the one the same draft makes keeping a cache of its own, and it reads only the root
    and its own guesses (gamma tokens a proposal), never the history again."""
    model = small_model(seed, layers=3)
    sampling = Sampling(temperature=temperature)
    proposals, read = {}, {}
    for shares in (True, False):
        draft = first_layers(model, draft_layers)
        draft.early_exit = shares  # (an early exit that is not told so keeps a cache of its own)
        tokens_read, trees = [], []
        drafters_module.logits_after = lambda model, tokens, cache: tokens_read.append(len(tokens)) or logits_after(
            model, tokens, cache)  # a draft step, counted
        try:
            generate(model, prompt, max_new_tokens=max_new_tokens, eos_ids=set(), sampling=sampling,
                     drafter=DraftModelDrafter(draft, gamma), generator=torch.Generator().manual_seed(seed),
                     on_pass=lambda done: trees.append((done.tree.tokens, done.tree.draft_probs)))
        finally:
            drafters_module.logits_after = logits_after
        proposals[shares], read[shares] = trees, tokens_read
    assert [tokens for tokens, _ in proposals[True]] == [tokens for tokens, _ in proposals[False]]
    for (_, shared_q), (_, own_q) in zip(proposals[True], proposals[False]):
        assert (shared_q is None) == (own_q is None)
        if shared_q is not None:
            torch.testing.assert_close(shared_q, own_q)
    assert sum(read[True]) == gamma * len(proposals[True])  # the root and every guess but the last
    assert sum(read[False]) >= len(prompt) + sum(read[True])


def test_a_draft_equal_to_the_model_is_always_accepted():
    """A draft identical to the target: every guess is right, greedy and sampled alike."""
    model = small_model(0, layers=2)
    for sampling in [Sampling(), Sampling(temperature=0.9)]:
        gen = generate(model, [1, 2, 3], max_new_tokens=31, eos_ids=set(), sampling=sampling,
                       drafter=DraftModelDrafter(model, gamma=4), generator=torch.Generator().manual_seed(0))
        assert gen.counts.forward_passes == 1 + 6  # prefill, then 5 tokens (4 guesses + bonus) per pass
        assert gen.counts.rejections == 0


def test_default_model_greedy_speculative_equals_vanilla(default_model, default_tokenizer):
    prompt = default_tokenizer.prompt_ids("Name three colours of the rainbow.", raw=False)
    kwargs = dict(max_new_tokens=40, eos_ids=default_tokenizer.eos_ids)
    vanilla = generate(default_model, prompt, **kwargs)
    for layers, gamma in [(4, 4), (12, 2)]:
        gen = generate(default_model, prompt, drafter=DraftModelDrafter(first_layers(default_model, layers), gamma),
                       **kwargs)
        assert gen.token_ids == vanilla.token_ids
