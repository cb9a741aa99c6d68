"""Cost-aware guessing: each step, the part of the method's tree that maximises expected tokens per
second, so that a step guesses only what pays, and nothing when nothing does.

A pass over n inputs yields 1 + (accepted guesses) tokens and costs L(n). PPD chooses its tree size
once per machine by tau(n) / L(n) (Chen et al. 2024, section 4.2, "Hardware-awareness"; calibrate.py).
This chooses per step, from what the drafter knows now, as dynamic draft trees do (EAGLE-2, Li et al.
2024, section 4: rank the nodes by their estimated chance of acceptance and keep the best; SpecDec++,
Huang et al. 2024, section 3: stop guessing where the expected gain no longer covers the cost):

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
for its key, so the estimates follow what verification accepts in this generation. The method's own
tree (its size option) is the candidate set and the upper bound: `--fixed-size` sends it whole, as
the papers do.
"""

import bisect
from collections import Counter
from collections.abc import Callable, Sequence

from drafters import Drafter
from tree import Tree

Key = tuple  # what a guess's outcome is filed under


class Latency:
    """L(n): seconds for one forward pass over n inputs, interpolated linearly between measured sizes
    (and extended along the last segment), never decreasing in n."""

    def __init__(self, seconds: dict[int, float]):
        if not seconds or min(seconds) < 1 or min(seconds.values()) <= 0:
            raise ValueError("L(n) needs positive seconds for sizes n >= 1")
        self.sizes = sorted(seconds)
        running = 0.0
        self.seconds = [running := max(running, seconds[n]) for n in self.sizes]

    @classmethod
    def flat(cls) -> "Latency":
        """Every pass costs the same, whatever its size (a GPU far from saturated, roughly)."""
        return cls({1: 1.0})

    def __call__(self, rows: int) -> float:
        sizes, seconds = self.sizes, self.seconds
        if len(sizes) == 1 or rows <= sizes[0]:
            return seconds[0]
        i = min(max(bisect.bisect_left(sizes, rows), 1), len(sizes) - 1)
        slope = (seconds[i] - seconds[i - 1]) / (sizes[i] - sizes[i - 1])
        return seconds[i - 1] + slope * (rows - sizes[i - 1])

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.sizes, self.seconds))


class AcceptanceEstimates:
    """P(a guess is accepted | its parent was), per evidence key: the mean of a Beta posterior whose
    prior is the source's own estimate, worth PRIOR_WEIGHT observations, updated with every judged
    guess of the generation."""

    PRIOR_WEIGHT = 4.0

    def __init__(self):
        self.accepted: Counter = Counter()
        self.judged: Counter = Counter()

    def probability(self, key: Key, prior: float) -> float:
        return (self.accepted[key] + self.PRIOR_WEIGHT * prior) / (self.judged[key] + self.PRIOR_WEIGHT)

    def of_node(self, evidence: Sequence[tuple]) -> float:
        """A guess's estimate: the most confident of the sources that guessed it (0 with none)."""
        return max((self.probability(key, prior) for key, prior in evidence), default=0.0)

    def record(self, key: Key, accepted: bool) -> None:
        self.judged[key] += 1
        if accepted:
            self.accepted[key] += 1


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


def best_subtree(tree: Tree, p: Sequence[float], latency: Callable[[int], float]) -> Tree:
    """The subtree (root included) of the largest expected tokens per second: its nodes are the first
    k in the order of reach, for the best k (see the module docstring). A node's inputs are itself and
    its soft tokens."""
    reached = reach(tree, p)
    inputs = [1 + count * tree.ensembles for count in tree.soft_counts]
    order = sorted(range(1, len(tree)), key=lambda node: (-reached[node], node))
    expected, rows = 1.0, inputs[0]
    best_rate, best_k = expected / latency(rows), 0
    for k, node in enumerate(order, start=1):
        expected, rows = expected + reached[node], rows + inputs[node]
        if expected / latency(rows) > best_rate:  # strictly: a guess that adds nothing is left out
            best_rate, best_k = expected / latency(rows), k
    if best_k == len(order):
        return tree
    return tree.subtree([0] + sorted(order[:best_k]))


class CostAware(Drafter):
    """Any drafter's trees, cut each step to what pays on this machine (best_subtree), with the
    acceptance estimates learned from this generation's verdicts."""

    def __init__(self, drafter: Drafter, latency: Latency):
        self.drafter, self.latency = drafter, latency
        self.max_draft_tokens = drafter.max_draft_tokens

    def begin(self, request):
        self.estimates = AcceptanceEstimates()
        self.drafter.begin(request)

    def propose(self):
        candidates = self.drafter.propose()
        p = [1.0] + [self.estimates.of_node(e) for e in candidates.evidence[1:]]
        cut = best_subtree if candidates.draft_probs is None else best_chain_prefix
        return cut(candidates, p, self.latency)

    def verified(self, tree, verdict):
        for node, outcome in enumerate(verdict.outcomes(tree)):
            if node and outcome != "unreached":
                for key, _ in tree.evidence[node]:
                    self.estimates.record(key, outcome == "accepted")
        self.drafter.verified(tree, verdict)

    def extend(self, tokens):
        self.drafter.extend(tokens)

    def observe(self, hidden, soft_logits):
        self.drafter.observe(hidden, soft_logits)

    def prompt_tree(self, prompt_ids):
        return self.drafter.prompt_tree(prompt_ids)

    def end(self):
        self.drafter.end()
