"""Self-distillation data: a batch of left-padded prompts decodes each row exactly as decoding that
prompt alone would (tiny float64 models, prompts of different lengths, end-of-sequence tokens), and
the decontamination rule drops prompts that share 13 words with a benchmark prompt; the prompts
named held out are those whose answers training holds out, for the model's answers and for
ShareGPT's recorded ones."""

import random

import self_distill

from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from decode import generate
from self_distill import answer_batch, generate_answers, held_out_prompts, recorded_answers, split_records, word_ngrams

VOCAB = 16
MODEL = tiny_model(3, vocab=VOCAB)


@settings(deadline=None, max_examples=15)
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), min_size=1, max_size=5),
       max_new=st.integers(1, 20), eos=st.sets(st.integers(0, VOCAB - 1), max_size=2))
def test_batched_greedy_equals_one_prompt_at_a_time(prompts, max_new, eos):
    batch = answer_batch(MODEL, prompts, max_new, eos)
    for prompt, answer in zip(prompts, batch):
        assert answer == generate(MODEL, prompt, max_new_tokens=max_new, eos_ids=eos).token_ids


def test_thirteen_word_overlap():
    bench = "Compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural experiences."
    copied = "Please: compose an engaging travel blog post about a recent trip to Hawaii, highlighting cultural things"
    reworded = "Write a travel blog post about Hawaii."
    assert word_ngrams(copied) & word_ngrams(bench)
    assert not word_ngrams(reworded) & word_ngrams(bench)


class LengthTokenizer:
    """One token per character: prompts of different lengths have different ids."""
    eos_ids = {0}

    def encode(self, text):
        return [1 + ord(c) % (VOCAB - 1) for c in text]

    def prompt_ids(self, prompt, raw):
        return self.encode(prompt)


def test_the_prompts_named_held_out_are_those_whose_answers_training_holds_out(tmp_path):
    """bench.py apar measures an adapter on held_out_prompts; train_prompt.py trains on what
    split_records keeps. The answer file is written shortest prompt first, not in the prompts' order,
    so the two must agree on the records' order, not on the prompts' indices."""
    lengths = list(range(1, 41))
    random.Random(0).shuffle(lengths)
    prompts = ["ab"[n % 2] * n for n in lengths]
    tokenizer = LengthTokenizer()
    records = generate_answers(MODEL, tokenizer, tmp_path / "answers.jsonl", prompts, max_new_tokens=1, batch_size=8)
    training, held_out = split_records(records)
    prompt_of = {tuple(tokenizer.prompt_ids(p, raw=False)): p for p in prompts}
    named = held_out_prompts(tokenizer, prompts)
    assert sorted(prompt_of[tuple(r["prompt_ids"])] for r in held_out) == sorted(named) and len(named) == 4
    assert not {prompt_of[tuple(r["prompt_ids"])] for r in training} & set(named)


def test_recorded_replies_are_held_out_like_the_models_answers(monkeypatch):
    """ShareGPT's replies are split by the same rule as the model's answers, also when some prompts
    have no reply (their places stay empty until after the split); a reply is cut to the length limit,
    and keeps EOS only when it fits."""
    lengths = list(range(1, 41))
    random.Random(1).shuffle(lengths)
    prompts = ["ab"[n % 2] * n for n in lengths]
    replies = {p: "x" * len(p) for i, p in enumerate(prompts) if i % 3}  # every third prompt has no reply
    monkeypatch.setattr(self_distill, "sharegpt_answers", lambda asked: {p: replies[p] for p in asked if p in replies})
    tokenizer = LengthTokenizer()
    training, held_out = ([r for r in part if r is not None]
                          for part in split_records(recorded_answers(tokenizer, prompts, max_new_tokens=20)))
    prompt_of = {tuple(tokenizer.prompt_ids(p, raw=False)): p for p in prompts}
    named = set(held_out_prompts(tokenizer, prompts))
    assert {prompt_of[tuple(r["prompt_ids"])] for r in held_out} == named & set(replies)
    assert {prompt_of[tuple(r["prompt_ids"])] for r in training} == set(replies) - named
    for record in training + held_out:
        reply = tokenizer.encode(replies[prompt_of[tuple(record["prompt_ids"])]])
        assert record["answer_ids"] == (reply + [0])[:20]
