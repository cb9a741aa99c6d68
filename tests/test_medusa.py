"""Medusa heads (medusa.py): greedy Medusa equals vanilla greedy token for token on random tiny float64
models with random heads, and on the default model with the shipped heads; training lowers the loss.
(Sampling with Medusa: test_sampling_decode.py; the sparse tree: test_tree.py.)"""

import random

import torch
from hypothesis import given, settings, strategies as st

from methods import artifacts
from backends.cpu_kernels import Linear
from methods import medusa
from decode import generate
from helpers import (assert_equals_vanilla_greedy, assert_shipped_guesser_equals_vanilla, random_accuracy,
                      self_distilled_record, tiny_model)
from methods.medusa import MedusaDrafter, MedusaHeads, load_drafter, medusa_accuracy, medusa_loss
from train_prompt import answer_features

VOCAB = 16


def random_medusa(model, seed, heads, rows):
    torch.manual_seed(seed)
    medusa = MedusaHeads(model.config.hidden_size, heads).double()
    for p in medusa.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return MedusaDrafter(model, medusa, random_accuracy(random.Random(seed), heads, 4), rows)


@settings(deadline=None)
@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_new=st.integers(1, 40), eos=st.sets(st.integers(0, VOCAB - 1), max_size=2),
       size=st.integers(1, 3), rows=st.integers(2, 24), drafter_seed=st.integers(0, 10**6))
def test_medusa_equals_vanilla_greedy(seed, prompt, max_new, eos, size, rows, drafter_seed):
    model = tiny_model(seed, vocab=VOCAB, max_positions=96)
    drafter = random_medusa(model, drafter_seed, size, rows)
    assert_equals_vanilla_greedy(model, prompt, max_new, eos, drafter)


def test_shipped_heads_equal_vanilla_on_the_default_model(default_model, default_tokenizer):
    drafter = load_drafter(default_model, artifacts.SHIPPED / "medusa-SmolLM2-135M-Instruct", 12)
    assert_shipped_guesser_equals_vanilla(default_model, default_tokenizer, drafter)


def test_medusa_training_lowers_the_loss():
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    hidden, targets = answer_features(model, [self_distilled_record(model, s, VOCAB) for s in range(4)])
    heads = MedusaHeads(model.config.hidden_size, 2).double()
    optimizer = torch.optim.Adam(heads.parameters(), lr=0.01)
    before = medusa_loss(model, heads, hidden, targets).item()
    for _ in range(40):
        loss = medusa_loss(model, heads, hidden, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.7 * before
    accuracy = medusa_accuracy(model, heads, hidden, targets)
    assert len(accuracy) == 2 and all(0 <= a <= 1 for row in accuracy for a in row)



def test_the_heads_guess_within_the_shortlist_and_lose_nothing_else(monkeypatch):
    """While decoding the heads rank the vocabulary's first SHORTLIST tokens only: each head's top-k
    is the top-k of its full logits among those tokens, and the output is still vanilla's."""
    monkeypatch.setattr(medusa, "SHORTLIST", VOCAB // 2)
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    drafter = random_medusa(model, 1, 3, 8)
    seen = []
    generate(model, [1, 2, 3], max_new_tokens=30, eos_ids=set(), drafter=drafter,
             on_pass=lambda done: seen.append((done.last_hidden(), [list(c) for c in drafter.candidates])))
    for hidden, candidates in seen:
        full = drafter.heads(hidden, model.lm_head)  # [K, V]
        expected = full[:, :VOCAB // 2].topk(len(candidates[0]), dim=-1).indices.tolist()
        assert candidates == expected
    assert_equals_vanilla_greedy(model, [1, 2, 3], 30, set(), random_medusa(model, 1, 3, 8))


def test_the_shortlist_takes_the_lm_heads_measured_kernels():
    """The shortlist is a prefix of the LM head's rows, as wide: it multiplies with the kernels this CPU
    measured fastest for the LM head's few rows (not the default, which on a CPU where another kernel
    won took twice as long for the heads' rows)."""
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    model.lm_head.__class__ = Linear  # as the fused and compiled backends give it (cpu_kernels.use_kernels)
    model.lm_head.picks = {1: "numba", 2: "F.linear", 3: "mv"}  # as prepare_kernels may set them
    head = medusa.shortlist_head(model.lm_head, VOCAB // 2)
    assert [head.kernel(torch.device("cpu"), torch.float32, rows) for rows in (1, 2, 3)] == ["numba", "F.linear", "mv"]
    assert torch.equal(head.weight, model.lm_head.weight[:VOCAB // 2]) and model.lm_head.out_features == VOCAB
