"""APAR's fine-tuning (apar_finetune.py): the data rules cut answers as appendix B says, the training
layout hides details from each other and never teaches [Child], and training lowers the loss while the
merged adapter computes what the hooked training model did."""

import pytest
import torch

from apar import ControlTokens
from apar_finetune import IGNORE, AparAdapter, apar_logits, apply_adapter, structure, training_example
from helpers import random_model, tiny_hf_config

EOS = 2
CONTROL = ControlTokens(fork=5, child=6)


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



def test_training_lowers_the_loss_and_the_merged_adapter_computes_what_training_did():
    """A few steps of train_prompt.py's APAR loss on one hand-made tree lower it; then apply_adapter
    (W += up @ down, control rows set) gives the logits the hooked training model gave."""
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

