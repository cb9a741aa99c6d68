"""Medusa heads and PPD prompt tokens: their trees, their exactness and their training.

- The ensemble mask and prompt-token positions against a hand-made case.
- The sparse tree from accuracies is the optimum (brute force over small cases), and the dynamic
  sparse tree keeps its budget and predicts the tokens per pass that a simulation of its own
  acceptance model measures.
- Greedy Medusa and PPD equal vanilla greedy token for token on random tiny float64 models with random
  heads and prompt embeddings, and on the default model with the shipped artifacts.
- Training on a tiny model lowers the loss; artifacts save, load, and refuse a model they were not
  made for.
"""

import itertools
import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

import artifacts
import train_prompt
from conftest import random_model, tiny_hf_config
from decode import generate, learned_drafter
from drafters import MedusaDrafter, MedusaHeads, PromptDrafter, PromptTokens
from errors import UserError
from tree import (Tree, best_prompt_tree, best_sparse_tree, end_probabilities, expected_accepted,
                  prompt_tree_for)

VOCAB = 16
MODELS = {}


def tiny_model(seed):
    if seed not in MODELS:
        MODELS[seed] = random_model(tiny_hf_config(vocab=VOCAB, max_position_embeddings=96), seed=seed)
        MODELS[seed].requires_grad_(False)
    return MODELS[seed]


# ---- the ensemble mask --------------------------------------------------------------------------

def test_ensemble_mask_and_positions_by_hand():
    """Root r with one child c; r carries 2 prompt tokens, c carries 1, each in 2 EPT groups.
    Rows: r, c, then (r,d1,g0) (r,d1,g1) (r,d2,g0) (r,d2,g1) (c,d1,g0) (c,d1,g1)."""
    tree = Tree([7, 8], [-1, 0], prompt_counts=[2, 1], ensembles=2)
    assert tree.prompt_slots() == [(0, 1, 0), (0, 1, 1), (0, 2, 0), (0, 2, 1), (1, 1, 0), (1, 1, 1)]
    assert tree.positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12, 12]
    expected = torch.tensor([
        # r  c  r10 r11 r20 r21 c10 c11
        [1, 0, 0, 0, 0, 0, 0, 0],  # r
        [1, 1, 0, 0, 0, 0, 0, 0],  # c: nodes never see prompt tokens
        [1, 0, 1, 0, 0, 0, 0, 0],  # r's distance-1 EPT, group 0
        [1, 0, 0, 1, 0, 0, 0, 0],  # group 1: not group 0's
        [1, 0, 1, 0, 1, 0, 0, 0],  # distance 2, group 0: sees distance 1 of group 0 only
        [1, 0, 0, 1, 0, 1, 0, 0],  # distance 2, group 1
        [1, 1, 0, 0, 0, 0, 1, 0],  # c's prompt token: c's ancestors, not r's prompt tokens
        [1, 1, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.ancestor_mask(), expected)
    assert tree.attention_mask(3).shape == (8, 11)
    assert tree.prompt_rows(0) == [2, 3, 4, 5] and tree.prompt_rows(1) == [6, 7]


def test_truncation_keeps_prompt_counts():
    tree = Tree([1, 2, 3], [-1, 0, 1], prompt_counts=[1, 2, 3], ensembles=2)
    cut = tree.truncated(1)
    assert cut.prompt_counts == [1, 2] and cut.ensembles == 2 and len(cut.prompt_slots()) == 6


# ---- sparse trees -------------------------------------------------------------------------------

accuracy_tables = st.integers(1, 3).flatmap(lambda depth: st.integers(1, 3).flatmap(
    lambda ranks: st.lists(st.lists(st.floats(0.0, 1.0 / ranks), min_size=ranks, max_size=ranks),
                           min_size=depth, max_size=depth)))


def all_paths(accuracy, max_depth):
    return [p for d in range(1, max_depth + 1) for p in itertools.product(range(len(accuracy[0])), repeat=d)]


@given(accuracy_tables, st.integers(0, 5))
def test_greedy_sparse_tree_is_the_best_tree_of_its_size(accuracy, size):
    spec = best_sparse_tree(accuracy, size)
    paths = all_paths(accuracy, len(accuracy))
    assert len(spec) == min(size, len(paths)) and len(set(spec)) == len(spec)
    assert all(p[:-1] == () or p[:-1] in spec[:i] for i, p in enumerate(spec))  # parents first
    values = [expected_accepted(accuracy, spec[:i]) for i in range(len(spec) + 1)]
    assert all(a <= b for a, b in zip(values, values[1:]))  # no greedy step lowers the objective
    best = max(expected_accepted(accuracy, subset) for subset in itertools.combinations(paths, len(spec))
               if all(p[:-1] == () or p[:-1] in subset for p in subset))
    assert values[-1] == pytest.approx(best)


@given(accuracy_tables, st.integers(0, 6), st.integers(1, 3))
def test_end_probabilities_sum_to_one(accuracy, size, max_depth):
    ends = end_probabilities(accuracy, best_sparse_tree(accuracy, size, max_depth))
    assert sum(ends) == pytest.approx(1.0) and min(ends) >= 0


@given(accuracy_tables, st.integers(2, 30), st.integers(1, 3), st.integers(1, 2), st.booleans())
def test_prompt_tree_keeps_its_budget(accuracy, rows, m, ensembles, dynamic):
    if rows < 1 + (1 if dynamic else m) * ensembles:
        with pytest.raises(ValueError):
            best_prompt_tree(accuracy, rows, m, ensembles, dynamic)
        return
    tree = best_prompt_tree(accuracy, rows, m, ensembles, dynamic)
    assert tree.rows <= rows
    for k, state in tree.states.items():
        assert 1 + len(state.spec) + sum(state.prompt_counts) * ensembles <= tree.rows
        assert all(1 <= c <= m for c in state.prompt_counts)
        assert all(len(path) <= k for path in state.spec)  # k prompt tokens guess k distances
        assert dynamic or state.prompt_counts == [m] * (len(state.spec) + 1)
    assert 1 <= tree.tokens_per_pass <= 1 + m


def simulated_tokens_per_pass(tree, accuracy, passes, rng):
    """Run the tree's own acceptance model: at depth d the next true token is the rank-r guess with
    probability accuracy[d][r] (else none of them); the next state is the prompt count of the node the
    accepted path ends at."""
    state, total = max(tree.states), 0
    for _ in range(passes):
        spec = tree.states[state].spec
        node_of_path = {tuple(p): i for i, p in enumerate(spec, start=1)}
        path, node = (), 0
        while True:
            weights = accuracy[len(path)] if len(path) < len(accuracy) else []
            draw, rank = rng.random(), None
            for r, w in enumerate(weights):
                draw -= w
                if draw < 0:
                    rank = r
                    break
            if rank is None or path + (rank,) not in node_of_path:
                break
            path += (rank,)
            node = node_of_path[path]
        total += 1 + len(path)
        state = tree.states[state].prompt_counts[node]
    return total / passes


@pytest.mark.parametrize("dynamic", [True, False])
def test_tokens_per_pass_matches_a_simulation(dynamic):
    accuracy = [[0.45, 0.15, 0.08, 0.04], [0.3, 0.12, 0.06, 0.03], [0.2, 0.1, 0.05, 0.02]]
    tree = best_prompt_tree(accuracy, 20, 3, 1, dynamic)
    assert len(tree.states) == (3 if dynamic else 1)
    measured = simulated_tokens_per_pass(tree, accuracy, 40000, random.Random(0))
    assert measured == pytest.approx(tree.tokens_per_pass, abs=0.02)


def test_dynamic_tree_allotment_by_hand():
    """4 candidates, 8 prompt tokens for 5 nodes, m = 3. Trees: f(T_1) = 0.3 + 0.1 (only 2 ranks at
    depth 1), f(T_2) = f(T_3) = 0.3 + 0.1 + 0.06 + 0.03 (nodes (0), (1), (0,0), (0,1)). A third prompt
    token is worth f(T_3) - f(T_2) = 0: all five go first. A second is worth P(end) x 0.09, with
    P(end) root 0.6, (0) 0.3 - 0.06 - 0.03 = 0.21, (1) 0.1, (0,0) 0.06, (0,1) 0.03: the last two lose
    theirs."""
    accuracy = [[0.3, 0.1], [0.2, 0.1], [0.1, 0.05]]
    tree = prompt_tree_for(accuracy, candidates=4, prompt_tokens=8, max_prompt=3, ensembles=1)
    assert tree.states[3].spec == [(0,), (1,), (0, 0), (0, 1)]
    assert end_probabilities(accuracy, tree.states[3].spec) == pytest.approx([0.6, 0.21, 0.1, 0.06, 0.03])
    assert tree.states[3].prompt_counts == [2, 2, 2, 1, 1]
    assert tree.states[1].spec == [(0,), (1,)]  # one prompt token carried: one distance guessed


# ---- greedy equality ----------------------------------------------------------------------------

def random_accuracy(rng, depth, ranks):
    return [sorted((rng.random() / ranks for _ in range(ranks)), reverse=True) for _ in range(depth)]


def random_medusa(model, seed, heads, rows):
    torch.manual_seed(seed)
    medusa = MedusaHeads(model.config.hidden_size, heads).double()
    for p in medusa.parameters():
        torch.nn.init.normal_(p, std=0.3)
    return MedusaDrafter(model, medusa, best_sparse_tree(random_accuracy(random.Random(seed), heads, 4), rows - 1))


def random_ppd(model, seed, m, ensembles, rows, dynamic):
    generator = torch.Generator().manual_seed(seed)
    tokens = PromptTokens(torch.randn(m, ensembles, model.config.hidden_size, generator=generator,
                                      dtype=torch.float64))
    accuracy = random_accuracy(random.Random(seed), m, 4)
    rows = max(rows, 1 + (1 if dynamic else m) * ensembles)
    return PromptDrafter(model, tokens, best_prompt_tree(accuracy, rows, m, ensembles, dynamic))


@settings(deadline=None)
@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_new=st.integers(1, 40), eos=st.sets(st.integers(0, VOCAB - 1), max_size=2),
       method=st.sampled_from(["medusa", "ppd", "ppd-static"]), size=st.integers(1, 3),
       ensembles=st.integers(1, 3), rows=st.integers(2, 24), drafter_seed=st.integers(0, 10**6))
def test_learned_drafters_equal_vanilla_greedy(seed, prompt, max_new, eos, method, size, ensembles, rows,
                                               drafter_seed):
    model = tiny_model(seed)
    if method == "medusa":
        drafter = random_medusa(model, drafter_seed, size, rows)
    else:
        drafter = random_ppd(model, drafter_seed, size, ensembles, rows, dynamic=method == "ppd")
    vanilla = generate(model, prompt, max_new_tokens=max_new, eos_ids=eos)
    guessed = generate(model, prompt, max_new_tokens=max_new, eos_ids=eos, drafter=drafter)
    assert guessed.token_ids == vanilla.token_ids
    assert guessed.stop_reason == vanilla.stop_reason


@pytest.mark.parametrize("method", ["medusa", "ppd"])
def test_shipped_artifacts_equal_vanilla_on_the_default_model(default_model, default_tokenizer, method):
    drafter = learned_drafter(method, default_model, artifacts.SHIPPED / f"{method}-SmolLM2-135M-Instruct", 12)
    for prompt in ["Give me three tips for staying focused while studying.",
                   "Explain what a hash table is."]:
        ids = default_tokenizer.prompt_ids(prompt, raw=False)
        with torch.inference_mode():
            vanilla = generate(default_model, ids, max_new_tokens=48, eos_ids=default_tokenizer.eos_ids)
            guessed = generate(default_model, ids, max_new_tokens=48, eos_ids=default_tokenizer.eos_ids,
                               drafter=drafter)
        assert guessed.token_ids == vanilla.token_ids
        assert guessed.draft_tokens_accepted > 0


# ---- training and artifacts ---------------------------------------------------------------------

def self_distilled_record(model, seed):
    prompt = [random.Random(seed).randrange(VOCAB) for _ in range(4)]
    answer = generate(model, prompt, max_new_tokens=40, eos_ids=set()).token_ids
    return {"prompt_ids": prompt, "answer_ids": answer}


def test_ppd_training_lowers_the_loss():
    model = tiny_model(0)
    records = [self_distilled_record(model, s) for s in range(4)]
    prompt_tokens = PromptTokens(train_prompt.initial_embeddings(model, 3, 2, seed=0).double())
    optimizer = torch.optim.Adam(prompt_tokens.parameters(), lr=0.05)

    def loss_over_all():
        with torch.no_grad():
            return sum(train_prompt.ppd_loss(model, prompt_tokens, r, 40, torch.Generator().manual_seed(0))
                       for r in records).item()

    before = loss_over_all()
    for step in range(40):
        loss = train_prompt.ppd_loss(model, prompt_tokens, records[step % 4], 16,
                                     torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss_over_all() < 0.7 * before
    assert model.embed.weight.grad is None  # the model stayed frozen


def test_medusa_training_lowers_the_loss():
    model = tiny_model(0)
    hidden, targets = train_prompt.answer_features(model, [self_distilled_record(model, s) for s in range(4)])
    heads = MedusaHeads(model.config.hidden_size, 2).double()
    optimizer = torch.optim.Adam(heads.parameters(), lr=0.01)
    before = train_prompt.medusa_loss(model, heads, hidden, targets).item()
    for _ in range(40):
        loss = train_prompt.medusa_loss(model, heads, hidden, targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss.item() < 0.7 * before
    accuracy = train_prompt.medusa_accuracy(model, heads, hidden, targets)
    assert len(accuracy) == 2 and all(0 <= a <= 1 for row in accuracy for a in row)


def test_training_rows_use_the_decoding_mask():
    """Insertion rows see the answer up to their insertion point and their own group's earlier
    prompt tokens only; their positions continue from the insertion point."""
    positions, mask, distance = train_prompt.insertion_layout([2, 4], count=2, ensembles=2, prefix_length=6)
    assert positions.tolist() == [3, 3, 4, 4, 5, 5, 6, 6]
    assert distance.tolist() == [1, 1, 2, 2, 1, 1, 2, 2]
    assert mask[:, :6].sum(1).tolist() == [3, 3, 3, 3, 5, 5, 5, 5]
    assert mask[4, 6:].tolist() == [False] * 4 + [True, False, False, False]
    assert mask[6, 6:].tolist() == [False] * 4 + [True, False, True, False]


def test_artifacts_round_trip_and_refuse_another_model(tmp_path):
    model, other = tiny_model(0), tiny_model(1)
    wider = random_model(tiny_hf_config(vocab=VOCAB, head_dim=16), seed=0)
    bigger_vocab = random_model(tiny_hf_config(vocab=VOCAB * 2), seed=0)
    embeddings = torch.randn(3, 1, model.config.hidden_size, dtype=torch.float64)
    meta = {"kind": "ppd", "model": artifacts.model_fingerprint(model), "prompt_tokens": 3, "ensembles": 1,
            "accuracy": [[0.5, 0.1], [0.3, 0.1], [0.2, 0.1]]}
    artifacts.save(tmp_path / "ppd-tiny", {"embeddings": embeddings}, meta)
    tensors, loaded = artifacts.load(tmp_path / "ppd-tiny", "ppd", model)
    assert torch.equal(tensors["embeddings"], embeddings) and loaded == meta
    drafter = learned_drafter("ppd", model, tmp_path / "ppd-tiny", 8)
    assert isinstance(drafter, PromptDrafter)
    for wrong, message in [(wider, "hidden_size"), (bigger_vocab, "vocab_size"), (other, "another model")]:
        with pytest.raises(UserError, match=message):
            artifacts.load(tmp_path / "ppd-tiny", "ppd", wrong)
    with pytest.raises(UserError, match="not 'medusa'"):
        artifacts.load(tmp_path / "ppd-tiny", "medusa", model)
    with pytest.raises(UserError, match="train_prompt.py"):
        artifacts.load(tmp_path / "missing", "ppd", model)


def test_training_resumes_where_it_stopped(tmp_path, monkeypatch):
    """An interrupted run, run again, ends with exactly the weights of an uninterrupted one."""
    import argparse

    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    model = tiny_model(0)
    record = self_distilled_record(model, 0)

    def train(out, stop_at=None):
        args = argparse.Namespace(out=tmp_path / out, save_every=2, lr=0.05, seed=0)
        prompt_tokens = PromptTokens(train_prompt.initial_embeddings(model, 2, 1, seed=0).double())
        optimizer = torch.optim.AdamW(prompt_tokens.parameters(), lr=args.lr)

        def step_loss(step):
            if step == stop_at:
                raise KeyboardInterrupt
            return train_prompt.ppd_loss(model, prompt_tokens, record, 8, torch.Generator().manual_seed(step)), 1

        train_prompt.run_steps(prompt_tokens, optimizer, 6, step_loss, args)
        return prompt_tokens.embeddings.detach()

    straight = train("straight")
    with pytest.raises(KeyboardInterrupt):
        train("interrupted", stop_at=5)  # the resume point of step 4 was saved
    assert torch.equal(train("interrupted"), straight)


@pytest.mark.parametrize("argv, fragment", [
    (["ppd", "--epochs", "0"], "--epochs"), (["medusa", "--lr", "0"], "--lr"),
    (["ppd", "--records", "5"], "--records"), (["medusa", "--heads", "9"], "at most 7 heads"),
])
def test_training_options_are_checked_before_any_work(capsys, argv, fragment):
    assert train_prompt.main(argv) == 1
    err = capsys.readouterr().err
    assert err.count("error:") == 1 and fragment in err and "Traceback" not in err
