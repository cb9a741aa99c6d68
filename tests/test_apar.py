"""APAR's engine (apar.py): it computes what the paper's attention semantics say, the paragraph tree
restores in root - first child - next sibling order, the cache frees and reuses the slots of finished
threads; and `--method apar` on the command line. (The data rules and the adapter:
test_apar_finetune.py.)"""

import contextlib
import io
import json
import random
from collections import Counter

import pytest
import torch
from hypothesis import given, strategies as st

from methods import apar
from methods.apar import ControlTokens, Paragraph, SlotCache, generate_apar, restore
from training.apar_finetune import POINT, repetitive
from programs.cli import main
from drafters import Drafter, NGramDrafter, TrieDrafter
from helpers import cheap, chi_square_p_value, path_to, random_model, scripted_apar, tiny_hf_config, tiny_model
from decode import Counts
from model import causal_mask
from sampling import Sampling, target_probs
from tree import Tree

VOCAB, EOS = 64, 2
CONTROL = ControlTokens(fork=5, child=6)


def model_of(seed):
    return tiny_model(seed, vocab=VOCAB, max_positions=256)


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
    model = model_of(seed)
    prompt = random.Random(script_seed).choices(range(7, VOCAB), k=prompt_length)
    script = Script(script_seed)
    gen = scripted_apar(script, model, prompt, CONTROL, max_new_tokens=40, eos_ids={EOS})
    assert len(script.seen) == gen.tokens_sampled
    for tokens, logits in script.seen:
        torch.testing.assert_close(logits, alone(model, tokens), rtol=0, atol=1e-9)
    forks_followed = sum(tokens[-1] == CONTROL.fork for tokens, _ in script.seen)
    assert gen.threads == 1 + forks_followed


def test_a_fork_starts_a_child_with_child_token_and_shared_prefix():
    model = model_of(0)
    root_says, child_says = iter([10, CONTROL.fork, 11, 12, EOS]), iter([20, 21, EOS])
    seen = []

    def choose(logits, thread):
        seen.append(list(thread.tokens))
        return next(child_says if CONTROL.child in thread.tokens else root_says)

    gen = scripted_apar(choose, model, [7, 8], CONTROL, max_new_tokens=20, eos_ids={EOS})
    assert gen.threads == 2 and gen.stop_reason == "eos"
    child_sequences = [s for s in seen if CONTROL.child in s]
    assert child_sequences[0] == [7, 8, 10, CONTROL.fork, CONTROL.child]
    # restored: root paragraph "10 [Fork]", its first child "[Child] 20 21 EOS", then "11 12 EOS"
    assert gen.token_ids == [10, 20, 21, 11, 12]


@pytest.mark.parametrize("sampling", [Sampling(), Sampling(temperature=1.0)])
def test_a_child_thread_never_forks(sampling):
    """The trees APAR trains on are one level deep, so the verifier takes [Fork] out of a child's
    choices (and [Child] out of every thread's), greedy or sampled; the parent may still fork."""
    logits = torch.zeros(1, VOCAB)
    logits[0, CONTROL.fork], logits[0, 9] = 5.0, 4.0  # [Fork] first, token 9 second
    judge = apar.verifier(CONTROL, sampling, torch.Generator().manual_seed(0))
    parent = apar.Thread([7, 8], [0, 1], Paragraph())
    child = parent.fork(CONTROL.child)
    root_tree, child_tree = Tree.chain(8, []), Tree.chain(CONTROL.child, [])
    parent_says = Counter(judge(root_tree, logits, parent).tokens[0] for _ in range(200))
    child_says = Counter(judge(child_tree, logits, child).tokens[0] for _ in range(200))
    assert CONTROL.fork in parent_says and CONTROL.fork not in child_says and CONTROL.child not in child_says
    if sampling.greedy:
        assert set(child_says) == {9}


def test_the_fork_bias_forks_greedily_wherever_fork_is_within_it_and_never_in_a_child():
    """--fork-bias b: greedy picks [Fork] where its logit + b beats every other token's; a child
    thread still never forks, whatever b; b = 0 is the model as it is."""
    logits = torch.zeros(1, VOCAB)
    logits[0, CONTROL.fork], logits[0, 9] = 4.0, 5.0  # [Fork] one nat below token 9
    parent = apar.Thread([7, 8], [0, 1], Paragraph())
    child = parent.fork(CONTROL.child)

    def says(bias, thread):
        return apar.verifier(CONTROL, Sampling(), None, bias)(Tree.chain(8, []), logits, thread).tokens[0]

    assert [says(bias, parent) for bias in (0.0, 0.9, 1.1, 3.0)] == [9, 9, CONTROL.fork, CONTROL.fork]
    assert says(10.0, child) == 9
    assert logits[0, CONTROL.fork] == 4.0  # the caller's logits are left as they were


def test_sampling_with_a_fork_bias_multiplies_the_odds_of_fork():
    """Sampled, a bias b multiplies [Fork]'s odds against every other token by exp(b) (temperature 1)."""
    logits = torch.full((1, VOCAB), float("-inf"))
    logits[0, CONTROL.fork], logits[0, 9], logits[0, 10] = 0.0, 1.0, 0.5
    bias = 1.5
    odds = torch.exp(logits[0, [CONTROL.fork, 9, 10]] + torch.tensor([bias, 0.0, 0.0]))
    expected = dict(zip([CONTROL.fork, 9, 10], (odds / odds.sum()).tolist()))
    judge = apar.verifier(CONTROL, Sampling(temperature=1.0), torch.Generator().manual_seed(0), bias)
    parent = apar.Thread([7, 8], [0, 1], Paragraph())
    counts = Counter(judge(Tree.chain(8, []), logits, parent).tokens[0] for _ in range(3000))
    assert chi_square_p_value(counts, expected) > 1e-3


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



@cheap  # milliseconds per example
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
    model = model_of(1)
    plain_step, observed, observed_cache = apar.step, [], []

    def checked_step(model, cache, live, trees):
        logits = plain_step(model, cache, live, trees)
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
    gen = scripted_apar(choose, model, prompt, CONTROL, max_new_tokens=30, eos_ids={EOS})
    cache = observed_cache[0]
    assert all(in_use == needed for in_use, needed in observed)
    assert gen.max_cached_tokens == max(in_use for in_use, _ in observed)
    fed = len(prompt) + gen.tokens_fed
    assert cache.length < fed  # slots were reused: fewer distinct slots than tokens ever cached
    assert gen.max_cached_tokens < fed


def test_slots_are_all_free_when_every_thread_ended(monkeypatch):
    model = model_of(2)
    caches, plain_allocate = [], SlotCache.allocate

    def allocate(cache, count):
        caches.append(cache)
        return plain_allocate(cache, count)

    monkeypatch.setattr(SlotCache, "allocate", allocate)
    gen = scripted_apar(Script(7, fork=0.15, stop=0.4), model, [9, 10], CONTROL, max_new_tokens=400, eos_ids={EOS})
    assert gen.stop_reason == "eos" and gen.threads > 2
    assert caches[-1].in_use == 0


def test_the_default_chooser_never_writes_child_and_respects_the_budget():
    model = random_model(tiny_hf_config(vocab=VOCAB), seed=3)  # its own: this test changes it
    with torch.no_grad():  # make [Child] the model's favourite everywhere
        model.lm_head.weight[CONTROL.child] = model.lm_head.weight[CONTROL.child] * 0 + 50
    gen = generate_apar(model, [7, 8], CONTROL, max_new_tokens=12, eos_ids={EOS})
    assert CONTROL.child not in gen.token_ids
    assert gen.tokens_sampled <= 12


def test_apar_statistics_compare_with_the_flattened_answer():
    gen = apar.AparGeneration(token_ids=list(range(10)), stop_reason="eos", threads=3, counts=Counts(forward_passes=5),
                              tokens_sampled=13, max_cached_tokens=14, attended_tokens=60, tokens_fed=12,
                              decode_seconds=1.0)
    stats = apar.statistics(gen, prompt_length=6)
    assert stats["flattened_max_cached_tokens"] == 16
    assert stats["flattened_attended_tokens"] == 6 + 5.5
    assert stats["attended_tokens"] == 5.0 and stats["parallel"] and stats["tokens_per_pass"] == 2.0


# ---- APAR + a guesser ----------------------------------------------------------------------------

def forking_model(seed: int):
    """A tiny float64 model whose greedy threads fork and end now and then: the [Fork] and EOS rows of
    its LM head read one hidden coordinate each, so they win where that coordinate is large."""
    model = random_model(tiny_hf_config(vocab=VOCAB, max_position_embeddings=256), seed=seed)
    with torch.no_grad():
        for token, coordinate in [(CONTROL.fork, 0), (EOS, 1)]:
            model.lm_head.weight[token] = 0
            model.lm_head.weight[token, coordinate] = 3.0
    return model


class Scattershot(Drafter):
    """Random trees over [Fork], [Child], EOS and a few ordinary tokens: mostly wrong, but where the
    model's choice is a control token or EOS, such guesses are accepted in the middle of a path."""

    max_extra_inputs = 6

    def __init__(self, seed: int):
        self.rng = random.Random(seed)

    def propose(self):
        tokens, parents = [self.history[-1]], [-1]
        for _ in range(self.rng.randint(0, self.max_extra_inputs)):
            parents.append(self.rng.randrange(len(tokens)))
            tokens.append(self.rng.choice([CONTROL.fork, CONTROL.child, EOS, 7, 8, 9]))
        return Tree(tokens, parents)


GUESSERS = {"anpd": lambda seed: NGramDrafter(3, 4), "lookahead": lambda seed: TrieDrafter(6, 4),
            "scattershot": Scattershot}


@given(seed=st.integers(0, 7), prompt=st.lists(st.integers(7, VOCAB - 1), min_size=1, max_size=5),
       guesser=st.sampled_from(sorted(GUESSERS)), max_guesses=st.integers(1, 12), draft_seed=st.integers(0, 99),
       fork_bias=st.sampled_from([0.0, 0.5, 2.0]))
def test_guesses_change_the_passes_not_the_answer(seed, prompt, guesser, max_guesses, draft_seed, fork_bias):
    """APAR + a guesser, greedy: every thread writes what it writes without guesses, so an answer whose
    threads all end gives the same restored tokens, threads and tokens chosen in fewer or equal passes
    (the budget may cut threads at other points, as they advance at other speeds; it stops both). With
    a fork bias too: guesses are judged against the biased logits."""
    model = forking_model(seed)
    plain = generate_apar(model, prompt, CONTROL, max_new_tokens=200, eos_ids={EOS}, fork_bias=fork_bias)
    guessed = generate_apar(model, prompt, CONTROL, max_new_tokens=200, eos_ids={EOS}, max_guesses=max_guesses,
                            guesser=lambda: GUESSERS[guesser](draft_seed), fork_bias=fork_bias)
    assert guessed.stop_reason == plain.stop_reason
    if plain.stop_reason == "eos":
        assert guessed.token_ids == plain.token_ids and guessed.threads == plain.threads
        assert guessed.tokens_sampled == plain.tokens_sampled
        assert guessed.counts.forward_passes <= plain.counts.forward_passes
    assert guessed.counts.guesses_accepted <= guessed.counts.guesses_proposed


def test_a_guesser_saves_passes_on_threads_that_fork(monkeypatch):
    """The property above is not vacuous: on these models some threads fork, guesses are accepted
    (a guessed [Fork] among them), passes are saved, and the slots are all free at the end."""
    accepted_forks, caches, plain_allocate = [], [], SlotCache.allocate
    plain_advance = apar.advance

    def advance(thread, verdict, *rest):
        accepted_forks.append(verdict.tokens[:verdict.accepted_guesses].count(CONTROL.fork))
        return plain_advance(thread, verdict, *rest)

    def allocate(cache, count):
        caches.append(cache)
        return plain_allocate(cache, count)

    monkeypatch.setattr(apar, "advance", advance)
    monkeypatch.setattr(SlotCache, "allocate", allocate)
    model = forking_model(3)
    plain = generate_apar(model, [7, 8, 9], CONTROL, max_new_tokens=200, eos_ids={EOS})
    guessed = generate_apar(model, [7, 8, 9], CONTROL, max_new_tokens=200, eos_ids={EOS}, max_guesses=8,
                            guesser=lambda: NGramDrafter(3, 4))
    assert plain.stop_reason == "eos" and plain.threads > 3 and guessed.token_ids == plain.token_ids
    assert guessed.counts.guesses_accepted > 0 and sum(accepted_forks) > 0
    assert guessed.counts.forward_passes < plain.counts.forward_passes
    assert max(guessed.thread_tokens_per_pass) > 1 and caches[-1].in_use == 0


@given(seed=st.integers(0, 3), draft_seed=st.integers(0, 10**6), max_guesses=st.integers(1, 12))
def test_every_guess_sees_exactly_its_threads_sequence_and_its_own_ancestors(seed, draft_seed, max_guesses):
    """With guesses in the pass, a row's logits are those of its thread's sequence followed by the
    guesses on its tree path, run alone: the mask and positions of every thread's tree are right,
    and no slot a thread still attends to was handed to another token."""
    model = forking_model(seed)
    plain_step, rows_seen = apar.step, []

    def recording_step(model, cache, live, trees):
        sequences = [[*thread.tokens[:-1], *(tree.tokens[n] for n in path_to(tree, node))]
                     for thread, tree in zip(live, trees) for node in range(len(tree))]
        fed, attended = plain_step(model, cache, live, trees)
        rows_seen.extend(zip(sequences, torch.cat([logits for _, logits, _ in fed])))
        return fed, attended

    apar.step = recording_step  # (not monkeypatch: hypothesis runs many examples per fixture)
    try:
        generate_apar(model, [7, 8, 9], CONTROL, max_new_tokens=60, eos_ids={EOS}, max_guesses=max_guesses,
                      guesser=lambda: Scattershot(draft_seed))
    finally:
        apar.step = plain_step
    for sequence, logits in rows_seen:
        torch.testing.assert_close(logits, alone(model, sequence), rtol=0, atol=1e-9)


class Contenders(Drafter):
    """Guesses what the model itself finds likely, as a tree: its first choice and that one's first
    choice, beside its second choice. Under exact sampling each is accepted only sometimes, and a lossy
    rule (accepting likely guesses outright, say) would show in the distribution."""

    max_extra_inputs = 3

    def __init__(self, model):
        self.model = model

    def ranked(self, sequence):
        logits = alone(self.model, sequence)
        logits[CONTROL.child] = float("-inf")
        return logits.argsort(descending=True).tolist()

    def propose(self):
        first, second = self.ranked(self.history)[:2]
        return Tree([self.history[-1], first, self.ranked(self.history + [first])[0], second], [-1, 0, 1, 0])


def test_guesses_are_judged_against_the_biased_logits():
    """With --fork-bias, a guess is judged as the token it stands for would be chosen: against the
    biased logits of its parent's row. A guesser that proposes the model's own unbiased first choices
    would otherwise slip them in where the biased rule forks."""
    compared = changed = 0
    for seed in range(8):
        model = forking_model(seed)
        unbiased = generate_apar(model, [7, 8], CONTROL, max_new_tokens=300, eos_ids={EOS})
        plain = generate_apar(model, [7, 8], CONTROL, max_new_tokens=300, eos_ids={EOS}, fork_bias=1.0)
        guessed = generate_apar(model, [7, 8], CONTROL, max_new_tokens=300, eos_ids={EOS}, fork_bias=1.0,
                                guesser=lambda: Contenders(model), max_guesses=3)
        if plain.stop_reason == "eos":  # (a budget cuts threads where they stand, and guesses move them)
            assert (guessed.token_ids, guessed.threads) == (plain.token_ids, plain.threads)
            compared, changed = compared + 1, changed + (plain.threads != unbiased.threads)
    assert compared >= 5 and changed  # the bias changed where some answer forks


def test_sampling_with_guesses_keeps_each_threads_distribution():
    """Exact speculative sampling per thread: the root thread's first three tokens (up to an EOS),
    sampled with guesses in the pass, follow the model's own distribution (enumerated: top-3
    sampling, [Child] excluded as the engine excludes it)."""
    model, prompt, sampling = forking_model(5), [7, 8, 9], Sampling(temperature=1.0, top_k=3)

    def next_probs(sequence):
        logits = alone(model, sequence)
        logits[CONTROL.child] = float("-inf")
        return target_probs(logits, sampling)

    expected, stack = {}, [((), 1.0)]
    while stack:
        tokens, probability = stack.pop()
        if len(tokens) == 3 or tokens[-1:] == (EOS,):
            expected[tokens] = expected.get(tokens, 0.0) + probability
            continue
        for token, p in enumerate(next_probs(prompt + list(tokens)).tolist()):
            if p > 0:
                stack.append((tokens + (token,), probability * p))
    assert 4 < len(expected) <= 27

    counts, generator = Counter(), torch.Generator().manual_seed(0)
    for _ in range(1500):
        drafters = []

        def guesser():
            drafters.append(Contenders(model))
            return drafters[-1]

        generate_apar(model, prompt, CONTROL, max_new_tokens=6, eos_ids={EOS}, sampling=sampling,
                      generator=generator, max_guesses=3, guesser=guesser)
        own = drafters[0].history[len(prompt):]  # the root thread's drafter was told every token it chose
        counts[tuple(own[:own.index(EOS) + 1] if EOS in own[:3] else own[:3])] += 1
    assert chi_square_p_value(counts, expected) > 1e-3


# ---- command line -------------------------------------------------------------------------------

def test_a_missing_adapter_says_how_to_train_one(tmp_path, capsys):
    code = main(["--method", "apar", "--trained", str(tmp_path / "nothing"), "--prompt", "hi"])
    err = capsys.readouterr().err
    assert code == 1 and "python train_prompt.py apar" in err and "Traceback" not in err


def test_a_tokenizer_without_control_tokens_is_refused(tmp_path):
    from helpers import write_tiny_tokenizer
    from errors import UserError
    from tokenizer import Tokenizer

    write_tiny_tokenizer(tmp_path)
    with pytest.raises(UserError, match="train_prompt.py apar"):
        ControlTokens.of(Tokenizer(tmp_path))


@pytest.mark.parametrize("options, message", [
    (["--acceptance", "typical", "--temperature", "1"], "guesses nothing"),
    (["--show-accepts"], "--show-accepts applies to"),
    (["--tree-rows", "4"], "--tree-rows applies to"),
    (["--ngram-k", "3"], "--ngram-k applies to --apar-guesses anpd only"),
    (["--apar-guesses", "lookahead", "--ngram-n", "3"], "--ngram-n applies to --apar-guesses anpd only"),
    (["--apar-guesses", "anpd", "--decoding-length", "4"], "--decoding-length applies to --apar-guesses lookahead"),
    (["--apar-guesses", "anpd", "--acceptance", "typical", "--temperature", "1"], "exactly, never lossily"),
])
def test_options_that_mean_nothing_for_apar_are_refused(options, message, capsys):
    assert main(["--method", "apar", "--prompt", "hi", *options]) == 1
    assert message in capsys.readouterr().err


def test_the_shipped_adapter_runs_on_the_default_model(capsys):
    prompt = "Give me three tips for staying healthy."
    assert main(["--method", "apar", "--prompt", prompt, "--max-new-tokens", "48", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["method"] == "apar" and stats["new_tokens"] > 0 and stats["text"].strip()
    assert stats["forward_passes"] >= 1 and stats["threads"] >= 1
    assert stats["max_cached_tokens"] <= stats["prompt_tokens"] + stats["tokens_sampled"] + stats["threads"]



def test_the_readme_example_forks_and_does_not_loop(capsys):
    """The README's example with the shipped adapter: it goes parallel, delivers the five points asked
    for, and its restored text neither loops (the data rules' test for repetition) nor glues points."""
    prompt = "Give me five tips for learning a new language."
    assert main(["--method", "apar", "--prompt", prompt, "--max-new-tokens", "256", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    text = stats["text"]
    assert stats["threads"] >= 4 and stats["stop_reason"] == "eos"
    assert not repetitive(text) and len(POINT.findall(text)) >= 5  # a glued point starts no line


GUESSED_PROMPT = ["--method", "apar", "--prompt", "Give me five tips for learning a new language.", "--json"]


@pytest.fixture(scope="module")
def plain_apar_answer():
    """decode.py's --json record for GUESSED_PROMPT without guesses (once for both drafters below)."""
    with contextlib.redirect_stdout(io.StringIO()) as out:
        assert main(GUESSED_PROMPT) == 0
    return json.loads(out.getvalue())


@pytest.mark.parametrize("guesses", ["anpd", "lookahead"])
def test_apar_with_guesses_writes_the_same_answer_in_fewer_passes(guesses, plain_apar_answer, capsys):
    """On the default model, greedy: --apar-guesses leaves the restored answer as it is, accepts some
    guesses, and reports each thread's tokens per pass."""
    plain = plain_apar_answer
    assert main(GUESSED_PROMPT + ["--apar-guesses", guesses]) == 0
    guessed = json.loads(capsys.readouterr().out)
    assert guessed["token_ids"] == plain["token_ids"] and guessed["threads"] == plain["threads"]
    assert 0 < guessed["guesses_accepted"] <= guessed["guesses_proposed"]
    assert guessed["forward_passes"] < plain["forward_passes"]
    assert len(guessed["thread_tokens_per_pass"]) == guessed["threads"]
    assert max(guessed["thread_tokens_per_pass"]) > 1
