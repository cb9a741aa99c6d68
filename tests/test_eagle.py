"""EAGLE (eagle.py): greedy EAGLE equals vanilla greedy token for token on random tiny float64 models with
random heads; the tree drafted while decoding sees exactly what the training unroll sees (so what the
head learns is what it is asked); training lowers the loss. (Sampling with EAGLE: test_sampling_decode.py.)"""

import torch
from hypothesis import given, settings, strategies as st

from decode import generate
from kv_cache import KVCache
from methods.cost_aware import Costs
from methods.latency import Latency
from drafters import Pass, Request
from tree import Evidence, Tree, Verdict
from helpers import (assert_equals_vanilla_greedy, assert_shipped_guesser_equals_vanilla, random_eagle_head,
                     self_distilled_record, tiny_model)
from methods import artifacts
from methods.eagle import (EagleDrafter, EagleHead, draft_vocabulary, eagle_accuracy, eagle_loss, load_drafter,
                           unrolled, unrolled_mask)

VOCAB = 16


@settings(deadline=None)
@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_new=st.integers(1, 40), eos=st.sets(st.integers(0, VOCAB - 1), max_size=2),
       rows=st.integers(1, 24), depth=st.integers(1, 4), expand=st.integers(1, 4), top_k=st.integers(1, 4),
       draft_vocab=st.integers(1, VOCAB), head_seed=st.integers(0, 10**6))
def test_eagle_equals_vanilla_greedy(seed, prompt, max_new, eos, rows, depth, expand, top_k, draft_vocab, head_seed):
    model = tiny_model(seed, vocab=VOCAB, max_positions=96)
    drafter = EagleDrafter(model, random_eagle_head(model, head_seed, draft_vocab), rows, depth, expand, top_k)
    assert_equals_vanilla_greedy(model, prompt, max_new, eos, drafter)


@settings(deadline=None)
@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=2, max_size=10),
       head_seed=st.integers(0, 10**6))
def test_the_drafted_tree_sees_what_the_training_unroll_sees(seed, prompt, head_seed):
    """Every node of a 3-deep tree, drafted with every node expanded, carries the confidence that the
    training unroll (eagle.unrolled, teacher-forced with the node's path) gives its token: the head's
    cache, positions and tree mask while decoding are the training's."""
    model = tiny_model(seed, vocab=VOCAB, max_positions=96)
    head = random_eagle_head(model, head_seed, VOCAB)
    drafter = EagleDrafter(model, head, inputs=1 + 3 + 9 + 27, depth=3, expand=9, top_k=3)
    passes = []
    generate(model, prompt, max_new_tokens=1, eos_ids=set(), drafter=drafter, on_pass=passes.append)
    tree = drafter.propose()  # after the prefill: the root is its bonus token
    assert len(tree) == 1 + 3 + 9 + 27
    history = prompt + [tree.tokens[0]]
    with torch.no_grad():
        features = model.hidden_states(torch.tensor([history]), positions=torch.arange(len(history)))[0]
        for node in range(1, len(tree)):
            path = []
            ancestor = node
            while ancestor:
                path.insert(0, tree.tokens[ancestor])
                ancestor = tree.parents[ancestor]
            tokens = torch.tensor(history + path)
            padded = torch.cat([features, features.new_zeros(len(path), features.shape[1])])  # (never read)
            row = len(history) - 2  # step s, row i: the pair at position i + s - 1, guessing f_{i+s}
            for step, guessed in unrolled(model, head, padded, tokens, steps=len(path)):
                last = guessed[row]
            probs = torch.softmax(head.logits(last), dim=-1)
            expected = probs[(head.draft_ids == path[-1]).nonzero().item()].item()
            assert abs(tree.evidence[node][0].prior - expected) < 1e-9


def test_the_heads_cache_holds_each_positions_feature_and_the_token_after_it():
    """After a generation whose accepted paths skip nodes (a wrong guess before each right one), the
    head's cache holds what running it over the whole text, teacher-forced, writes: at position i the
    pair (the model's feature at i, token i + 1), and nothing of the drafted trees."""
    model = tiny_model(1, vocab=VOCAB, max_positions=96)
    prompt = [3, 1, 4, 1, 5]
    answer = generate(model, prompt, max_new_tokens=16, eos_ids=set()).token_ids
    text = prompt + answer

    class WrongThenRight(EagleDrafter):
        def propose(self):
            super().propose()  # (drafts, and must leave the cache as it found it)
            done = len(self.history) - len(prompt)
            right = answer[done:done + 2]
            wrong = (right[0] + 1) % VOCAB if right else 0
            return Tree([self.history[-1], wrong, *right], [-1, 0, 0, 2][:2 + len(right)])

    drafter = WrongThenRight(model, random_eagle_head(model, 0, VOCAB), inputs=8, depth=3, expand=2, top_k=2)
    assert generate(model, prompt, max_new_tokens=16, eos_ids=set(), drafter=drafter).token_ids == answer
    with torch.no_grad():
        features = model.hidden_states(torch.tensor([text]), positions=torch.arange(len(text)))[0]
        cache = KVCache(1, model.config.num_kv_heads, model.config.head_dim, len(text), dtype=model.dtype)
        drafter.head(features[None, :-1], model.embed(torch.tensor(text[1:]))[None], torch.arange(len(text) - 1),
                     cache=cache, slots=cache.claim(len(text) - 1))
    with torch.no_grad():
        drafter.read_history()  # (the last pass's accepted nodes: read when it next drafts)
    written = drafter.cache.length
    assert written == len(text) - 1
    assert torch.allclose(drafter.cache.keys[:, :, :, :written], cache.keys[:, :, :, :written])
    assert torch.allclose(drafter.cache.values[:, :, :, :written], cache.values[:, :, :, :written])


def test_the_shipped_head_equals_vanilla_on_the_default_model(default_model, default_tokenizer):
    drafter = load_drafter(default_model, artifacts.SHIPPED / "eagle-SmolLM2-135M-Instruct", 16)
    assert_shipped_guesser_equals_vanilla(default_model, default_tokenizer, drafter)


def test_the_unrolled_mask_sees_the_true_history_and_the_own_earlier_steps():
    mask = unrolled_mask(3, 2)
    assert mask.tolist() == [[True, False, False, True, False, False],
                             [True, True, False, False, True, False],
                             [True, True, True, False, False, True]]


def test_the_draft_vocabulary_is_the_most_frequent_tokens_then_the_lowest_ids():
    assert draft_vocabulary([[5, 5, 3], [3, 5, 7]], vocab_size=10, size=3).tolist() == [3, 5, 7]
    assert draft_vocabulary([[9, 9]], vocab_size=10, size=3).tolist() == [0, 1, 9]


def test_eagle_training_lowers_the_loss():
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    records = [self_distilled_record(model, s, VOCAB) for s in range(4)]
    sequences = []
    with torch.no_grad():
        for record in records:
            tokens = record["prompt_ids"] + record["answer_ids"]
            features = model.hidden_states(torch.tensor([tokens]), positions=torch.arange(len(tokens)))[0]
            sequences.append((features, torch.tensor(tokens), len(record["prompt_ids"])))
    head = EagleHead(model.config, torch.arange(VOCAB)).double().use_lm_head(model.lm_head)
    optimizer = torch.optim.Adam(head.parameters(), lr=0.01)
    generator = torch.Generator().manual_seed(0)

    def loss():
        return sum(eagle_loss(model, head, *sequence, steps=2, generator=generator) for sequence in sequences)
    before = loss().item()
    for _ in range(60):
        value = loss()
        optimizer.zero_grad()
        value.backward()
        optimizer.step()
    assert value.item() < 0.5 * before
    accuracy = eagle_accuracy(model, head, sequences, steps=2, ranks=4)
    assert len(accuracy) == 2 and accuracy[0][0] > 0.5


def test_the_draft_goes_deeper_only_while_a_step_could_pay_for_its_time():
    """A draft step costs its measured seconds; one more depth is drafted where the tree it could make
    (each frontier node's likeliest child added) is expected to yield more tokens per second, that time
    spent too. Where a pass is nearly free, one step is all that is drafted (depth 1); where it is dear,
    every depth is."""
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    head = random_eagle_head(model, 0, VOCAB)
    depths = {}
    for name, pass_seconds in [("free", 1e-12), ("dear", 1e3)]:
        costs = Costs(Latency({1: pass_seconds}))
        drafter = EagleDrafter(model, head, inputs=40, depth=4, expand=2, top_k=2, costs=costs)
        generate(model, [1, 2, 3], max_new_tokens=1, eos_ids=set(), drafter=drafter)
        drafter.step_seconds = [1e-3]  # as measured
        depths[name] = max(drafter.propose().depths)
    assert depths == {"free": 1, "dear": 4}


def test_the_heads_gain_is_what_its_accepted_guesses_made_the_pass_worth_beside_the_other_sources():
    """realized_gain: tokens per second of the pass with the head's guesses (priced with the pass's L(n) and
    the head's drafting: its tree and one pass's reading) over those of the same pass without them. The
    head's accepted guess here is worth a token, an input and 2 ms; a guess an n-gram made too is not the
    head's to claim."""
    model = tiny_model(0, vocab=VOCAB, max_positions=96)
    drafter = EagleDrafter(model, random_eagle_head(model, 0, VOCAB), inputs=8, costs=Costs(Latency({1: 0.010, 3: 0.020})))
    drafter.begin(Request([1, 2, 3], max_length=20))
    drafter.steady_reads, drafter.tree_seconds = [0.010, 0.001], 0.001  # (the first: the prompt)

    def gain(evidence_of_node_1):
        tree = Tree([5, 6, 7], [-1, 0, 0], evidence=[(), evidence_of_node_1, (Evidence(("ngram", 1), 0.3),)])
        verdict = Verdict.of(tree, [0, 1], bonus=9)
        done = Pass(tree, 3, [0, 1], [6, 9], torch.zeros(3, 4), torch.zeros(3, VOCAB), verdict)
        return drafter.realized_gain(done)
    eagles = (Evidence(("eagle", 1, 5), 0.5),)
    # with the head: 2 tokens in L(3) + 2 ms; without: 1 token in L(2) = 15 ms
    assert abs(gain(eagles) - (2 / 0.022) / (1 / 0.015)) < 1e-9
    # the n-gram's guess too: without the head, the same 2 tokens, from a pass over 3 inputs
    assert abs(gain(eagles + (Evidence(("ngram", 2), 0.4),)) - (2 / 0.022) / (2 / 0.020)) < 1e-9
