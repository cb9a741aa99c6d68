"""Cost-aware drafting (cost_aware.py): the chosen subtree is a tree of the candidates, within their
budget, empty when nothing can be accepted, whole when passes cost the same, and the best of all
subtrees by brute force; the acceptance estimates converge to the rate verification accepts; and a
cost-aware drafter still decodes exactly as vanilla greedy."""

import itertools
import random

import pytest
import torch
from hypothesis import given, strategies as st

from methods.cost_aware import AcceptanceEstimates, CostAware, Costs, best_draft_length, best_subtree, draft_could_pay, reach
from decode import generate
from drafters import Drafter, DraftModelDrafter, NGramDrafter, Pass, Request, TrieDrafter, first_layers
from helpers import assert_decodes_as_naive_greedy, naive_greedy, tiny_model, trees
from methods.latency import Latency
from methods.medusa import MedusaDrafter, MedusaHeads
from methods.registry import METHODS, build_drafter, default_options
from tree import Tree
from verify import verify_greedy

latencies = st.dictionaries(st.integers(1, 40), st.floats(0.01, 10.0), min_size=1, max_size=6).map(Latency)


@st.composite
def trees_and_estimates(draw, max_nodes=12, low=0.0, high=1.0):
    tree = draw(trees(max_nodes=max_nodes))
    estimate = st.floats(low, high) | st.just(high)  # p = 1 often: a child then reaches as far as its parent
    p = [1.0] + [draw(estimate) for _ in range(tree.draft_size)]
    return tree, p


def is_subtree(small: Tree, big: Tree) -> bool:
    """`small` is `big` cut to some nodes: the same tokens under the same parents, root kept."""
    paths = {tuple(big.tokens[n] for n in path_nodes(big, node)) for node in range(len(big))}
    return small.tokens[0] == big.tokens[0] and all(
        tuple(small.tokens[n] for n in path_nodes(small, node)) in paths for node in range(len(small)))


def path_nodes(tree, node):
    nodes = [node]
    while tree.parents[nodes[-1]] != -1:
        nodes.append(tree.parents[nodes[-1]])
    return nodes[::-1]


def rate(tree: Tree, p, keep, latency) -> float:
    reached = reach(tree, p)
    return (1 + sum(reached[n] for n in keep if n)) / latency(len(keep))


@given(st.dictionaries(st.integers(1, 64), st.floats(0.01, 10.0), min_size=1, max_size=8))
def test_latency_never_decreases_and_keeps_the_mean(seconds):
    latency = Latency(seconds)
    values = [latency(n) for n in range(1, 70)]
    assert all(a <= b + 1e-12 for a, b in zip(values, values[1:]))
    assert sum(latency.seconds) == pytest.approx(sum(seconds.values()))  # pooling moves, never adds


@given(trees_and_estimates(), latencies)
def test_the_chosen_tree_is_a_subtree_within_the_budget(case, latency):
    tree, p = case
    chosen = best_subtree(tree, p, latency)
    assert len(chosen) <= len(tree) and is_subtree(chosen, tree)
    assert all(0 <= parent < node for node, parent in enumerate(chosen.parents) if node)


@given(trees_and_estimates(high=0.0), latencies)
def test_nothing_is_proposed_when_no_guess_can_be_accepted(case, latency):
    tree, p = case
    assert len(best_subtree(tree, p, latency)) == 1


@given(trees_and_estimates(low=0.01))
def test_flat_costs_keep_every_guess_with_a_chance(case):
    tree, p = case
    chosen = best_subtree(tree, p, Latency.flat())
    assert chosen.tokens == tree.tokens and chosen.parents == tree.parents


@given(trees_and_estimates(max_nodes=9), latencies)
def test_the_chosen_tree_is_the_best_of_all_subtrees(case, latency):
    """Brute force: no subtree (root kept, parents before children) has a higher expected rate."""
    shape, p = case
    tree = Tree(list(range(len(shape))), shape.parents)  # token = node, so the kept nodes are its tokens
    kept = best_subtree(tree, p, latency).tokens
    best = max(rate(tree, p, [0, *nodes], latency) for size in range(len(tree))
               for nodes in itertools.combinations(range(1, len(tree)), size)
               if all(tree.parents[n] == 0 or tree.parents[n] in nodes for n in nodes))
    assert rate(tree, p, kept, latency) >= best - 1e-12


@given(st.floats(0.0, 1.0), st.floats(0.0, 2.0), latencies, st.integers(1, 16))
def test_the_draft_length_drafts_nothing_that_cannot_pass_and_everything_that_is_free(alpha, step_cost, latency, most):
    assert 0 <= best_draft_length(alpha, step_cost, latency, most) <= most
    assert best_draft_length(0.0, step_cost, latency, most) == 0
    if alpha > 0.01:  # free guesses: all of them, or all that still add anything a float can hold
        free = best_draft_length(alpha, 0.0, Latency.flat(), most)
        left_out = sum(alpha ** i for i in range(free + 1, most + 1))
        assert free == most or left_out <= 1e-15, (free, most, left_out)


def test_the_draft_length_follows_leviathans_optimum():
    """With L(n) flat (their cost model: verifying costs one step), the best gamma is the argmax of
    their (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)): 8 for alpha = 0.8 and c = 0.05 (worked out
    by hand), fewer for a dearer draft, none when a draft step costs more than its guesses bring."""
    flat = Latency.flat()
    assert best_draft_length(0.8, 0.05, flat, 64) == 8
    assert best_draft_length(0.8, 0.2, flat, 64) < 8
    assert best_draft_length(0.5, 0.6, flat, 64) == 0


def test_a_draft_known_to_miss_drafts_nothing_before_its_first_probe():
    """The draft's prior acceptance decides its first passes: at 1/2 (an unknown draft) it drafts
    from the start, at a few percent it waits for its probe, and each probe drafts one guess (a
    second input and a draft step each cost a fifth of a pass: a rate of 0.4 would pay, which ten
    verdicts' worth of prior cannot rule out)."""
    cpu = Latency({1: 1.0, 2: 1.2, 8: 1.6})
    unknown, known = Costs(cpu), Costs(cpu)
    assert unknown.draft_length(0.2, 4, prior=0.5) > 0
    lengths = [known.draft_length(0.2, 4, prior=0.03) for _ in range(Costs.PROBE_EVERY + 1)]
    assert lengths == [0] * Costs.PROBE_EVERY + [1]


def test_a_draft_probes_only_while_its_rate_could_pay():
    """A probe costs a draft step and a larger pass: a draft whose rate cannot plausibly pay (the
    self-draft's few percent, where a second input costs a quarter of a pass) never probes; where
    inputs are free it probes, and stops once its misses make even an optimistic rate too low."""
    cpu, free = Latency({1: 1.0, 2: 1.26, 8: 1.6}), Latency.flat()
    self_draft = DraftModelDrafter.SELF_DRAFT_ALPHA
    assert not draft_could_pay(self_draft, AcceptanceEstimates.PRIOR_WEIGHT, 0.32, cpu)
    assert draft_could_pay(self_draft, AcceptanceEstimates.PRIOR_WEIGHT, 0.32, free)
    assert not draft_could_pay(self_draft, 100, 0.32, free)
    costs = Costs(cpu)
    assert [costs.draft_length(0.32, 4, prior=self_draft) for _ in range(4 * Costs.PROBE_EVERY)] == [0] * 4 * Costs.PROBE_EVERY
    costs = Costs(free)
    lengths = []
    for _ in range(40):  # every probe misses
        lengths.append(costs.draft_length(0.32, 4, prior=self_draft))
        if lengths[-1]:
            costs.idle = 0
            costs.estimates.record(("draft",), False)
    assert lengths[Costs.PROBE_EVERY] == 1  # (the first probe, after PROBE_EVERY idle passes)
    probes_while_free = sum(lengths)
    costs.estimates.judged[("draft",)] += 90  # 100 verdicts, all misses
    assert all(costs.draft_length(0.32, 4, prior=self_draft) == 0 for _ in range(4 * Costs.PROBE_EVERY))
    assert probes_while_free >= 2


def test_the_self_draft_starts_from_its_measured_acceptance(default_model, default_tokenizer):
    options = default_options(draft_layers=4)
    built = build_drafter(METHODS["speculative"], options, default_model, default_tokenizer, latency=Latency.flat())
    assert built.drafter.prior_alpha == DraftModelDrafter.SELF_DRAFT_ALPHA < 0.1
    assert DraftModelDrafter(first_layers(default_model, 1)).prior_alpha == 0.5


def test_a_child_as_likely_as_its_parent_comes_after_it():
    """root -> a (p 0.6) -> b (p 1): a and b reach equally far; one guess pays, two do not, and the
    one must be a (b alone would hang from a node not sent)."""
    tree = Tree([0, 1, 2], [-1, 0, 1])
    latency = Latency({1: 1.0, 2: 1.1, 3: 1.8})
    assert best_subtree(tree, [1.0, 0.6, 1.0], latency).tokens == [0, 1]


def test_latency_interpolates_and_never_decreases():
    latency = Latency({1: 1.0, 4: 2.5, 8: 2.0, 16: 4.0})
    assert latency(1) == latency(0) == 1.0
    assert latency(4) == latency(8) == pytest.approx(2.25)  # a noisy dip is pooled with its neighbour
    assert latency(2) == pytest.approx(1 + 1.25 / 3)
    assert latency(12) == pytest.approx(3.125)
    assert latency(32) == pytest.approx(2.25 + 1.75 * 3)  # along the last segment
    with pytest.raises(ValueError):
        Latency({1: 0.0})


# ---- online calibration --------------------------------------------------------------------------

class ScriptedGuesser(Drafter):
    """Chains of 4 guesses, each vanilla's next token with probability `rate` (else a wrong one), filed
    under one key with a prior far from the truth."""

    def __init__(self, answer, vocab, rate, seed=0):
        self.answer, self.vocab, self.rate = answer, vocab, rate
        self.rng = random.Random(seed)
        self.max_extra_inputs = 4

    def begin(self, request):
        super().begin(request)
        self.prompt_length = len(request.prompt_ids)  # then the answer, the root its last token so far

    def propose(self):
        done = len(self.history) - self.prompt_length
        right = self.answer[done:done + 4]
        guesses = [t if self.rng.random() < self.rate else (t + 1) % self.vocab for t in right]
        return Tree.chain(self.history[-1], guesses, evidence=[((("scripted",), 0.05),)] * len(guesses))


@pytest.mark.parametrize("rate", [0.3, 0.8])
def test_estimates_converge_to_the_acceptance_rate(rate):
    """Through the real loop on a tiny model: after a long answer the estimate for the key is the
    rate at which its guesses were right (a wrong prior is outweighed). Flat costs, so every guess is
    sent and judged."""
    model = tiny_model(1, vocab=16, max_positions=1024)
    answer = naive_greedy(model, [3, 1], 600)
    drafter = CostAware(ScriptedGuesser(answer, 16, rate), Costs(Latency.flat()))
    got = generate(model, [3, 1], max_new_tokens=600, eos_ids=set(), drafter=drafter).token_ids
    assert got == answer
    estimates = drafter.costs.estimates
    assert estimates.judged[("scripted",)] > 300
    assert estimates.probability(("scripted",), 0.05) == pytest.approx(rate, abs=0.06)


def test_a_guess_two_sources_agree_on_is_estimated_by_its_own_verdicts():
    """A guess on two kinds of evidence starts at the more confident one's estimate; then its own verdicts
    decide, as they would for a kind of guess of its own, while each kind alone keeps its estimate for the
    guesses it makes alone. (Taking the more confident of the two every time sent, on chat, the trie's
    one-token match at its prior's 0.46 with ANPD's, rejected pass after pass.)"""
    trie, ngram = (("lookahead", 1, 3), 0.46), (("anpd", 1, 1), 0.21)
    tree = Tree([0, 1], [-1, 0], evidence=[(), (trie, ngram)])
    logits = torch.zeros(2, 8)
    logits[0, 2] = 1.0  # the model wants 2: the guess 1 is rejected
    verdict = verify_greedy(tree, logits)
    costs = Costs(Latency.flat())
    assert costs.estimates_of(tree)[1] == pytest.approx(0.46)
    for _ in range(20):
        costs.learn(Pass(tree, 0, verdict.path, verdict.tokens, torch.zeros(2, 1), logits, verdict))
    joint = costs.estimates_of(tree)[1]
    assert joint == pytest.approx(10 * costs.estimates.probability(*trie) / 30)  # the trie's, worth 10 verdicts, and 20 misses
    assert joint < costs.estimates.probability(*trie) < 0.46  # (each kind's verdicts count for it alone too)
    alone = Tree([0, 1], [-1, 0], evidence=[(), (trie,)])
    assert costs.estimates_of(alone)[1] == pytest.approx(costs.estimates.probability(*trie))


@pytest.mark.parametrize("latency, sent", [
    ({1: 1.0, 4: 1.6}, [0, 1, 3]),  # a (0.6) and its child c (reach 0.3) pay on their priors, b (0.1) not
    ({1: 1.0, 2: 3.0}, [0, 1]),  # a guess costs two passes: no prior pays, a (the likeliest) goes alone
])
def test_a_probe_sends_what_the_priors_make_pay_and_at_least_their_likeliest_guess(latency, sent):
    """Estimates made low by misses cut every guess; a probe then sends the part of the candidates that
    the sources' priors make pay (what the generation's first passes sent), never the root alone.
    Sent whole, a probe of Token Recycling's 16 inputs cost 3.9 passes in bfloat16."""
    a, b, c = ("a",), ("b",), ("c",)
    candidates = Tree([0, 1, 2, 3], [-1, 0, 0, 1], evidence=[(), ((a, 0.6),), ((b, 0.1),), ((c, 0.5),)])
    costs = Costs(Latency(latency))
    for key in (a, b, c):
        for _ in range(40):
            costs.estimates.record(key, False)
    assert len(costs.cut(candidates)) == 1  # (the estimates alone cut everything)
    costs.idle = costs.probe_after
    probe = costs.cut(candidates)
    assert costs.probing and probe.tokens == [candidates.tokens[node] for node in sent]


def test_a_probe_of_a_sampled_chain_sends_it_as_drafted():
    """Exact speculative sampling: whether a sampled guess is sent must not depend on itself (its own
    confidence is its prior), so a probe sends a draft model's chain whole."""
    chain = Tree.chain(0, [1, 2], draft_probs=torch.full((2, 4), 0.25), evidence=[((("d",), 0.01),)] * 2)
    costs = Costs(Latency({1: 1.0, 2: 3.0}))
    costs.idle = costs.probe_after + 1
    assert costs.cut(chain).tokens == [0, 1, 2]


def test_a_probe_pays_when_its_accepted_guesses_cover_its_inputs():
    """A probe of five inputs that keeps one guess: two tokens for L(5). Where L(5) is 1.5 L(1) it paid
    (the wait starts again from PROBE_EVERY); where it is 3 L(1) it did not (the wait doubles)."""
    tree = Tree([0, 1, 2, 3, 4], [-1, 0, 1, 2, 3], evidence=[()] + [((("a",), 0.5),)] * 4)
    logits = torch.zeros(5, 8)
    logits[0, 1] = logits[1, 5] = 1.0  # node 1 accepted, node 2 rejected
    verdict = verify_greedy(tree, logits)
    for l5, wait in [(1.5, Costs.PROBE_EVERY), (3.0, 4 * Costs.PROBE_EVERY)]:
        costs = Costs(Latency({1: 1.0, 5: l5}))
        costs.probe_after, costs.probing = 2 * Costs.PROBE_EVERY, True
        costs.learn(Pass(tree, 0, verdict.path, verdict.tokens, torch.zeros(5, 1), logits, verdict))
        assert costs.probe_after == wait


def test_a_judged_guess_counts_once_and_unreached_ones_not_at_all():
    tree = Tree([0, 1, 2, 3, 4], [-1, 0, 1, 0, 3],
                evidence=[(), ((("a",), 0.5),), ((("b",), 0.5),), ((("c",), 0.5),), ((("d",), 0.5),)])
    logits = torch.zeros(5, 8)
    logits[0, 1] = logits[1, 5] = 1.0  # the model takes node 1, then 5: node 2 rejected, 3 rejected, 4 unreached
    drafter = CostAware(Drafter(), Costs(Latency.flat()))
    drafter.begin(Request([0]))
    verdict = verify_greedy(tree, logits)
    drafter.after_pass(Pass(tree, 0, verdict.path, verdict.tokens, torch.zeros(5, 1), logits, verdict))
    assert dict(drafter.costs.estimates.judged) == {("a",): 1, ("b",): 1, ("c",): 1}
    assert dict(drafter.costs.estimates.accepted) == {("a",): 1}


# ---- still lossless ------------------------------------------------------------------------------

@given(st.integers(0, 3), st.lists(st.integers(0, 15), min_size=1, max_size=12), st.integers(1, 24), latencies)
def test_cost_aware_drafters_decode_as_vanilla_greedy(seed, prompt, max_new_tokens, latency):
    model = tiny_model(seed)
    for make in [lambda costs: NGramDrafter(n=3, k=4), lambda costs: TrieDrafter(decoding_length=6, branch_length=3),
                 lambda costs: DraftModelDrafter(first_layers(model, 1), gamma=3, step_cost=0.1, costs=costs)]:
        costs = Costs(latency)
        assert_decodes_as_naive_greedy(generate, model, prompt, max_new_tokens, CostAware(make(costs), costs))


def test_siblings_estimates_never_add_up_to_more_than_one():
    """The model takes at most one child of a node: two sources' different guesses are scaled down
    together when their estimates would add up past 1."""
    tree = Tree([0, 1, 2, 3], [-1, 0, 0, 1], evidence=[(), ((("a",), 0.8),), ((("b",), 0.6),), ((("c",), 0.9),)])
    drafter = CostAware(Drafter(), Costs(Latency.flat()))
    drafter.begin(Request([0]))
    assert drafter.costs.estimates_of(tree) == pytest.approx([1.0, 0.8 / 1.4, 0.6 / 1.4, 0.9])


def medusa_drafter(model, accuracy, seed=0, costs=None):
    heads = MedusaHeads(model.config.hidden_size, len(accuracy)).double()
    torch.manual_seed(seed)
    for parameter in heads.parameters():
        parameter.data += 0.1 * torch.randn_like(parameter)
    return MedusaDrafter(model, heads, accuracy, inputs=6, costs=costs)


@given(st.integers(0, 3), st.lists(st.integers(0, 15), min_size=1, max_size=12), st.integers(1, 24), latencies)
def test_cost_aware_medusa_decodes_as_vanilla_greedy(seed, prompt, max_new_tokens, latency):
    model = tiny_model(seed)
    costs = Costs(latency)
    drafter = CostAware(medusa_drafter(model, [[0.4, 0.2], [0.3, 0.1]], seed, costs), costs)
    assert_decodes_as_naive_greedy(generate, model, prompt, max_new_tokens, drafter)


@pytest.mark.parametrize("pair_latency, runs", [(1.40, True), (1.45, False)])
def test_heads_run_only_when_their_best_tree_beats_the_root_alone_without_their_time(pair_latency, runs):
    """A guess accepted half the time, at 2 inputs: 1.5 tokens for L(2) + the heads' 0.05 against 1
    token for L(1) = 1, which pays the heads their time (not the root alone's) only when L(2) < 1.45.
    Charging the heads' time to the root alone as well would run them at 1.45 too, and lose."""
    costs = Costs(Latency({1: 1.0, 2: pair_latency}))
    shape = Tree([0, 1], [-1, 0], evidence=[(), ((("head 1",), 0.5),)])
    assert costs.worth_running(shape, [0.05]) is runs


def test_medusa_heads_do_not_run_when_no_guess_of_theirs_could_pay():
    """Heads whose guesses are never right (accuracy 0) are run once, to time them, then only on probes."""
    model = tiny_model(0)
    costs = Costs(Latency({1: 1.0, 2: 1.5}))
    drafter = CostAware(medusa_drafter(model, [[0.0, 0.0], [0.0, 0.0]], costs=costs), costs)
    runs = []
    heads = drafter.drafter.heads
    heads.register_forward_hook(lambda *_: runs.append(1))
    generate(model, [1, 2, 3], max_new_tokens=60, eos_ids=set(), drafter=drafter)
    assert 1 <= len(runs) <= 1 + 60 // Costs.PROBE_EVERY
