"""PPD soft tokens and the dynamic sparse tree (ppd.py).

- The dynamic sparse tree keeps its budget, its allotment matches a hand computation, and its
  predicted tokens per pass match a simulation of its own acceptance model.
- Greedy PPD (dynamic and static tree) equals vanilla greedy token for token on random tiny float64
  models with random soft tokens, and on the default model with the shipped ones; its next guesses
  come from the last accepted node's own soft tokens, distance by distance.
- Training on a tiny model lowers the loss with the decoding mask; artifacts save, load, and refuse
  a model they were not made for. (Sampling with PPD: test_sampling_decode.py.)
"""

import random

import pytest
import torch
from hypothesis import given, settings, strategies as st

from methods import artifacts
from helpers import (accuracy_tables, assert_equals_vanilla_greedy, assert_shipped_guesser_equals_vanilla,
                      random_accuracy, random_model, self_distilled_record, tiny_hf_config, tiny_model)
from errors import UserError
from methods.ppd import (
    PPDDrafter,
    SoftTokenCosts,
    SoftTokens,
    best_dynamic_sparse_tree,
    dynamic_sparse_tree,
    end_probabilities,
    initial_embeddings,
    insertion_layout,
    load_drafter,
    soft_layout,
)
from train_prompt import ppd_record_loss
from tree import Tree, best_sparse_tree
from methods.cost_aware import CostAware, Costs
from decode import generate
from drafters import TOP_RANKS, Pass, Request
from methods.latency import Latency

VOCAB = 16


def model_of(seed):
    return tiny_model(seed, vocab=VOCAB, max_positions=96)


# ---- the dynamic sparse tree --------------------------------------------------------------------

@given(accuracy_tables, st.integers(0, 6), st.integers(1, 3))
def test_end_probabilities_sum_to_one(accuracy, size, max_depth):
    ends = end_probabilities(accuracy, best_sparse_tree(accuracy, size, max_depth))
    assert sum(ends) == pytest.approx(1.0) and min(ends) >= 0


@given(accuracy_tables, st.integers(2, 30), st.integers(1, 3), st.integers(1, 2), st.booleans())
def test_dynamic_tree_keeps_its_budget(accuracy, rows, m, ensembles, dynamic):
    if rows < 1 + (1 if dynamic else m) * ensembles:
        with pytest.raises(ValueError):
            best_dynamic_sparse_tree(accuracy, rows, m, ensembles, dynamic)
        return
    tree = best_dynamic_sparse_tree(accuracy, rows, m, ensembles, dynamic)
    assert tree.inputs <= rows
    for k, state in tree.states.items():
        assert 1 + len(state.spec) + sum(state.soft_counts) * ensembles <= tree.inputs
        assert all(1 <= c <= m for c in state.soft_counts)
        assert all(len(path) <= k for path in state.spec)  # k soft tokens guess k distances
        assert dynamic or state.soft_counts == [m] * (len(state.spec) + 1)
    assert 1 <= tree.tokens_per_pass <= 1 + m


def simulated_tokens_per_pass(tree, accuracy, passes, rng):
    """Run the tree's own acceptance model: at depth d the next true token is the rank-r guess with
    probability accuracy[d][r] (else none of them); the next state is the soft-token count of the node the
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
        state = tree.states[state].soft_counts[node]
    return total / passes


@pytest.mark.parametrize("dynamic", [True, False])
def test_tokens_per_pass_matches_a_simulation(dynamic):
    accuracy = [[0.45, 0.15, 0.08, 0.04], [0.3, 0.12, 0.06, 0.03], [0.2, 0.1, 0.05, 0.02]]
    tree = best_dynamic_sparse_tree(accuracy, 20, 3, 1, dynamic)
    assert len(tree.states) == (3 if dynamic else 1)
    measured = simulated_tokens_per_pass(tree, accuracy, 40000, random.Random(0))
    assert measured == pytest.approx(tree.tokens_per_pass, abs=0.02)


def test_dynamic_tree_allotment_by_hand():
    """4 candidates, 8 soft tokens for 5 nodes, m = 3. Trees: f(T_1) = 0.3 + 0.1 (only 2 ranks at
    depth 1), f(T_2) = f(T_3) = 0.3 + 0.1 + 0.06 + 0.03 (nodes (0), (1), (0,0), (0,1)). A third soft
    token is worth f(T_3) - f(T_2) = 0: all five go first. A second is worth P(end) x 0.09, with
    P(end) root 0.6, (0) 0.3 - 0.06 - 0.03 = 0.21, (1) 0.1, (0,0) 0.06, (0,1) 0.03: the last two lose
    theirs."""
    accuracy = [[0.3, 0.1], [0.2, 0.1], [0.1, 0.05]]
    tree = dynamic_sparse_tree(accuracy, candidates=4, soft_tokens=8, max_soft=3, ensembles=1)
    assert tree.states[3].spec == [(0,), (1,), (0, 0), (0, 1)]
    assert end_probabilities(accuracy, tree.states[3].spec) == pytest.approx([0.6, 0.21, 0.1, 0.06, 0.03])
    assert tree.states[3].soft_counts == [2, 2, 2, 1, 1]
    assert tree.states[1].spec == [(0,), (1,)]  # one soft token carried: one distance guessed


# ---- greedy equality ----------------------------------------------------------------------------

def random_ppd(model, seed, m, ensembles, rows, dynamic, costs=None):
    generator = torch.Generator().manual_seed(seed)
    tokens = SoftTokens(torch.randn(m, ensembles, model.config.hidden_size, generator=generator,
                                      dtype=torch.float64))
    accuracy = random_accuracy(random.Random(seed), m, 4)
    rows = max(rows, 1 + (1 if dynamic else m) * ensembles)
    return PPDDrafter(model, tokens, best_dynamic_sparse_tree(accuracy, rows, m, ensembles, dynamic), accuracy, costs)


@settings(deadline=None)
@given(seed=st.integers(0, 3), prompt=st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=12),
       max_new=st.integers(1, 40), eos=st.sets(st.integers(0, VOCAB - 1), max_size=2),
       dynamic=st.booleans(), size=st.integers(1, 3), ensembles=st.integers(1, 3), rows=st.integers(2, 24),
       drafter_seed=st.integers(0, 10**6), input_cost=st.sampled_from([None, 0.0, 0.2, 100.0]))
def test_ppd_equals_vanilla_greedy(seed, prompt, max_new, eos, dynamic, size, ensembles, rows, drafter_seed,
                                   input_cost):
    """input_cost: None, PPD's trees whole; else cost-aware, each input beyond the root costing that
    much of a pass (100: soft tokens never pay, and ride along only on probes)."""
    model = model_of(seed)
    if input_cost is None:
        drafter = random_ppd(model, drafter_seed, size, ensembles, rows, dynamic=dynamic)
    else:
        costs = SoftTokenCosts(Latency({1: 1.0, 64: 1.0 + 63 * input_cost}))
        drafter = CostAware(random_ppd(model, drafter_seed, size, ensembles, rows, dynamic, costs), costs)
    assert_equals_vanilla_greedy(model, prompt, max_new, eos, drafter)


def test_the_next_guesses_are_the_last_accepted_nodes_own_soft_tokens_by_distance():
    """After a pass, PPD's guesses at distance d are the top tokens of the soft token at distance d on
    the last accepted node, averaged over its EPT copies (the rows soft_layout gives that node; the
    layout's rows are by hand in the test below): not another node's, nor another distance's."""
    model = model_of(0)
    drafter = random_ppd(model, 0, 2, 2, 8, True)
    drafter.begin(Request([1, 2, 3]))
    # root r (carries 2 soft tokens) and its child c (carries 1), 2 copies each:
    # rows r, c, (r,d1,g0) (r,d1,g1) (r,d2,g0) (r,d2,g1) (c,d1,g0) (c,d1,g1)
    tree = Tree([7, 8], [-1, 0]).with_extra(soft_layout([2, 1], ensembles=2))
    logits = torch.randn(8, VOCAB, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    for path, rows_per_distance in [([0, 1], [[6, 7]]), ([0], [[2, 3], [4, 5]])]:
        drafter.after_pass(Pass(tree, 3, path, [9] * len(path), torch.zeros(8, 4), logits))
        expected = [logits[rows].mean(0).topk(TOP_RANKS).indices.tolist() for rows in rows_per_distance]
        assert drafter.candidates == expected


def test_soft_tokens_that_never_pay_ride_along_only_on_probes():
    model = model_of(0)
    costs = SoftTokenCosts(Latency({1: 1.0, 64: 1000.0}))
    drafter = CostAware(random_ppd(model, 0, 2, 1, 8, True, costs), costs)
    carried = []
    generate(model, [1, 2, 3], max_new_tokens=60, eos_ids=set(), drafter=drafter,
             on_pass=lambda done: carried.append(done.tree.extra is not None and len(done.tree.extra) > 0))
    passes = carried[1:]  # after the prefill, which carries them (it has no cost-aware choice)
    assert any(passes) and sum(passes) <= len(passes) // Costs.PROBE_EVERY + 1


@pytest.mark.parametrize("soft_tokens, ensembles, dynamic", [(2, 1, True), (3, 2, True), (2, 1, False)])
def test_a_soft_token_probe_sends_a_guess_they_make_in_the_next_pass(soft_tokens, ensembles, dynamic):
    """Soft tokens that never pay ride along on a probe, only those that guess as far ahead as the
    probe will (SoftTokenCosts.probe_depth), in all their copies (a static tree, whose one state follows a node
    carrying them all: all of them); the guesses they make come a pass later, and that pass probes
    them (at least the likeliest is sent): cut as usual, they would go unjudged and their estimates
    never recover."""
    model = model_of(0)
    costs = SoftTokenCosts(Latency({1: 1.0, 64: 1000.0}))
    ppd = random_ppd(model, 0, soft_tokens, ensembles, 8, dynamic, costs)
    drafter = CostAware(ppd, costs)
    carried, cuts = [], []

    def watch(done):
        carried.append(len(done.tree.extra) if done.tree.extra is not None else 0)
        cuts.append(drafter.last_cut)
    generate(model, [1, 2, 3], max_new_tokens=60, eos_ids=set(), drafter=drafter, on_pass=watch)
    probes = [i for i in range(1, len(carried) - 1) if carried[i]]  # (the first pass follows the prefill's)
    reach = costs.probe_depth(ppd.shape) if dynamic else soft_tokens
    assert probes and all(cuts[i + 1].sent > 0 for i in probes)
    assert costs.probe_depth(ppd.shape) < soft_tokens and {carried[i] for i in probes} == {reach * ensembles}


def test_shipped_soft_tokens_equal_vanilla_on_the_default_model(default_model, default_tokenizer):
    drafter = load_drafter(default_model, artifacts.SHIPPED / "ppd-SmolLM2-135M-Instruct", 12)
    assert_shipped_guesser_equals_vanilla(default_model, default_tokenizer, drafter)


# ---- training and artifacts ---------------------------------------------------------------------

def test_ppd_training_lowers_the_loss():
    model = model_of(0)
    records = [self_distilled_record(model, s, VOCAB) for s in range(4)]
    soft_tokens = SoftTokens(initial_embeddings(model, 3, 2, seed=0).double())
    optimizer = torch.optim.Adam(soft_tokens.parameters(), lr=0.05)

    def loss_over_all():
        with torch.no_grad():
            return sum(ppd_record_loss(model, soft_tokens, r, 40, torch.Generator().manual_seed(0))
                       for r in records).item()

    before = loss_over_all()
    for step in range(40):
        loss = ppd_record_loss(model, soft_tokens, records[step % 4], 16, torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert loss_over_all() < 0.7 * before
    assert model.embed.weight.grad is None  # the model stayed frozen


def test_training_rows_use_the_decoding_mask():
    """Insertion rows see the answer up to their insertion point and their own group's earlier
    soft tokens only; their positions continue from the insertion point."""
    positions, mask, distance = insertion_layout([2, 4], count=2, ensembles=2, prefix_length=6)
    assert positions.tolist() == [3, 3, 4, 4, 5, 5, 6, 6]
    assert distance.tolist() == [1, 1, 2, 2, 1, 1, 2, 2]
    assert mask[:, :6].sum(1).tolist() == [3, 3, 3, 3, 5, 5, 5, 5]
    assert mask[4, 6:].tolist() == [False] * 4 + [True, False, False, False]
    assert mask[6, 6:].tolist() == [False] * 4 + [True, False, True, False]


def test_artifacts_round_trip_and_refuse_another_model(tmp_path):
    model, other = model_of(0), model_of(1)
    wider = random_model(tiny_hf_config(vocab=VOCAB, head_dim=16), seed=0)
    bigger_vocab = random_model(tiny_hf_config(vocab=VOCAB * 2), seed=0)
    embeddings = torch.randn(3, 1, model.config.hidden_size, dtype=torch.float64)
    meta = {"kind": "ppd", "model": artifacts.model_fingerprint(model), "soft_tokens": 3, "ensembles": 1,
            "accuracy": [[0.5, 0.1], [0.3, 0.1], [0.2, 0.1]]}
    artifacts.save(tmp_path / "ppd-tiny", {"embeddings": embeddings}, meta)
    tensors, loaded = artifacts.load(tmp_path / "ppd-tiny", "ppd", model)
    assert torch.equal(tensors["embeddings"], embeddings) and loaded == meta
    drafter = load_drafter(model, tmp_path / "ppd-tiny", 8)
    assert isinstance(drafter, PPDDrafter)
    for wrong, message in [(wider, "hidden_size"), (bigger_vocab, "vocab_size"), (other, "same shape with other weights")]:
        with pytest.raises(UserError, match=message):
            artifacts.load(tmp_path / "ppd-tiny", "ppd", wrong)
    with pytest.raises(UserError, match="not 'medusa'"):
        artifacts.load(tmp_path / "ppd-tiny", "medusa", model)
    with pytest.raises(UserError, match="train_prompt.py"):
        artifacts.load(tmp_path / "missing", "ppd", model)



def test_the_soft_layout_is_the_ensemble_mask_by_hand():
    """Root r with one child c; r carries 2 soft tokens, c carries 1, each in 2 EPT groups.
    Rows: r, c, then (r,d1,g0) (r,d1,g1) (r,d2,g0) (r,d2,g1) (c,d1,g0) (c,d1,g1)."""
    tree = Tree([7, 8], [-1, 0]).with_extra(soft_layout([2, 1], ensembles=2))
    assert tree.input_positions(10).tolist() == [10, 11, 11, 11, 12, 12, 12, 12]
    expected = torch.tensor([
        # r  c  r10 r11 r20 r21 c10 c11
        [1, 0, 0, 0, 0, 0, 0, 0],  # r
        [1, 1, 0, 0, 0, 0, 0, 0],  # c: nodes never see soft tokens
        [1, 0, 1, 0, 0, 0, 0, 0],  # r's distance-1 EPT, group 0
        [1, 0, 0, 1, 0, 0, 0, 0],  # group 1: not group 0's
        [1, 0, 1, 0, 1, 0, 0, 0],  # distance 2, group 0: sees distance 1 of group 0 only
        [1, 0, 0, 1, 0, 1, 0, 0],  # distance 2, group 1
        [1, 1, 0, 0, 0, 0, 1, 0],  # c's soft token: c's ancestors, not r's soft tokens
        [1, 1, 0, 0, 0, 0, 0, 1],
    ], dtype=torch.bool)
    assert torch.equal(tree.input_mask(0), expected)
    assert tree.input_mask(3).shape == (8, 11)
    assert tree.extra_rows(0) == [2, 3, 4, 5] and tree.extra_rows(1) == [6, 7]


def test_a_trees_surplus_is_its_expected_tokens_beyond_what_its_time_buys_one_a_pass():
    """A chain of two guesses at 0.5 and 0.25 (reach 0.5, 0.125): 1.625 tokens a pass. Over three
    inputs costing 1.25 L(1) it is worth 0.375 tokens more than sending the root alone; its first
    guess alone, 1.5 tokens for 1.2 L(1), 0.3. Where any guess costs a whole L(1), nothing pays: 0."""
    shape = Tree.chain(0, [1, 2], evidence=[((("a",), 0.5),), ((("b",), 0.25),)])
    assert SoftTokenCosts(Latency({1: 1.0, 2: 1.2, 3: 1.25})).surplus(shape) == pytest.approx(1.625 - 1.25)
    assert SoftTokenCosts(Latency({1: 1.0, 2: 1.2, 3: 1.4})).surplus(shape) == pytest.approx(1.5 - 1.2)
    assert SoftTokenCosts(Latency({1: 1.0, 2: 2.0, 3: 3.0})).surplus(shape) == 0.0
