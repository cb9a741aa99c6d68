"""APAR's fine-tuning (apar_finetune.py): the data rules cut answers as appendix B says, the training
layout hides details from each other and never teaches [Child], and training lowers the loss while the
merged adapter computes what the hooked training model did."""

from collections import Counter

import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings, strategies as st

from training import apar_finetune
from methods.apar import ControlTokens
from methods.apar import ADAPTABLE_LINEARS, ADAPTED_LINEARS, adapted_in, apply_adapter
from training.apar_finetune import (IGNORE, AparAdapter, apar_logits, before_the_loop, line_key, repetitive,
                           structure, training_example, word_grams)
from helpers import cheap, random_model, scripted_apar, tiny_hf_config, tiny_model

EOS = 2
CONTROL = ControlTokens(fork=5, child=6)


# ---- the data rules (appendix B) ----------------------------------------------------------------

LIST_ANSWER = """Here are some tips:

1. **Water regularly:** Plants need water every day to grow well.
2. Sunlight: Put them near a window so they get light.
3. Soil: Use rich soil with compost in it.

Good luck!"""



def test_held_out_lists_are_those_no_adapter_trained_on(monkeypatch):
    """Adapters trained on 4 prompts and on 6 (the first 4 and two more) are compared on list-style
    prompts that one of them held out and neither trained on."""
    prompt_sets = {4: ["List a", "List b", "List c", "prose d"], 6: ["List a", "List b", "List c", "prose d", "List e", "List f"]}
    kept_out = {4: ["List a", "prose d"], 6: ["List b", "List e"]}
    monkeypatch.setattr(apar_finetune, "apar_prompts", lambda records, tokenizer, max_prompt_tokens: prompt_sets[records])
    monkeypatch.setattr(apar_finetune, "held_out_prompts", lambda tokenizer, prompts: kept_out[len(prompts)])
    assert apar_finetune.held_out_list_prompts(None, [(4, 64)]) == ["List a"]  # "prose d" asks for no list
    assert apar_finetune.held_out_list_prompts(None, [(6, 64)]) == ["List b", "List e"]
    # "List a" trained the second, "List b" the first
    assert apar_finetune.held_out_list_prompts(None, [(4, 64), (6, 64)]) == ["List e"]


def test_an_ordered_list_becomes_roots_and_details():
    shape = structure(LIST_ANSWER)
    assert shape.kind == "list"
    assert [p.root for p in shape.points] == ["Here are some tips:\n\n1. **Water regularly:**", "\n2. Sunlight:",
                                              "\n3. Soil:"]
    assert shape.points[1].detail == " Put them near a window so they get light."  # the separator moved on
    assert shape.tail == "\n\nGood luck!"
    assert shape.text() == LIST_ANSWER


def test_points_without_a_colon_have_their_first_words_as_root_and_bullets_count():
    answer = ("Benefits:\n- Better sleep comes with regular exercise.\n- Stronger bones and joints over time.\n"
              "- A calmer mind through the whole day.\n")
    shape = structure(answer)
    assert shape.kind == "list"
    assert [p.root for p in shape.points] == ["Benefits:\n- Better sleep comes", "\n- Stronger bones and",
                                              "\n- A calmer mind"]
    assert shape.points[0].detail == " with regular exercise." and shape.tail == "\n"
    assert shape.text() == answer


@pytest.mark.parametrize("answer, kind_if_loops_allowed", [
    ("Here are some:\n\n1. Dr. Anna Karp writes well.\n2. Dr. Anna Karp writes well.\n3. Dr. Anna Karp writes well.\n"
     "4. Dr. Anna Karp writes well.", "list"),
    ("It is good. " + "It is good because it is good and it is good for you. " * 6, "unstructured"),
])
def test_answers_that_loop_are_set_apart(answer, kind_if_loops_allowed):
    assert structure(answer).kind == "repetitive"
    assert structure(answer, loops_allowed=True).kind == kind_if_loops_allowed  # (bench.py: had it points?)



LINES = ["Water the plants every day.", "Give them light.", "1. Soil: use rich soil with compost in it.",
         "- Give them light.", "It is good because it is good and it is good for you.", "", "Good luck!",
         "Plants need water and light to grow well at home.", "So plants need water and light to grow well, you see.",
         "Plants need water and light to grow well, they say."]  # the last three share 8 words


def loop_begun(text: str, answer: str) -> bool:
    """A line of `text` repeats an earlier one (markers aside), or `text` holds twice some 8 words
    that `answer` holds 3 times or more."""
    keys = [line_key(line) for line in text.splitlines() if line.strip()]
    in_answer, in_text = (Counter(gram for _, gram in word_grams(t)) for t in (answer, text))
    return len(set(keys)) < len(keys) or any(in_text[g] >= 2 and in_answer[g] >= 3 for g in in_text)


@cheap
@given(lines=st.lists(st.sampled_from(LINES), max_size=12), tail=st.sampled_from(["", "\n", "\n\n"]))
def test_before_the_loop_is_the_longest_run_of_whole_lines_before_a_loop_begins(lines, tail):
    answer = "\n".join(lines) + tail
    before = before_the_loop(answer)
    assert answer.startswith(before) and not loop_begun(before, answer) and not repetitive(before)
    rest = answer[len(before):]
    assert before == "" or before.endswith("\n") or rest == ""  # whole lines only
    if rest.strip():  # one more line and the loop has begun
        assert loop_begun(before + rest.splitlines(keepends=True)[0], answer)


def test_a_looping_answer_trains_on_the_list_it_wrote_before_the_loop():
    tok = CharTokenizer()
    answer = ("Tips:\n1. Aa: first detail!\n2. Bb: second one!!\n3. Cc: third thing.\n4. Dd: fourth one.\n"
              + "5. Dd: fourth one.\n" * 4)
    assert structure(answer).kind == "repetitive"
    example = training_example([7], tok.encode(answer) + [EOS], tok, CONTROL)
    forks = [i for i, t in enumerate(example.tree.tokens) if t == CONTROL.fork]
    assert example.kind == "list" and len(forks) == 3  # points 1-3: the 4th goes, as in a cut answer
    assert "Dd" not in tok.decode([t for t in example.tree.tokens if t >= 10])
    assert example.labels[forks[-1]] == IGNORE  # the parent learns no end: the answer never ended well
    looping_prose = "It is good. " + "It is good because it is good and it is good for you. " * 6
    assert training_example([7], tok.encode(looping_prose) + [EOS], tok, CONTROL).kind == "repetitive"


def test_paragraphs_split_at_their_first_sentence():
    answer = ("Paris is the capital of France. It is known for its museums.\n\n"
              "One line only here.\n\n"
              "The city has many cafes. People enjoy sitting outside!\n\nVisit soon.")
    shape = structure(answer)
    assert shape.kind == "paragraphs"
    assert [p.root for p in shape.points] == ["Paris is the capital of France.",
                                              "\n\nOne line only here.\n\nThe city has many cafes."]
    assert shape.points[0].detail == " It is known for its museums."
    assert shape.tail == "\n\nVisit soon."
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
    assert labels[forks[0]] == tree.tokens[second_root] == tok.encode("\n")[0]  # after [Fork]: the separator, then "2."
    assert not mask[second_root, children[0]] and mask[second_root, forks[0]]  # roots never see details



def test_a_cut_answer_drops_its_last_point_and_learns_no_end():
    tok = CharTokenizer()
    answer = "1. Aa: first detail!\n2. Bb: second one!!\n3. Cc: third thing.\n4. Dd: cut off her"
    example = training_example([7], tok.encode(answer), tok, CONTROL)
    assert sum(t == CONTROL.fork for t in example.tree.tokens) == 3
    last_fork = max(i for i, t in enumerate(example.tree.tokens) if t == CONTROL.fork)
    assert example.labels[last_fork] == IGNORE  # what the parent wrote next is unknown



def test_min_points_keeps_trees_with_enough_points_and_negatives_in_their_share():
    """--min-points counts the points a tree trains (a cut answer has lost its last), and the
    unstructured negatives are sized to the structured examples kept."""
    tok = CharTokenizer()
    points = "".join(f"{n}. P{n}: detail number {n}.\n" for n in range(1, 6))
    records = [{"prompt_ids": [7], "answer_ids": tok.encode(text) + ([] if cut else [EOS])} for text, cut in [
        (points, False),  # 5 points
        (points, True),  # cut off: 4 trained
        ("".join(points.splitlines(keepends=True)[:3]), False),  # 3 points
        ("x = 1 + 2\n", False), ("y = 3 * 4\n", False), ("z = 5 / 6\n", False)]]  # unstructured
    examples = apar_finetune.apar_examples(records, tok, CONTROL, unstructured_share=1.0, min_points=4)
    assert [(e.kind, e.points) for e in examples] == [("list", 5), ("list", 4), ("unstructured", 0), ("unstructured", 0)]
    assert len(apar_finetune.apar_examples(records, tok, CONTROL, min_points=0)) == 6


def test_an_adapter_continued_from_starts_where_it_ended():
    """--from-adapter: start_from takes a trained adapter's tensors as they were saved."""
    model = random_model(tiny_hf_config(vocab=160, tied=True), seed=4)
    trained = AparAdapter(model, CONTROL, rank=4, seed=0)
    with torch.no_grad():
        for parameter in trained.parameters():
            parameter.add_(torch.randn_like(parameter))
    continued = AparAdapter(model, CONTROL, rank=4, seed=1)
    continued.start_from(trained.tensors())
    assert all(torch.equal(continued.tensors()[name], tensor) for name, tensor in trained.tensors().items())


@pytest.mark.parametrize("adapted", [ADAPTED_LINEARS, ADAPTABLE_LINEARS, ("mlp.w_down",)])
def test_training_lowers_the_loss_and_the_merged_adapter_computes_what_training_did(adapted):
    """A few steps of train_prompt.py's APAR loss on one hand-made tree lower it; then apply_adapter
    (W += up @ down for the projections the adapter has, control rows set) gives the logits the hooked
    training model gave, whichever projections were adapted (--adapt)."""
    tok = CharTokenizer()
    model = random_model(tiny_hf_config(vocab=160, tied=True), seed=4)
    model.requires_grad_(False)
    example = training_example([7, 8], tok.encode("1. Aa: first detail!\n2. Bb: second one!!\n3. Cc: third.\n")
                               + [EOS], tok, CONTROL)
    adapter = AparAdapter(model, CONTROL, rank=4, seed=0, adapted=adapted).double()
    assert {name.split(".", 2)[2] for name in adapter.names} == set(adapted) == set(adapted_in(adapter.tensors()))
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=1e-2)
    handles = adapter.attach(model)
    losses = []
    for _ in range(8):
        loss = torch.nn.functional.cross_entropy(*apar_logits(model, adapter, CONTROL, [example]))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    with torch.no_grad():
        trained, _ = apar_logits(model, adapter, CONTROL, [example])
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



# ---- flatten -> RESTORE: the training format and the engine agree, byte for byte ---------------

WORDS = ["plants", "need", "water", "light", "café", "naïve", "soil", "grow", "well", "every", "day", "42", "—", "(see)"]
word_run = st.lists(st.sampled_from(WORDS), min_size=2, max_size=7).map(" ".join)
sentence = word_run.map(lambda words: words[0].upper() + words[1:] + ".")


@st.composite
def answers(draw):
    """Answers shaped like the default model's: a preamble, numbered or bulleted points whose root is
    "**Root:**", "Root:" or just their first words, one or two newlines between points, a tail; or
    paragraphs of one to three sentences."""
    if draw(st.booleans()):
        style, gap = draw(st.sampled_from(["**{}:**", "{}:", "{}"])), draw(st.sampled_from(["\n", "\n\n"]))
        points = []
        for number in range(1, draw(st.integers(3, 5)) + 1):
            marker = draw(st.sampled_from([f"{number}.", "-"]))
            points.append(f"{marker} {style.format(draw(word_run))} {draw(sentence)} {draw(sentence)}")
        preamble = draw(st.sampled_from(["", "Here are some tips:\n\n", "Sure!\n"]))
        return preamble + gap.join(points) + draw(st.sampled_from(["", "\n", "\n\nGood luck!"]))
    paragraphs = [" ".join(draw(st.lists(sentence, min_size=1, max_size=3))) for _ in range(draw(st.integers(2, 4)))]
    return "\n\n".join(paragraphs)


def scripted_threads(example):
    """What each thread of `example`'s tree writes next, keyed by the thread's whole sequence."""
    tree, script = example.tree, {}
    for node, label in enumerate(example.labels):
        if label != IGNORE:
            sequence, at = [], node
            while at >= 0:
                sequence.append(tree.tokens[at])
                at = tree.parents[at]
            script[tuple(reversed(sequence))] = label
    return script


@settings(deadline=None, max_examples=40, suppress_health_check=[HealthCheck.too_slow])
@given(answer=answers())
def test_flatten_then_restore_gives_the_answer_back_byte_for_byte(default_tokenizer, answer):
    """Cut an answer into a paragraph tree by the data rules (as training does), let the engine run
    the threads writing exactly what the tree says, and RESTORE: the real tokenizer decodes the
    original string, separators included (no glued points, no doubled newlines)."""
    tok = default_tokenizer
    control = ControlTokens.of(tok)
    eos = min(tok.eos_ids)
    shape = structure(answer)
    assume(shape.kind in ("list", "paragraphs"))
    example = training_example([1, 2, 3], tok.encode(answer) + [eos], tok, control)
    script = scripted_threads(example)
    model = tiny_model(0, vocab=49152, max_positions=1024, layers=1)
    gen = scripted_apar(lambda logits, thread: script[tuple(thread.tokens)], model, [1, 2, 3], control,
                        max_new_tokens=len(example.tree), eos_ids={eos})
    assert gen.stop_reason == "eos" and gen.threads == 1 + len(shape.points)
    assert tok.decode(gen.token_ids) == answer


def test_a_bfloat16_step_is_the_float32_step_to_bfloat16_precision():
    """train_prompt.py --precision bfloat16: the forward pass's products run in bfloat16 (the loss is
    not float32's to the last bit) while weights and gradients stay float32, and the gradient points
    where float32's does."""
    from train_prompt import apar_loss
    tok = CharTokenizer()
    model = random_model(tiny_hf_config(vocab=160, tied=True), seed=4).float()
    model.requires_grad_(False)
    example = training_example([7, 8], tok.encode("1. Aa: first detail!\n2. Bb: second one!!\n") + [EOS], tok, CONTROL)
    adapter = AparAdapter(model, CONTROL, rank=4, seed=0)
    # seeded: drawn from the global generator, the test passed or failed by what earlier tests drew
    # (cosine 0.967 once; 0.990-0.999 over seeds 0-29 of this generator)
    torch.nn.init.normal_(adapter.up["layers_0_attention_wo"], std=0.1, generator=torch.Generator().manual_seed(0))
    handles = adapter.attach(model)
    gradients, losses = {}, {}
    for precision in ("float32", "bfloat16"):
        adapter.zero_grad()
        loss = apar_loss(model, adapter, CONTROL, [example], precision)
        loss.backward()
        losses[precision] = loss.item()
        gradients[precision] = torch.cat([p.grad.flatten() for p in adapter.parameters()])
        assert loss.dtype == torch.float32 and all(p.grad.dtype == torch.float32 for p in adapter.parameters())
    for handle in handles:
        handle.remove()
    assert losses["bfloat16"] != losses["float32"]
    assert abs(losses["bfloat16"] - losses["float32"]) < 0.02 * losses["float32"]
    assert torch.nn.functional.cosine_similarity(gradients["float32"], gradients["bfloat16"], dim=0) > 0.98
