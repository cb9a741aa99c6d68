"""Self-distillation data: answering many prompts at once with continuous batching decodes each
prompt exactly as decoding it alone would (tiny float64 models, prompts of different lengths, rows
refilled as answers end, the cache's slots moved down, end-of-sequence tokens), stops an answer where
`stop` says, and draws each prompt's sampled answer from p with its own seed; an interrupted file
resumes to what an uninterrupted run writes; the decontamination rule drops prompts that share 13
words with a benchmark prompt; the prompts named held out are those whose answers training holds
out, for the model's answers and for ShareGPT's recorded ones."""

import random
from collections import Counter

import torch

from training import self_distill

from hypothesis import given, settings, strategies as st

from helpers import chi_square_p_value, tiny_model
from decode import generate
from sampling import Sampling, target_probs
from training.self_distill import (STOP_CHECK_EVERY, answer_stream, generate_answers, held_out_prompts, read_records,
                          recorded_answers, split_records, word_ngrams)

VOCAB = 16
MODEL = tiny_model(3, vocab=VOCAB)
WARM = Sampling(temperature=1.5)


@settings(deadline=None)  # the profile's examples: 25 in CI, 500 thorough
@given(prompts=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=10), min_size=1, max_size=8),
       rows=st.integers(1, 4), max_new=st.integers(1, 20), eos=st.sets(st.integers(0, VOCAB - 1), max_size=2))
def test_each_streamed_answer_equals_decoding_its_prompt_alone(prompts, rows, max_new, eos):
    answers = list(answer_stream(MODEL, prompts, max_new, eos, rows=rows))
    assert sorted(index for index, _ in answers) == list(range(len(prompts)))
    for index, answer in answers:
        assert answer == generate(MODEL, prompts[index], max_new_tokens=max_new, eos_ids=eos).token_ids


def test_moving_the_slots_down_changes_no_answer():
    """One row answering 12 prompts in turn fills its cache many times over: every answer must still
    be the one-prompt answer (a row that read a slot it should not, or a start not moved with the
    slots, would differ)."""
    prompts = [[(3 * i + j) % VOCAB for j in range(1 + i % 6)] for i in range(12)]
    for index, answer in answer_stream(MODEL, prompts, 18, set(), rows=2):
        assert answer == generate(MODEL, prompts[index], max_new_tokens=18, eos_ids=set()).token_ids
    # slots moved down while only a short sequence is live must leave room for the longest prompt
    prompts = [[5], list(range(1, 11))]
    for index, answer in answer_stream(MODEL, prompts, 3, set(), rows=1):
        assert answer == generate(MODEL, prompts[index], max_new_tokens=3, eos_ids=set()).token_ids


def test_an_answer_stops_where_stop_says_and_keeps_what_came_before():
    prompts = [[1, 2, 3], [4, 5], [6]]
    asked = []

    def stop(answer):
        asked.append(len(answer))
        return len(answer) >= 2 * STOP_CHECK_EVERY

    for index, answer in answer_stream(MODEL, prompts, 100, set(), rows=2, stop=stop):
        assert answer == generate(MODEL, prompts[index], max_new_tokens=2 * STOP_CHECK_EVERY, eos_ids=set()).token_ids
    assert set(asked) == {STOP_CHECK_EVERY, 2 * STOP_CHECK_EVERY}


def test_a_sampled_answer_does_not_depend_on_the_rows_it_shares():
    prompts = [[i % VOCAB, (5 * i) % VOCAB] for i in range(7)]
    alone = dict(answer_stream(MODEL, prompts, 12, {0}, rows=1, sampling=WARM, seed=5))
    together = dict(answer_stream(MODEL, prompts, 12, {0}, rows=3, sampling=WARM, seed=5))
    assert alone == together
    assert dict(answer_stream(MODEL, prompts, 12, {0}, rows=3, sampling=WARM, seed=6)) != alone


def test_a_sampled_token_is_drawn_from_p():
    """3000 prompts alike, one token each, one seed each: the tokens' counts against p (chi-square)."""
    prompt = [3, 1, 4]
    answers = answer_stream(MODEL, [prompt] * 3000, 1, set(), rows=500, sampling=WARM, seed=11)
    counts = Counter(answer[0] for _, answer in answers)
    with torch.no_grad():
        logits = MODEL.logits(MODEL.hidden_states(torch.tensor([prompt]), positions=torch.arange(3))[0, -1])
    p = target_probs(logits, WARM)
    assert chi_square_p_value(counts, {t: float(p[t]) for t in range(VOCAB)}) > 1e-3


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
    training, held_out = split_records(records, tokenizer, held_out_prompts(tokenizer, prompts))
    prompt_of = {tuple(tokenizer.prompt_ids(p, raw=False)): p for p in prompts}
    named = held_out_prompts(tokenizer, prompts)
    assert sorted(prompt_of[tuple(r["prompt_ids"])] for r in held_out) == sorted(named) and len(named) == 4
    assert not {prompt_of[tuple(r["prompt_ids"])] for r in training} & set(named)


def test_a_file_answering_some_of_the_prompts_holds_out_what_the_whole_sets_file_would(tmp_path):
    """train_prompt.py apar --list-prompts-only answers a subset of the prompts: its records are
    held out by the whole set's rule (a subset's own answer order would hold out others)."""
    lengths = list(range(1, 41))
    random.Random(2).shuffle(lengths)
    prompts = ["ab"[n % 2] * n for n in lengths]
    tokenizer = LengthTokenizer()
    named = held_out_prompts(tokenizer, prompts)
    some = [p for p in prompts if p.startswith("a")]
    records = generate_answers(MODEL, tokenizer, tmp_path / "some.jsonl", some, max_new_tokens=1, batch_size=8)
    training, held_out = split_records(records, tokenizer, named)
    prompt_of = {tuple(tokenizer.prompt_ids(p, raw=False)): p for p in prompts}
    assert sorted(prompt_of[tuple(r["prompt_ids"])] for r in held_out) == sorted(set(named) & set(some))
    assert held_out_prompts(tokenizer, some) != sorted(set(named) & set(some), key=some.index)  # the test can tell
    assert {prompt_of[tuple(r["prompt_ids"])] for r in training} == set(some) - set(named)


def test_an_interrupted_file_resumes_to_what_one_run_writes(tmp_path):
    """Sampled answers, written in answer order as they end (not as they finish): a file cut after 5
    of 9 answers, its last line half written, is finished to the uninterrupted run's file."""
    prompts = ["ab"[n % 2] * n for n in (3, 7, 1, 5, 2, 8, 4, 6, 9)]
    tokenizer = LengthTokenizer()
    straight = generate_answers(MODEL, tokenizer, tmp_path / "one.jsonl", prompts, max_new_tokens=10,
                                batch_size=3, sampling=WARM, seed=2)
    lines = (tmp_path / "one.jsonl").read_text().splitlines(keepends=True)
    assert [len(r["prompt_ids"]) for r in straight] == sorted(map(len, prompts))
    (tmp_path / "cut.jsonl").write_text("".join(lines[:5]) + lines[5][:7])
    assert generate_answers(MODEL, tokenizer, tmp_path / "cut.jsonl", prompts, max_new_tokens=10,
                            batch_size=2, sampling=WARM, seed=2) == straight
    assert read_records(tmp_path / "cut.jsonl") == straight


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
    recorded = [r for r in recorded_answers(tokenizer, prompts, max_new_tokens=20) if r is not None]
    training, held_out = split_records(recorded, tokenizer, held_out_prompts(tokenizer, prompts))
    prompt_of = {tuple(tokenizer.prompt_ids(p, raw=False)): p for p in prompts}
    named = set(held_out_prompts(tokenizer, prompts))
    assert {prompt_of[tuple(r["prompt_ids"])] for r in held_out} == named & set(replies)
    assert {prompt_of[tuple(r["prompt_ids"])] for r in training} == set(replies) - named
    for record in training + held_out:
        reply = tokenizer.encode(replies[prompt_of[tuple(record["prompt_ids"])]])
        assert record["answer_ids"] == (reply + [0])[:20]
