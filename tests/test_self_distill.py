"""Self-distillation data: a batch of left-padded prompts decodes each row exactly as decoding that
prompt alone would (tiny float64 models, prompts of different lengths, end-of-sequence tokens), and
the decontamination rule drops prompts that share 13 words with a benchmark prompt."""

from hypothesis import given, settings, strategies as st

from helpers import tiny_model
from decode import generate
from self_distill import answer_batch, word_ngrams

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
