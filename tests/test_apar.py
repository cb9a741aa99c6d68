"""APAR (apar.py, apar_data.py): the engine computes what the paper's attention semantics say, the
paragraph tree restores in root - first child - next sibling order, the cache frees and reuses the
slots of finished threads, and the data rules cut answers as appendix B says."""

import json
import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import apar
from apar import ControlTokens, Paragraph, SlotCache, generate_apar, restore
from apar_data import IGNORE, structure, training_example
from conftest import random_model, tiny_hf_config
from model import causal_mask

VOCAB, EOS = 64, 2
CONTROL = ControlTokens(fork=5, child=6)
MODELS = {}


def tiny_model(seed):
    if seed not in MODELS:
        MODELS[seed] = random_model(tiny_hf_config(vocab=VOCAB), seed=seed)
    return MODELS[seed]


def alone(model, tokens: list[int]) -> torch.Tensor:
    """The logits after `tokens`, run through the plain model on their own (no cache, causal)."""
    hidden = model.hidden_states(torch.tensor([tokens]), positions=torch.arange(len(tokens)),
                                 mask=causal_mask(0, len(tokens), "cpu"))
    return model.logits(hidden[0, -1])


class Script:
    """Chooses tokens at random: [Fork] with probability `fork`, EOS with probability `stop` (after a
    thread's first few tokens), else an ordinary token; records what each thread saw."""

    def __init__(self, seed, fork=0.2, stop=0.1):
        self.rng, self.fork, self.stop = random.Random(seed), fork, stop
        self.seen = []  # (the thread's whole sequence, the logits the engine computed after it)

    def __call__(self, logits, thread):
        self.seen.append((list(thread.tokens), logits.clone()))
        draw = self.rng.random()
        if draw < self.fork:
            return CONTROL.fork
        if draw < self.fork + self.stop and len(thread.paragraph.tokens) > 1:
            return EOS
        return self.rng.choice(range(7, VOCAB))


@given(seed=st.integers(0, 3), script_seed=st.integers(0, 10**6), prompt_length=st.integers(1, 6))
def test_every_thread_sees_exactly_its_own_sequence(seed, script_seed, prompt_length):
    """Section 2.2: a token attends to its ancestors only. So each thread's logits, computed with
    the others in one batched pass over a shared cache, equal those of its own sequence (prompt,
    the paragraphs it descends from, a forced [Child], its own tokens) run alone."""
    model = tiny_model(seed)
    prompt = random.Random(script_seed).choices(range(7, VOCAB), k=prompt_length)
    script = Script(script_seed)
    gen = generate_apar(model, prompt, CONTROL, max_new_tokens=40, eos_ids={EOS}, choose=script)
    assert len(script.seen) == gen.tokens_sampled
    for tokens, logits in script.seen:
        torch.testing.assert_close(logits, alone(model, tokens), rtol=0, atol=1e-9)
    forks_followed = sum(tokens[-1] == CONTROL.fork for tokens, _ in script.seen)
    assert gen.threads == 1 + forks_followed


def test_a_fork_starts_a_child_with_child_token_and_shared_prefix():
    model = tiny_model(0)
    root_says, child_says = iter([10, CONTROL.fork, 11, 12, EOS]), iter([20, 21, EOS])
    seen = []

    def choose(logits, thread):
        seen.append(list(thread.tokens))
        return next(child_says if CONTROL.child in thread.tokens else root_says)

    gen = generate_apar(model, [7, 8], CONTROL, max_new_tokens=20, eos_ids={EOS}, choose=choose)
    assert gen.threads == 2 and gen.stop_reason == "eos"
    child_sequences = [s for s in seen if CONTROL.child in s]
    assert child_sequences[0] == [7, 8, 10, CONTROL.fork, CONTROL.child]
    # restored: root paragraph "10 [Fork]", its first child "[Child] 20 21 EOS", then "11 12 EOS"
    assert gen.token_ids == [10, 20, 21, 11, 12]


def random_paragraph_tree(draw_shape, counter):
    """A paragraph tree from a nested shape: (own token count, child shape or None, sibling shape or None)."""
    count, child, sibling = draw_shape
    node = Paragraph([next(counter) for _ in range(count)])
    node.first_child = child and random_paragraph_tree(child, counter)
    node.next_sibling = sibling and random_paragraph_tree(sibling, counter)
    return node


shapes = st.recursive(st.tuples(st.integers(0, 3), st.none(), st.none()),
                      lambda inner: st.tuples(st.integers(0, 3), st.none() | inner, st.none() | inner),
                      max_leaves=30)


@given(shape=shapes)
def test_restore_is_root_then_first_child_then_next_sibling(shape):
    root = random_paragraph_tree(shape, iter(range(10**6)))

    def reference(node):
        if node is None:
            return []
        return node.tokens + reference(node.first_child) + reference(node.next_sibling)

    assert restore(root) == reference(root)


def test_finished_threads_give_back_their_slots_for_reuse(monkeypatch):
    """After every step the slots in use are exactly those some live thread attends to, the peak is
    the largest of these, and a slot freed by a finished child is taken again by a later token."""
    model = tiny_model(1)
    plain_step, observed, observed_cache = apar.step, [], []

    def checked_step(model, cache, live, out):
        logits = plain_step(model, cache, live, out)
        needed = set().union(*(thread.slots for thread in live))
        observed.append((cache.in_use, len(needed)))
        observed_cache[:] = [cache]
        return logits

    monkeypatch.setattr(apar, "step", checked_step)
    # root: 10 [Fork] 11 [Fork] 12 ... ; each child writes two tokens then EOS
    def choose(logits, thread):
        own = thread.paragraph.tokens
        if own[:1] == [CONTROL.child]:  # a child (children never fork here, so this is its only paragraph)
            return EOS if len(own) >= 3 else 30
        return CONTROL.fork if len(thread.tokens) % 2 == 0 else 10

    prompt = [7, 8, 9]
    gen = generate_apar(model, prompt, CONTROL, max_new_tokens=30, eos_ids={EOS}, choose=choose)
    cache = observed_cache[0]
    assert all(in_use == needed for in_use, needed in observed)
    assert gen.max_cached_tokens == max(in_use for in_use, _ in observed)
    fed = len(prompt) + gen.tokens_fed
    assert cache.length < fed  # slots were reused: fewer distinct slots than tokens ever cached
    assert gen.max_cached_tokens < fed


def test_slots_are_all_free_when_every_thread_ended(monkeypatch):
    model = tiny_model(2)
    caches, plain_allocate = [], SlotCache.allocate

    def allocate(cache, count):
        caches.append(cache)
        return plain_allocate(cache, count)

    monkeypatch.setattr(SlotCache, "allocate", allocate)
    gen = generate_apar(model, [9, 10], CONTROL, max_new_tokens=400, eos_ids={EOS},
                        choose=Script(7, fork=0.15, stop=0.4))
    assert gen.stop_reason == "eos" and gen.threads > 2
    assert caches[-1].in_use == 0


def test_the_default_chooser_never_writes_child_and_respects_the_budget():
    model = tiny_model(3)
    with torch.no_grad():  # make [Child] the model's favourite everywhere
        model.lm_head.weight[CONTROL.child] = model.lm_head.weight[CONTROL.child] * 0 + 50
    try:
        gen = generate_apar(model, [7, 8], CONTROL, max_new_tokens=12, eos_ids={EOS})
    finally:
        MODELS.pop(3)
    assert CONTROL.child not in gen.token_ids
    assert gen.tokens_sampled <= 12


def test_apar_statistics_compare_with_the_flattened_answer():
    gen = apar.AparGeneration(token_ids=list(range(10)), stop_reason="eos", threads=3, forward_passes=5,
                              tokens_sampled=13, max_cached_tokens=14, attended_tokens=60, tokens_fed=12,
                              decode_seconds=1.0)
    stats = apar.statistics(gen, prompt_length=6)
    assert stats["flattened_max_cached_tokens"] == 16
    assert stats["flattened_attended_tokens"] == 6 + 5.5
    assert stats["attended_tokens"] == 5.0 and stats["parallel"] and stats["tokens_per_pass"] == 2.0


# ---- the data rules (appendix B) ----------------------------------------------------------------

LIST_ANSWER = """Here are some tips:

1. **Water regularly:** Plants need water every day to grow well.
2. Sunlight: Put them near a window so they get light.
3. Soil: Use rich soil with compost in it.

Good luck!"""


def test_an_ordered_list_becomes_roots_and_details():
    shape = structure(LIST_ANSWER)
    assert shape.kind == "list"
    assert [p.root for p in shape.points] == ["Here are some tips:\n\n1. **Water regularly:**", "2. Sunlight:",
                                              "3. Soil:"]
    assert shape.points[1].detail == " Put them near a window so they get light.\n"
    assert shape.tail == "Good luck!"
    assert shape.text() == LIST_ANSWER


def test_paragraphs_split_at_their_first_sentence():
    answer = ("Paris is the capital of France. It is known for its museums.\n\n"
              "One line only here.\n\n"
              "The city has many cafes. People enjoy sitting outside!\n\nVisit soon.")
    shape = structure(answer)
    assert shape.kind == "paragraphs"
    assert [p.root for p in shape.points] == ["Paris is the capital of France.",
                                              "One line only here.\n\nThe city has many cafes."]
    assert shape.tail == "Visit soon."
    assert shape.text() == answer


@pytest.mark.parametrize("answer", [
    "Use this:\n\n```python\nprint(1)\n```\n\n1. First: something long enough.\n2. Second: also long enough.\n3. Third: and this one too.",
    "The result is 3 + 4 = 7. So the answer is seven.\n\nCheck it again. It still holds.",
    "See https://example.com for more. It has everything.\n\nAlso look here. There is more.",
    "Just one short paragraph without much structure.",
    "1. A: too short\n2. B: tiny\n3. C: small",  # points under 10 characters, one paragraph of one sentence
])
def test_code_math_urls_and_plain_text_stay_unstructured(answer):
    shape = structure(answer)
    assert shape.kind == "unstructured" and shape.points == [] and shape.tail == answer


class CharTokenizer:
    """One token per character (ids 10+), enough to lay out trees by hand."""
    eos_ids = {EOS}

    def encode(self, text):
        return [10 + ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(i - 10) for i in ids)


def test_the_training_layout_hides_details_from_each_other_and_never_teaches_child():
    tok = CharTokenizer()
    answer = "1. Aa: first detail!\n2. Bb: second one!!\n3. Cc: third thing.\n"
    example = training_example([7, 8], tok.encode(answer) + [EOS], tok, CONTROL)
    tree, labels = example.tree, example.labels
    mask = tree.ancestor_mask()
    forks = [i for i, t in enumerate(tree.tokens) if t == CONTROL.fork]
    children = [i for i, t in enumerate(tree.tokens) if t == CONTROL.child]
    assert example.kind == "list" and len(forks) == len(children) == 3
    assert CONTROL.child not in labels and labels[:1] == [IGNORE]
    for fork, child in zip(forks, children):
        assert tree.parents[child] == fork  # the child hangs under its [Fork]
    def under(node):  # the nodes that descend from `node` (itself included)
        return [i for i in range(len(tree.tokens)) if mask[i, node]]

    for child in children:  # each detail is a chain that ends with EOS to learn
        assert labels[under(child)[-1]] == EOS
    assert not any(mask[i, children[0]] for i in under(children[1]))  # details never see each other
    second_root = next(i for i in range(len(tree.tokens)) if tree.parents[i] == forks[0] and i not in children)
    assert labels[forks[0]] == tree.tokens[second_root] == tok.encode("2")[0]  # after [Fork]: the next point
    assert not mask[second_root, children[0]] and mask[second_root, forks[0]]  # roots never see details


def test_a_cut_answer_drops_its_last_point_and_learns_no_end():
    tok = CharTokenizer()
    answer = "1. Aa: first detail!\n2. Bb: second one!!\n3. Cc: third thing.\n4. Dd: cut off her"
    example = training_example([7], tok.encode(answer), tok, CONTROL)
    assert sum(t == CONTROL.fork for t in example.tree.tokens) == 3
    last_fork = max(i for i, t in enumerate(example.tree.tokens) if t == CONTROL.fork)
    assert example.labels[last_fork] == IGNORE  # what the parent wrote next is unknown


# ---- command line -------------------------------------------------------------------------------

def test_a_missing_adapter_says_how_to_train_one(tmp_path, capsys):
    from decode import main

    code = main(["--method", "apar", "--trained", str(tmp_path / "nothing"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "python train_prompt.py apar" in err and "Traceback" not in err


def test_a_tokenizer_without_control_tokens_is_refused(tmp_path):
    from conftest import write_tiny_tokenizer
    from errors import UserError
    from tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    with pytest.raises(UserError, match="train_prompt.py apar"):
        ControlTokens.of(Tokenizer(tmp_path))


@pytest.mark.parametrize("options, message", [
    (["--acceptance", "typical", "--temperature", "1"], "guesses nothing"),
    (["--show-accepts"], "--show-accepts applies to"),
    (["--tree-rows", "4"], "--tree-rows applies to"),
])
def test_options_that_mean_nothing_for_apar_are_refused(options, message, capsys):
    from decode import main

    assert main(["--method", "apar", "--prompt", "hi", *options]) == 1
    assert message in capsys.readouterr().err


def test_the_shipped_adapter_runs_on_the_default_model(capsys):
    from decode import main

    prompt = "Give me three tips for staying healthy."
    assert main(["--method", "apar", "--prompt", prompt, "--max-new-tokens", "48", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["method"] == "apar" and stats["new_tokens"] > 0 and stats["text"].strip()
    assert stats["forward_passes"] >= 1 and stats["threads"] >= 1
    assert stats["max_cached_tokens"] <= stats["prompt_tokens"] + stats["tokens_sampled"] + stats["threads"]


def test_training_lowers_the_loss_and_the_merged_adapter_computes_what_training_did():
    """A few steps of train_prompt.py's APAR loss on one hand-made tree lower it; then apply_adapter
    (W += up @ down, control rows set) gives the logits the hooked training model gave."""
    from apar import apply_adapter
    from train_prompt import AparAdapter, apar_logits

    tok = CharTokenizer()
    model = random_model(tiny_hf_config(vocab=160, tied=True), seed=4)
    model.requires_grad_(False)
    example = training_example([7, 8], tok.encode("1. Aa: first detail!\n2. Bb: second one!!\n3. Cc: third.\n")
                               + [EOS], tok, CONTROL)
    adapter = AparAdapter(model, CONTROL, rank=4, seed=0).double()
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    handles = adapter.attach(model)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(*apar_logits(model, adapter, CONTROL, example))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        trained, _ = apar_logits(model, adapter, CONTROL, example)
    for handle in handles:
        handle.remove()
    assert losses[-1] < losses[0]

    apply_adapter(model, {k: v.detach() for k, v in adapter.tensors().items()}, CONTROL)
    tree = example.tree
    with torch.no_grad():
        logits, _ = model(torch.tensor([tree.tokens]), positions=torch.tensor(tree.depths),
                          mask=tree.ancestor_mask())
    learned = torch.tensor(example.labels) != IGNORE
    torch.testing.assert_close(logits[0, learned], trained, rtol=0, atol=1e-9)
