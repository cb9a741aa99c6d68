"""Cost-aware guessing: each step, the part of the method's tree that maximises expected tokens per
second, so that a step guesses only what pays, and nothing when nothing does.

A pass over n inputs yields 1 + (accepted guesses) tokens and costs L(n). PPD chooses its tree size
once per machine by tau(n) / L(n) (Chen et al. 2024, section 4.2, "Hardware-awareness"; calibrate.py).
This chooses per step, from what the drafter knows now, as dynamic draft trees do (EAGLE-2, Li et al.
2024: rank a draft tree's nodes by their estimated chance of acceptance, the product of confidences
along the path, and keep the best; SpecDec++, Huang et al. 2024: stop drafting where the expected
gain no longer covers the cost):

    p(node)      = P(node accepted | its parent accepted)    # AcceptanceEstimates, calibrated online
    reach(node)  = product of p along its path from the root # PPD proposition 4.1
    E[tokens]    = 1 + sum of reach over the kept nodes      # the bonus token, and each accepted guess
    keep         = the prefix of the nodes sorted by reach that maximises E[tokens] / L(inputs)

A child never reaches further than its parent (p <= 1; ties are broken parents first), so every
prefix of that order is a tree; with one input per node it is the best tree of its size (the
argument of tree.best_sparse_tree), and the best size is found by trying each. The root alone is a
prefix too: a step proposes nothing when no guess pays for its input.

Guesses *sampled* from a draft model are the exception (best_chain_prefix): exact speculative
sampling needs each sent guess to be a fresh draw from q, so whether a guess is sent may depend on
the guesses before it, never on itself or on those after it.

Each guess carries evidence (tree.Tree.evidence): a key saying what kind of guess it is (an n-gram of
level 4 seen twice, a trie branch taking three quarters of its siblings' occurrences, a Medusa head's
rank-2 guess at distance 1, a draft model's guess of confidence 0.6) and the source's prior for its
chance. After every pass, each judged guess (its parent accepted) counts as a success or a failure
for its key, so the estimates follow what verification accepts in this generation; a guess made on
several kinds of evidence (`--method auto`'s sources agreeing on it) is a kind of its own too
(joint_key). The method's own tree (its size option) is the candidate set and the upper bound:
`--fixed-size` sends it whole, as the papers do.

What a pass costs: L(n), a whole pass of the loop over n inputs on this machine (latency.py: saved
once per machine, and corrected by every pass this run times: `learn` shows it each pass's seconds),
plus the drafter's own mean time per pass (Medusa's heads, retrieval). The first passes of a run send
the root alone (what sending nothing costs) until L is measured there, so that a wrong saved L(n)
cannot make guesses look cheaper next to it than they are.
`Costs` holds all of it for one generation; `CostAware` wraps any drafter and cuts its trees with it.
A drafter that pays before its tree can be cut asks the same `Costs` itself: a draft model drafts only
as many guesses as pay (`draft_length`), Medusa runs its heads only when their tree could pay their
time too (`worth_running`); PPD's soft tokens ride along only when they pay (ppd.SoftTokenCosts, the
same rules for extra inputs). After PROBE_EVERY passes in a row whose guesses were all cut, a probe
sends the part of them that their sources' priors make pay, and at least the likeliest (`probe`), so
that estimates made low by a few early misses can recover (a probe whose accepted guesses do not pay
for its inputs doubles the wait for the next); a draft model's probe, which costs a draft step too,
only while its rate could plausibly pay (`draft_could_pay`).
"""

import math
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from drafters import Drafter, Pass
from methods.latency import Latency, OnlineLatency
from tree import Evidence, Tree

Key = tuple  # what a guess's outcome is filed under


@dataclass
class Cut:
    """What one proposal offered and what was sent (visualize.py cost draws a generation of them)."""
    candidates: int  # guesses the drafter offered
    sent: int  # guesses kept
    expected: float  # the accepted guesses the estimates expected of those kept


class AcceptanceEstimates:
    """P(a guess is accepted | its parent was), per evidence key: the mean of a Beta posterior whose
    prior is the source's own estimate, worth PRIOR_WEIGHT observations, updated with every judged
    guess of the generation."""

    PRIOR_WEIGHT = 10.0

    def __init__(self):
        self.accepted: Counter = Counter()
        self.judged: Counter = Counter()

    def probability(self, key: Key, prior: float) -> float:
        return (self.accepted[key] + self.PRIOR_WEIGHT * prior) / (self.judged[key] + self.PRIOR_WEIGHT)

    def of_node(self, evidence: Sequence[Evidence]) -> float:
        """A guess's estimate (0 with no evidence). One kind of evidence: its key's. Several (sources
        that agree on the guess, or branches of one source through it): their agreement is a kind of
        guess of its own (`joint_key`), whose prior is the most confident of their estimates and whose
        own verdicts then decide. Agreement is not independent evidence: ANPD's guess after a one-token
        match and the trie's are the same observation twice, and taking the more confident of the two
        (the trie's higher prior) sent that guess pass after pass on chat, rejected nearly every time."""
        best = max((self.probability(key, prior) for key, prior in evidence), default=0.0)
        return best if len(evidence) < 2 else self.probability(joint_key(evidence), best)

    def record(self, key: Key, accepted: bool) -> None:
        self.judged[key] += 1
        if accepted:
            self.accepted[key] += 1


def prior_of(evidence: Sequence[Evidence]) -> float:
    """A guess's estimate before any verdict: the most confident of its sources' priors (0 with none)."""
    return max((prior for _, prior in evidence), default=0.0)


def joint_key(evidence: Sequence[Evidence]) -> Key:
    """The key of a guess made on several kinds of evidence: all of them, in a fixed order."""
    return ("joint", *sorted(key for key, _ in evidence))


def reach(tree: Tree, p: Sequence[float]) -> list[float]:
    """reach[i]: the chance that node i is accepted, the product of p along its path (root: 1)."""
    reached = [1.0] * len(tree)
    for node in range(1, len(tree)):
        reached[node] = reached[tree.parents[node]] * p[node]
    return reached


def best_chain_prefix(tree: Tree, p: Sequence[float], latency: Callable[[int], float]) -> Tree:
    """For a *sampled* chain: go down while the next guess raises the expected rate, and stop at the
    first that does not. Whether guess i is sent then depends on the guesses before it only, never
    on itself, which exact speculative sampling needs: the guess must be a fresh draw from q. (Cutting
    by the best prefix, as best_subtree does, would look at guess i and the guesses after it, and bias
    the output; tests/test_sampling_decode.py catches that.)"""
    expected, reached, rows = 1.0, 1.0, 1  # a chain: node i is at depth i, one input each
    for node in range(1, len(tree)):
        reached *= p[node]
        if (expected + reached) / latency(rows + 1) <= expected / latency(rows):
            break
        expected, rows = expected + reached, rows + 1
    return tree if rows == len(tree) else tree.subtree(list(range(rows)))


def best_subtree_nodes(tree: Tree, p: Sequence[float], latency: Callable[[int], float]) -> list[int]:
    """The nodes (ascending, root first) of the subtree of the largest expected tokens per second:
    the first k in the order of reach, for the best k (see the module docstring). A node's inputs are
    itself and its extra inputs (soft tokens)."""
    reached = reach(tree, p)
    inputs = [tree.inputs_of(node) for node in range(len(tree))]
    order = sorted(range(1, len(tree)), key=lambda node: (-reached[node], node))
    expected, rows = 1.0, inputs[0]
    best_rate, best_k = expected / latency(rows), 0
    for k, node in enumerate(order, start=1):
        expected, rows = expected + reached[node], rows + inputs[node]
        if expected / latency(rows) > best_rate:  # strictly: a guess that adds nothing is left out
            best_rate, best_k = expected / latency(rows), k
    return [0] + sorted(order[:best_k])


def best_rate(reached: Sequence[float], most: int, latency: Callable[[int], float], seconds: float = 0.0) -> float:
    """The most expected tokens per second of a pass that sends at most `most` of the guesses whose
    chances of acceptance are `reached` (the likeliest first; each one input), when `seconds` more are
    spent on it: max over k of (1 + the k highest chances) / (L(1 + k) + seconds). The chances must be
    of a tree whose parents are at least as likely as their children, for its prefixes to be trees."""
    expected = 1.0
    best = expected / (latency(1) + seconds)
    for k, chance in enumerate(sorted(reached, reverse=True)[:most], start=1):
        expected += chance
        best = max(best, expected / (latency(1 + k) + seconds))
    return best


def best_subtree(tree: Tree, p: Sequence[float], latency: Callable[[int], float]) -> Tree:
    """The subtree (root included) of the largest expected tokens per second (best_subtree_nodes)."""
    nodes = best_subtree_nodes(tree, p, latency)
    return tree if len(nodes) == len(tree) else tree.subtree(nodes)


def best_draft_length(alpha: float, step_cost: float, latency: Callable[[int], float], most: int) -> int:
    """The gamma in 0..most of the largest expected tokens per second when every guess is accepted
    with probability alpha and a draft step costs step_cost L(1): the gamma that maximises Leviathan
    et al. 2023's expected walltime improvement (1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)),
    with the verifying pass's measured L(gamma + 1) in place of their one step. Before drafting, only
    alpha is known: it is estimated from this generation's verdicts of the draft's guesses."""
    def rate(gamma):
        expected = sum(alpha ** i for i in range(gamma + 1))  # (1 - alpha^(gamma+1)) / (1 - alpha)
        return expected / (latency(gamma + 1) + gamma * step_cost * latency(1))
    return max(range(most + 1), key=lambda gamma: (rate(gamma), -gamma))


# a draft's probe costs a draft step and a larger pass, whatever comes of it: sent only while the
# draft's rate could still be high enough to pay, at this confidence (draft_could_pay)
PROBE_CONFIDENCE = 0.95


def draft_could_pay(alpha: float, verdicts: float, step_cost: float, latency: Callable[[int], float]) -> bool:
    """Whether a draft whose estimated acceptance rate is `alpha`, from `verdicts` verdicts (its
    prior's weight included), could draft a guess that pays (best_draft_length > 0) at the highest
    rate the evidence allows with PROBE_CONFIDENCE: Hoeffding's bound, alpha + sqrt(ln(1 / (1 -
    confidence)) / (2 verdicts)). The built-in self-draft (4.5% of its guesses right, a step 0.32 of
    a pass) cannot where a second input costs a quarter of a pass (this CPU), so it never probes
    there; where inputs are free (a GPU) it probes until about 15 more misses say it cannot."""
    optimistic = min(1.0, alpha + math.sqrt(math.log(1 / (1 - PROBE_CONFIDENCE)) / (2 * verdicts)))
    return best_draft_length(optimistic, step_cost, latency, 1) > 0


class Costs:
    """What cost-aware drafting knows during one generation: L(n), the acceptance estimates learned
    from this generation's verdicts, the drafter's own time per pass, and when to probe."""

    # after this many passes whose guesses were all cut, one pass probes them (`probe`; a draft model
    # drafts one): estimates made low by a few early misses would otherwise never be corrected. A
    # probe that does not pay for its inputs doubles the wait before the next one (a hopeless guesser
    # costs ever less).
    PROBE_EVERY = 16

    def __init__(self, latency: Latency | OnlineLatency):
        self.latency = latency
        self.begin()

    def begin(self) -> None:
        self.estimates = AcceptanceEstimates()
        self.idle = 0  # passes in a row whose guesses were all cut (or never made)
        self.probe_after, self.probing = self.PROBE_EVERY, False
        self.drafter_seconds, self.passes = 0.0, 0  # the drafter's own time, a cost of every pass too

    def pass_cost(self, inputs: int) -> float:
        """Seconds of a pass over `inputs` inputs: L(n), and the drafter's mean time per pass so far
        (Medusa's heads, say, cost a few milliseconds whatever the tree)."""
        return self.latency(inputs) + self.drafter_seconds / max(self.passes, 1)

    def timed(self, work):
        """Run the drafter's `work()`, its seconds counted as a cost of every pass."""
        started = time.perf_counter()
        result = work()
        self.drafter_seconds += time.perf_counter() - started
        return result

    def estimates_of(self, tree: Tree, priors: bool = False) -> list[float]:
        """p per node: the root's 1, then each guess's acceptance estimate (`priors`: its sources' own,
        as before any verdict), scaled down where a node's children's estimates add up to more than 1:
        they are different tokens, and the model takes at most one of them (greedily; two sources
        guessing differently cannot both be right)."""
        of_node = prior_of if priors else self.estimates.of_node
        p = [1.0] + [of_node(e) for e in tree.evidence[1:]]
        for children in tree.children:
            total = sum(p[child] for child in children)
            if total > 1:
                for child in children:
                    p[child] /= total
        return p

    def cut(self, candidates: Tree) -> Tree:
        """The part of the candidates that pays (best_subtree; best_chain_prefix for a sampled chain),
        or on a probe the part that their priors make pay (`probe`)."""
        self.passes += 1
        root_alone = candidates.subtree([0])
        if not self.latency.measured_enough(root_alone.input_count):
            return root_alone
        tree = self.best_part(candidates)
        if len(tree) > 1:
            self.idle = 0
        elif self.left_something_out(candidates):
            self.idle += 1
        if self.probe_now():
            tree, self.idle, self.probing = self.probe(candidates), 0, True
        return tree

    def left_something_out(self, candidates: Tree) -> bool:
        """Whether a pass that sends the root alone left out something it was offered."""
        return len(candidates) > 1

    def probe_now(self) -> bool:
        return self.idle > self.probe_after

    def probe(self, candidates: Tree) -> Tree:
        """What a probe sends: the part of the candidates that their sources' priors make pay, what the
        generation's first passes sent before any verdict, and at least the guess the priors rate
        highest (a sampled chain whole: as drafted). Sent whole, a probe of Token Recycling's 16 inputs
        cost 3.9 passes in bfloat16; cut so, its probes sent one or two guesses there (docs/results.md,
        "Probes cut to what the priors pay")."""
        if candidates.draft_probs is not None or len(candidates) == 1:
            return candidates
        p = self.estimates_of(candidates, priors=True)
        nodes = best_subtree_nodes(candidates, p, self.pass_cost)
        return candidates.subtree(nodes if len(nodes) > 1 else [0, max(candidates.children[0], key=p.__getitem__)])

    def learn(self, done: Pass) -> None:
        """The pass's seconds a measurement of L at its size; each judged guess (its parent accepted)
        a success or a failure for its evidence keys."""
        if done.verdict is not None:  # (not the prefill: a pass over the prompt, on an empty cache)
            self.latency.observe(done.tree.input_count, done.seconds)
        if self.probing:
            paid = (1 + done.guesses_kept) * self.latency(1) >= self.latency(done.tree.input_count)
            self.probe_after = self.PROBE_EVERY if paid else 2 * self.probe_after
            self.probing = False
        for node, outcome in enumerate(done.outcomes()):
            if node and outcome != "unreached":
                evidence = done.tree.evidence[node]
                for key in [key for key, _ in evidence] + ([joint_key(evidence)] if len(evidence) > 1 else []):
                    self.estimates.record(key, outcome == "accepted")

    def draft_length(self, step_cost: float, most: int, prior: float) -> int:
        """How many guesses a draft model whose step costs `step_cost` L(1) should draft now
        (best_draft_length), from its acceptance rate so far (all its guesses pooled; `prior`, the
        draft's rate before any verdict, worth PRIOR_WEIGHT guesses); one on a probe, if a rate as
        high as the evidence plausibly allows would pay for it (draft_could_pay)."""
        if not self.latency.measured_enough(1):
            return 0
        accepted, judged = sum(self.estimates.accepted.values()), sum(self.estimates.judged.values())
        weight = AcceptanceEstimates.PRIOR_WEIGHT
        alpha = (accepted + prior * weight) / (judged + weight)
        gamma = best_draft_length(alpha, step_cost, self.latency, most)
        self.idle = self.idle + 1 if gamma == 0 else 0
        if self.idle > self.probe_after and draft_could_pay(alpha, judged + weight, step_cost, self.latency):
            return 1  # (cut() resets the count when the guess is sent)
        return gamma

    def worth_running(self, shape: Tree, seconds: Sequence[float]) -> bool:
        """Whether a guesser that costs its time whatever is sent (`seconds`: its runs so far) should
        run for a tree of `shape` (its evidence depends on distance and rank, not on the tokens): when
        the best part of it, as the estimates stand and with that time added to its pass, beats the
        pass it saves that time on, the root alone; always before it ever ran and on a probe. The
        drafting time it costs on every pass either way (the rest of pass_cost's) is in both. A pass
        it skips counts as one whose guesses were cut."""
        if not self.latency.measured_enough(1):
            return False  # (cut sends the root alone)
        if not seconds or self.idle >= self.probe_after:
            return True
        own = sum(seconds[-8:]) / len(seconds[-8:])
        rest = max(0.0, self.drafter_seconds - sum(seconds)) / max(self.passes, 1)

        def running(inputs):  # a pass's seconds when the guesser ran before it
            return self.latency(inputs) + rest + own
        best = best_subtree(shape, self.estimates_of(shape), running)
        if self.expected_tokens(best) / running(best.input_count) > 1 / (self.latency(1) + rest):
            return True
        self.idle += 1
        return False

    def expected_tokens(self, tree: Tree) -> float:
        """Tokens a pass over `tree` is expected to yield, as the estimates stand: the sum of reach over
        its nodes (the root's 1 is the token every pass yields)."""
        return sum(reach(tree, self.estimates_of(tree)))

    def best_part(self, tree: Tree) -> Tree:
        """The part of `tree` that pays, as the estimates stand."""
        chop = best_subtree if tree.draft_probs is None else best_chain_prefix
        return chop(tree, self.estimates_of(tree), self.pass_cost)


class CostAware(Drafter):
    """Any drafter's trees, cut each pass to the part that pays on this machine (`Costs.cut`), with
    the acceptance estimates learned from this generation's verdicts (`Costs.learn`)."""

    predicted_tokens_per_pass = None  # the cut changes every pass

    def __init__(self, drafter: Drafter, costs: Costs):
        self.drafter, self.costs = drafter, costs
        self.max_extra_inputs = drafter.max_extra_inputs

    def begin(self, request):
        self.costs.begin()
        self.drafter.begin(request)

    def prefill_tree(self, prompt_ids):
        return self.drafter.prefill_tree(prompt_ids)

    def propose(self):
        candidates = self.costs.timed(self.drafter.propose)
        tree = self.costs.cut(candidates)
        self.last_cut = Cut(candidates.draft_size, tree.draft_size, self.costs.expected_tokens(tree) - 1)
        return tree

    def after_pass(self, done):
        self.costs.learn(done)
        self.costs.timed(lambda: self.drafter.after_pass(done))
