"""The quality measures of bench.py apar (apar_quality.py): the count of points a prompt asks for, the
points an answer delivers, and the base model's likelihood of an answer."""

import math

import pytest
import torch

from methods.apar_quality import answer_nll, delivered_points, perplexity, requested_points
from helpers import full_logits, tiny_model


@pytest.mark.parametrize("prompt, count", [
    ("Give me five tips for learning a new language.", 5),
    ("List 3 simple ways to save energy at home", 3),
    ("What are the top 10 places to visit in Japan?", 10),
    ("Suggest seven creative names for a bakery.", 7),
    ("Write two short examples of a haiku", 2),
    ("What are some tips for learning a new language?", None),  # no count
    ("Explain the causes of the 1929 crash in 3 paragraphs.", None),  # paragraphs are not points
    ("I have 2 cats. Give me tips for their diet.", None),  # the count is of something else
    ("Give me 1 tip.", None),  # one point is not a list
])
def test_requested_points_reads_the_count_of_list_items(prompt, count):
    assert requested_points(prompt) == count


def test_delivered_points_counts_top_level_points_only():
    numbered = "Here you go:\n\n1. **Read**: daily.\n   - even a page\n2. Listen.\n- a stray bullet\n3. Speak.\n"
    assert delivered_points(numbered) == 3  # bullets under numbered points are details
    assert delivered_points("- one\n- two\n  - detail\n* three\n") == 3
    assert delivered_points("No list here, though 1. appears mid-line.") == 0
    assert delivered_points("1.5 is a number, not a point\n2.Nope") == 0


def test_answer_nll_is_the_models_own_next_token_loss():
    model = tiny_model(4)
    prompt, answer = [3, 5, 7], [2, 9, 11, 4]
    logits = full_logits(model, prompt + answer)  # [7, V]
    expected = [-torch.log_softmax(logits[len(prompt) - 1 + i], -1)[token].item() for i, token in enumerate(answer)]
    assert answer_nll(model, prompt, answer) == pytest.approx(expected, rel=1e-9)
    assert answer_nll(model, prompt, []) == []
    assert perplexity([1.0, 3.0]) == pytest.approx(math.e ** 2) and perplexity([]) is None
