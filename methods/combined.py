"""The combined drafter (`--method auto`): one candidate tree from every source of guesses at hand.

    python decode.py --method auto --prompt "Summarize in two sentences: ..."

Sources, each a drafter of its own (drafters.py, ppd.py):
- ANPD's multi-level n-grams of the prompt and the output so far (Ou et al. 2024, section 3);
- Lookahead's trie of prompts and earlier outputs, which lives as long as the process (Zhao et al.
  2023, section 4.3);
- EAGLE's draft tree (eagle.py: Li et al. 2024), when its head is trained for the model, drafted only on
  the passes where its trees have lately paid for their draft steps;
- PPD's trained soft tokens (Chen et al. 2024, section 3), when they exist for the model and pay on
  this machine: they ride on the root of every pass, so a pass that accepts no guess leaves the next
  one their guesses. PPD reports its method orthogonal to speculative decoding and combinable with
  it (section 1); none of the seed systems combines retrieval with learned guesses.

Each source proposes its own tree; their root-to-leaf branches are merged into one tree by shared
prefix (tree.Tree.from_branches), so a guess that two sources agree on is one node carrying both
sources' evidence. Cost-aware drafting (cost_aware.py) then keeps, each step, the part of it that pays,
ranking every node by the same calibrated acceptance estimates under the same L(n); the drafter
itself carries the soft tokens when what their guesses make the next pass worth beyond its time pays
for their inputs in this one (ppd.SoftTokenCosts.extra_inputs_pay). Verification is the same as for
every method: the tree rule of verify.py treats any mix of deterministic guesses, so greedy output is
vanilla's and sampling stays exact.
"""

from collections.abc import Sequence

from drafters import Drafter, NGramDrafter, TrieDrafter
from methods.ppd import PPDDrafter
from tree import Evidence, Tree


def branches(tree: Tree) -> tuple[list[list[int]], list[list[tuple[Evidence, ...]]]]:
    """Every root-to-leaf path of `tree` as tokens, with each token's evidence."""
    paths, evidence = [], []
    for leaf in range(1, len(tree)):
        if tree.children[leaf]:
            continue
        nodes, node = [], leaf
        while node:
            nodes.append(node)
            node = tree.parents[node]
        paths.append([tree.tokens[n] for n in reversed(nodes)])
        evidence.append([tree.evidence[n] for n in reversed(nodes)])
    return paths, evidence


class SoftTokensOnRoot(Drafter):
    """PPD's soft tokens as one source among others: all of them on the root of every tree, and the
    guesses they made from the last pass's root, laid out as the PPD tree of that many distances."""

    def __init__(self, ppd: PPDDrafter):
        self.ppd = ppd
        self.max_extra_inputs = max(len(state.spec) for state in ppd.dynamic_tree.states.values())

    def begin(self, request):
        self.ppd.begin(request)

    def prefill_tree(self, prompt_ids):
        return self.ppd.prefill_tree(prompt_ids)

    def after_pass(self, done):
        self.ppd.after_pass(done)  # (guesses only when the last accepted node was the root: it carried them)

    def propose(self):
        candidates = self.ppd.candidates
        if not candidates:
            return Tree.chain(self.ppd.history[-1], [])
        spec = self.ppd.dynamic_tree.states[len(candidates)].spec
        return Tree.from_topk(self.ppd.history[-1], candidates, spec, accuracy=self.ppd.accuracy, source="ppd")

    def on_root(self, tree: Tree) -> Tree:
        """`tree` with every soft token (each in all its ensemble copies) on its root."""
        return self.ppd.carrying(tree, [self.ppd.soft_tokens.count] + [0] * tree.draft_size)


class CombinedDrafter(Drafter):
    """Sources' trees merged into one (their own budgets summed); `soft` adds PPD's soft tokens, on
    every pass or, with `costs` (cost-aware drafting, ppd.SoftTokenCosts), when they pay."""

    def __init__(self, sources: Sequence[Drafter], soft: SoftTokensOnRoot | None = None, costs=None):
        self.sources = list(sources) + ([soft] if soft else [])
        self.soft, self.costs = soft, costs
        self.budget = sum(source.max_extra_inputs for source in self.sources)  # guessed nodes
        self.max_extra_inputs = self.budget
        if soft:  # the root's soft tokens are inputs too, as are the prefill's after the prompt
            soft_inputs = soft.ppd.soft_tokens.count * soft.ppd.soft_tokens.ensembles
            self.max_extra_inputs = max(self.budget + soft_inputs, soft.ppd.max_extra_inputs)

    def begin(self, request):
        super().begin(request)
        for source in self.sources:
            source.begin(request)

    def prefill_tree(self, prompt_ids):
        return self.soft.prefill_tree(prompt_ids) if self.soft else super().prefill_tree(prompt_ids)

    def propose(self):
        paths, evidence = [], []
        for source in self.sources:
            source_paths, source_evidence = branches(source.propose())
            paths += source_paths
            evidence += source_evidence
        tree = Tree.from_branches(self.history[-1], paths, self.budget, merge=True, evidence=evidence)
        if not self.soft:
            return tree
        carried = self.soft.on_root(tree)
        if self.costs is None or self.costs.extra_inputs_pay(tree, carried, self.costs.surplus(self.soft.ppd.shape)):
            return carried
        return tree

    def after_pass(self, done):
        super().after_pass(done)
        for source in self.sources:
            source.after_pass(done)


def combined_drafter(ngram: NGramDrafter, trie: TrieDrafter, ppd: PPDDrafter | None, latency,
                     costs=None, eagle: Drafter | None = None) -> CombinedDrafter:
    """ANPD's n-grams and Lookahead's trie, EAGLE's tree if given (it drafts only while its trees pay:
    eagle.EagleDrafter.worth_drafting), and PPD's soft tokens where they pay on this machine: a
    pass carrying them costs L(1 + S) for S soft-token inputs instead of L(1), and (when it accepts
    no other guess) gives the next pass 1 + f tokens, f the expected accepted guesses of PPD's tree
    (its held-out accuracies): they are carried when L(1 + S) / L(1) < 1 + f (PPD section 4.2's
    criterion, applied to the root's soft tokens)."""
    soft = None
    if ppd is not None:
        inputs = 1 + ppd.soft_tokens.count * ppd.soft_tokens.ensembles
        gain = ppd.predicted_tokens_per_pass
        if latency(inputs) / latency(1) < gain:
            soft = SoftTokensOnRoot(ppd)
    return CombinedDrafter([ngram, trie] + ([eagle] if eagle else []), soft, costs)
