"""The combined drafter (combined.py, --method auto): its tree merges every source's guesses with
their evidence, and it decodes exactly as vanilla greedy, cost-aware or not, with or without PPD's
soft tokens on the root (its sampling is tested with the other methods in test_sampling_decode.py)."""

import json
import random

import torch
from hypothesis import given, strategies as st

from methods.eagle import EagleDrafter
from methods.combined import CombinedDrafter, SoftTokensOnRoot, branches, combined_drafter
from methods.cost_aware import CostAware, Costs
from methods.latency import Latency
from decode import generate
from drafters import Drafter, NGramDrafter, TrieDrafter
from helpers import (assert_decodes_as_naive_greedy, assert_shipped_guesser_equals_vanilla, random_accuracy,
                     tiny_model, trees)
from methods import registry
from methods.registry import METHODS, build_drafter, default_options
from methods.ppd import PPDDrafter, SoftTokenCosts, SoftTokens, best_dynamic_sparse_tree
from tree import Evidence, Tree


def random_ppd(model, seed=0):
    embeddings = torch.randn(3, 2, model.config.hidden_size, generator=torch.Generator().manual_seed(seed),
                             dtype=torch.float64)
    accuracy = random_accuracy(random.Random(seed), 3, 4)
    return PPDDrafter(model, SoftTokens(embeddings), best_dynamic_sparse_tree(accuracy, 12, 3, 2), accuracy)


@given(trees())
def test_a_tree_is_its_branches_merged_again(tree):
    """branches() then from_branches(merge=True) gives back the tree's guessed token paths."""
    paths, evidence = branches(tree)
    rebuilt = Tree.from_branches(tree.tokens[0], paths, budget=len(tree), evidence=evidence)

    def token_paths(t):
        out = set()
        for node in range(1, len(t)):
            path, n = [], node
            while n:
                path.append(t.tokens[n])
                n = t.parents[n]
            out.add(tuple(reversed(path)))
        return out
    assert token_paths(rebuilt) == token_paths(tree)


class Fixed(Drafter):
    """A source that proposes one given chain with one evidence key."""

    def __init__(self, chain, key):
        self.chain, self.key = chain, key
        self.max_extra_inputs = len(chain)

    def propose(self):
        return Tree.chain(self.history[-1], self.chain, evidence=[(((self.key,), 0.5),)] * len(self.chain))


def test_a_guess_two_sources_agree_on_is_one_node_with_both_sources_evidence():
    combined = CombinedDrafter([Fixed([5, 6, 7], "x"), Fixed([5, 6, 9], "y")])
    combined.begin(type("Request", (), {"prompt_ids": [1, 2]})())
    tree = combined.propose()
    assert tree.tokens == [2, 5, 6, 7, 9] and tree.parents == [-1, 0, 1, 2, 2]
    assert [sorted(key[0][0] for key in e) for e in tree.evidence] == [[], ["x", "y"], ["x", "y"], ["x"], ["y"]]


def test_soft_tokens_ride_on_the_root_only_where_they_pay():
    model = tiny_model(0)
    ppd = random_ppd(model)
    inputs = 1 + 3 * 2
    cheap = Latency({1: 1.0, inputs: 1.0})
    dear = Latency({1: 1.0, inputs: ppd.predicted_tokens_per_pass + 0.01})
    assert combined_drafter(NGramDrafter(), TrieDrafter(), ppd, cheap).soft is not None
    assert combined_drafter(NGramDrafter(), TrieDrafter(), ppd, dear).soft is None


@given(st.integers(0, 3), st.lists(st.integers(0, 15), min_size=1, max_size=12), st.integers(1, 24),
       st.booleans(), st.booleans())
def test_the_combined_drafter_decodes_as_vanilla_greedy(seed, prompt, max_new_tokens, with_ppd, cost_aware):
    model = tiny_model(seed)
    soft = SoftTokensOnRoot(random_ppd(model, seed)) if with_ppd else None
    costs = SoftTokenCosts(Latency({1: 1.0, 4: 1.3, 16: 2.0})) if cost_aware else None
    drafter = CombinedDrafter([NGramDrafter(n=3, k=4), TrieDrafter(decoding_length=6, branch_length=3)], soft, costs)
    if cost_aware:
        drafter = CostAware(drafter, costs)
    assert_decodes_as_naive_greedy(generate, model, prompt, max_new_tokens, drafter)


def test_the_combined_drafter_takes_guesses_from_every_source():
    """On a repetitive answer all three sources have guesses accepted (so none is dead code)."""
    model = tiny_model(0)
    ppd = random_ppd(model)
    sources_accepted = set()

    def watch(step):
        for node in step.verdict.path[1:]:
            sources_accepted.update(key[0][0] for key in step.tree.evidence[node])

    drafter = CombinedDrafter([NGramDrafter(n=3, k=4), TrieDrafter(decoding_length=6, branch_length=3)],
                              SoftTokensOnRoot(ppd))
    generate(model, [1, 2, 3], max_new_tokens=60, eos_ids=set(), drafter=drafter, on_pass=watch)
    assert sources_accepted == {"anpd", "lookahead", "ppd"}


def test_auto_on_the_default_model_equals_vanilla(default_model, default_tokenizer):
    """--method auto as decode.py builds it (the shipped soft tokens carried: passes cost the same here)."""
    drafter = build_drafter(METHODS["auto"], default_options(), default_model, default_tokenizer,
                            latency=Latency.flat())
    assert isinstance(drafter.drafter, CombinedDrafter) and drafter.drafter.soft is not None
    assert any(isinstance(source, EagleDrafter) for source in drafter.drafter.sources)
    assert_shipped_guesser_equals_vanilla(default_model, default_tokenizer, drafter)


def test_soft_tokens_ride_along_only_when_their_next_pass_pays():
    """P0 = the chance this pass accepts no guess, G = PPD's expected accepted guesses: kept when
    (E + P0 G) / L(with them) beats E / L(without)."""
    model = tiny_model(0)
    soft = SoftTokensOnRoot(random_ppd(model))
    combined = CombinedDrafter([Fixed([5], "x")], soft)
    combined.begin(type("Request", (), {"prompt_ids": [1, 2]})())
    carried = combined.propose()  # root (+ 6 soft-token inputs) -> 5, p(5) = 0.5
    assert len(carried.extra_rows(0)) == 6 and carried.input_count == 8
    bare = carried.with_extra(None)
    expected, ends_at_root = 1.5, 0.5
    gain = soft.ppd.predicted_tokens_per_pass - 1
    for soft_cost, kept in [(0.0, True), (0.01, True), (5.0, False)]:
        latency = Latency({1: 1.0, 2: 1.0, 8: 1.0 + soft_cost})
        assert SoftTokenCosts(latency).extra_inputs_pay(bare, carried, gain) == kept
        assert kept == ((expected + ends_at_root * gain) / latency(8) > expected / latency(2))


def test_soft_tokens_on_deeper_nodes_pay_with_the_chance_the_path_ends_there():
    """PPD's own trees hang soft tokens on every node: the next pass gets their guesses wherever this
    one's accepted path ends, P = the sum over the carrying nodes of P(path ends there)."""
    model = tiny_model(0)
    ppd = random_ppd(model)
    tree = Tree.chain(1, [5, 6], evidence=[(Evidence(("x",), 0.5),), (Evidence(("x",), 0.5),)])
    carried = ppd.carrying(tree, [0, 0, ppd.soft_tokens.count])  # on the deepest node only: P = 1/4
    inputs = carried.input_count
    expected = 1 + 0.5 + 0.25
    for gain in [0.1, 1.0, 10.0]:
        latency = Latency({1: 1.0, 3: 1.0, inputs: 1.5})
        kept = (expected + 0.25 * gain) / 1.5 > expected / 1.0
        assert SoftTokenCosts(latency).extra_inputs_pay(tree, carried, gain) == kept


def test_left_out_soft_tokens_are_probed_again():
    """Soft tokens left out PROBE_EVERY passes in a row ride along once: their estimates can recover."""
    costs = SoftTokenCosts(Latency({1: 1.0, 2: 1.0, 8: 100.0}))
    model = tiny_model(0)
    soft = SoftTokensOnRoot(random_ppd(model))
    bare = Tree.chain(1, [])
    carried = soft.ppd.carrying(bare, [soft.ppd.soft_tokens.count])
    decisions = []
    for _ in range(3 * Costs.PROBE_EVERY):
        decisions.append(costs.extra_inputs_pay(bare, carried, 1.0))
        costs.cut(carried if decisions[-1] else bare)
    assert decisions.count(True) == 2 and not any(decisions[:Costs.PROBE_EVERY])


def test_auto_takes_a_trained_eagle_head_or_ppd_soft_tokens_by_what_the_file_is(monkeypatch, tmp_path):
    """--method auto --trained PATH: EAGLE's head where PATH's JSON says so, else PPD's soft tokens (an
    unreadable one too, whose loading then says what is wrong); the other part is the shipped one."""
    loaded = {}
    monkeypatch.setattr(registry, "eagle_on_backend", lambda model, path, *_: loaded.setdefault("eagle", path))
    monkeypatch.setattr(registry.ppd, "load_drafter", lambda model, path, *_: loaded.setdefault("ppd", path))
    monkeypatch.setattr(registry, "combined_drafter", lambda *_: None)
    for kind, other in [("eagle", "ppd"), ("ppd", "eagle"), (None, "eagle")]:
        path = tmp_path / str(kind)
        path.with_suffix(".safetensors").write_bytes(b"")
        if kind is not None:
            path.with_suffix(".json").write_text(json.dumps({"kind": kind}))
        options = default_options(trained=path)
        loaded.clear()
        registry.auto_drafter(registry.Build(options, None, None, None, None, lambda: None))
        assert loaded[kind or "ppd"] == path, f"--trained {kind}: loaded {loaded}"
        assert loaded[other] == registry.shipped_path(other, options), f"--trained {kind}: loaded {loaded}"
