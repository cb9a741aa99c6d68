"""Candidate trees: the guesses one forward pass verifies, their attention mask and positions.

A tree's node 0 is the *root*: the last token the model has chosen, whose K/V is not cached yet.
Every other node is a guessed continuation of its parent. All nodes go through the model in ONE
forward pass, laid out in a flat list (parents before children), and each node must see exactly
what it would see in ordinary decoding: the cache plus its own ancestors. So

    position(node) = cache_length + depth(node)
    mask[i, j]     = node j is node i or one of its ancestors        (the "tree attention" mask)

This is the "tree attention" of SpecInfer / Medusa (Cai et al. 2024, section 2.1.2) and of Lookahead's
*hierarchical multi-branch draft* (Zhao et al. 2023, "Lookahead", section 4.2 and Figure 3).
The tree can be built from:
- a chain (one draft: ANPD, a draft model);
- several branches, merged where they share a prefix (Lookahead *hierarchical*) or laid side by
  side, each starting at the root (Lookahead *parallel*), under a budget of draft nodes (the
  "decoding length");
- per-depth top-k candidates and a sparse-tree spec, a list of index paths such as
  (0,), (1,), (0, 0) meaning "top-1 at depth 1", "top-2 at depth 1", "top-1 after top-1"
  (Medusa section 2.1.2; PPD section 4.2 uses the same kind of spec), chosen by `best_sparse_tree`
  from measured per-depth, per-rank accuracies.

A node may also carry *soft tokens*: extra inputs that are trained embeddings, not vocabulary
tokens, and guess the tokens after the node's own next token (PPD's "prompt tokens", Chen et al.
2024, Figure 2; called soft tokens here so that "prompt tokens" always means the prompt's own).
A node carrying k of them gets k extra input rows (distances 1..k), each in `ensembles` copies
(PPD's EPTs, section 3.2). They ride in the same forward pass as the nodes, after all of them, and
their K/V are never kept. ppd.py decides how many each node carries.

Pure Python and torch tensors, no model code, so it can be property-tested exhaustively.
"""

import heapq
import math
from itertools import repeat
from collections.abc import Iterable, Sequence

import torch


class Tree:
    """tokens[i] is node i's token, parents[i] its parent (-1 for the root, otherwise < i).

    draft_probs (optional, [N, V]): row i is the distribution q that node i's token was *sampled*
    from (row 0, the root's, is unused). None means every guess was chosen deterministically
    (n-grams, a trie, top-k, or a draft model decoding greedily); verify.py then treats q as a point
    mass on the guessed token.

    soft_counts[i]: how many soft tokens node i carries (none by default), each in `ensembles`
    copies; soft_inputs [S, D]: their embeddings, one row per `soft_slots()` entry, in that order.

    evidence[i]: why node i was guessed, as (key, prior) pairs, one per source that guessed it: the
    key files the guess's outcome for cost-aware drafting (cost_aware.py; e.g. ("anpd", level 4,
    seen twice)), the prior is the source's own estimate of its chance. () for the root.
    """

    def __init__(self, tokens: Sequence[int], parents: Sequence[int],
                 draft_probs: torch.Tensor | None = None, soft_counts: Sequence[int] | None = None,
                 ensembles: int = 1, soft_inputs: torch.Tensor | None = None,
                 evidence: Sequence[tuple] | None = None):
        if not tokens or len(tokens) != len(parents) or parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        if draft_probs is not None and len(draft_probs) != len(tokens):
            raise ValueError(f"draft_probs has {len(draft_probs)} rows for {len(tokens)} nodes")
        if soft_counts is not None and len(soft_counts) != len(tokens):
            raise ValueError(f"soft_counts has {len(soft_counts)} entries for {len(tokens)} nodes")
        if evidence is not None and len(evidence) != len(tokens):
            raise ValueError(f"evidence has {len(evidence)} entries for {len(tokens)} nodes")
        self.tokens = list(tokens)
        self.parents = list(parents)
        self.draft_probs = draft_probs
        self.soft_counts = list(soft_counts) if soft_counts is not None else [0] * len(tokens)
        self.ensembles = ensembles
        if soft_inputs is not None and len(soft_inputs) != len(self.soft_slots()):
            raise ValueError(f"soft_inputs has {len(soft_inputs)} rows for {len(self.soft_slots())} soft tokens")
        self.soft_inputs = soft_inputs
        self.evidence = list(evidence) if evidence is not None else [()] * len(tokens)
        self.depths = [0]
        self.children = [[] for _ in tokens]
        for node in range(1, len(tokens)):
            parent = parents[node]
            if not 0 <= parent < node:
                raise ValueError(f"node {node} has parent {parent}: parents must come first")
            self.depths.append(self.depths[parent] + 1)
            self.children[parent].append(node)

    # ---- builders ----

    @classmethod
    def chain(cls, root: int, draft: Sequence[int], draft_probs: torch.Tensor | None = None,
              evidence: Sequence[tuple] | None = None) -> "Tree":
        """root -> draft[0] -> draft[1] -> ...; draft_probs [len(draft), V]: what each was sampled from;
        evidence: each guess's (see the class)."""
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs.new_zeros(1, draft_probs.shape[-1]), draft_probs])  # root's row
        return cls([root, *draft], list(range(-1, len(draft))), draft_probs,
                   evidence=None if evidence is None else [(), *evidence])

    @classmethod
    def from_branches(cls, root: int, branches: Iterable[Sequence[int]], budget: int,
                      merge: bool = True, evidence: Iterable[Sequence[tuple]] | None = None) -> "Tree":
        """Hang each branch (a guessed continuation of the root) under the root, best branch first,
        until `budget` draft nodes are used (the last branch that fits only partly is cut).

        merge=True shares common prefixes, so a branch costs only its tokens not yet in the tree
        (Lookahead's hierarchical draft); merge=False lays every branch out whole (parallel draft).
        evidence (optional): per branch, per token, its evidence (see the class); a shared node
        gathers the evidence of every branch through it.
        """
        tokens, parents, node_evidence = [root], [-1], [()]
        child_with_token = {}  # (parent node, token) -> node, for merging
        for branch, branch_evidence in zip(branches, evidence if evidence is not None else repeat(())):
            parent = 0
            for depth, token in enumerate(branch):
                found = branch_evidence[depth] if branch_evidence else ()
                if merge and (parent, token) in child_with_token:
                    parent = child_with_token[parent, token]
                    node_evidence[parent] += tuple(e for e in found if e not in node_evidence[parent])
                    continue
                if len(tokens) > budget:
                    return cls(tokens, parents, evidence=node_evidence)
                tokens.append(token)
                parents.append(parent)
                node_evidence.append(tuple(found))
                child_with_token[parent, token] = len(tokens) - 1
                parent = len(tokens) - 1
        return cls(tokens, parents, evidence=node_evidence)

    @classmethod
    def from_topk(cls, root: int, candidates: Sequence[Sequence[int]],
                  spec: Iterable[Sequence[int]], soft_counts: Sequence[int] | None = None,
                  ensembles: int = 1, accuracy: Sequence[Sequence[float]] | None = None,
                  source: str = "top-k") -> "Tree":
        """A sparse tree over per-depth candidates: candidates[d][i] is the (i+1)-th best guess for
        the token at depth d+1. Each path in `spec` (e.g. (0, 1): best guess, then second best)
        becomes one node; every path's prefix must come earlier in the spec. soft_counts: soft
        tokens per node (root first), as ppd.py allots them. accuracy[d][r] (optional): how often
        the rank-r guess at depth d+1 is right, each node's evidence ((source, depth, rank), that)."""
        tokens, parents, evidence = [root], [-1], [()]
        node_of_path = {(): 0}
        for path in map(tuple, spec):
            if not path or path[:-1] not in node_of_path:
                raise ValueError(f"sparse-tree path {path} comes before its prefix")
            depth, rank = len(path) - 1, path[-1]
            if depth >= len(candidates) or rank >= len(candidates[depth]):
                raise ValueError(f"sparse-tree path {path} asks for a candidate that does not exist")
            tokens.append(candidates[depth][rank])
            parents.append(node_of_path[path[:-1]])
            node_of_path[path] = len(tokens) - 1
            evidence.append((((source, depth + 1, rank), accuracy[depth][rank]),) if accuracy else ())
        return cls(tokens, parents, soft_counts=soft_counts, ensembles=ensembles, evidence=evidence)

    # ---- what the forward pass needs ----

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def draft_size(self) -> int:
        """Guessed nodes: everything but the root."""
        return len(self.tokens) - 1

    def soft_slots(self) -> list[tuple[int, int, int]]:
        """(node, distance, ensemble group) of every soft-token input, in the order their rows
        follow the N nodes: node by node, distance 1..count, group 0..ensembles-1."""
        return [(node, distance, group) for node, count in enumerate(self.soft_counts)
                for distance in range(1, count + 1) for group in range(self.ensembles)]

    def soft_rows(self, node: int) -> list[int]:
        """Input rows (after the N nodes) of the soft tokens `node` carries."""
        return [row for row, slot in enumerate(self.soft_slots(), start=len(self.tokens)) if slot[0] == node]

    def positions(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + S] RoPE positions: a node sits as far after the cache as it is deep in the tree; its
        soft token at distance d sits d places after it, where the token it guesses would be."""
        slots = [self.depths[node] + distance for node, distance, _ in self.soft_slots()]
        return torch.tensor(self.depths + slots, device=device) + cache_length

    def ancestor_mask(self) -> torch.Tensor:
        """[N + S, N + S] bool: mask[i, j] is True when row j is row i or one of its ancestors. A
        soft token's ancestors are its node, the node's ancestors, and the same node's soft tokens
        at smaller distances *in its own ensemble group* (PPD appendix B.5.1, the ensemble mask: the
        n-th EPT sees only the n-th EPTs before it). Nodes never see soft tokens."""
        n, slots = len(self.tokens), self.soft_slots()
        mask = torch.eye(n + len(slots), dtype=torch.bool)
        for node in range(1, n):  # parents come first, so each parent's row is already complete
            mask[node] |= mask[self.parents[node]]
        previous_in_group = {}  # (node, group) -> row of the soft token one distance closer
        for row, (node, _, group) in enumerate(slots, start=n):
            mask[row] |= mask[previous_in_group.get((node, group), node)]
            previous_in_group[node, group] = row
        return mask

    def attention_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + S, cache_length + N + S] bool: every row sees the whole cache, then its ancestors."""
        rows = len(self.tokens) + sum(self.soft_counts) * self.ensembles
        seen_cache = torch.ones(rows, cache_length, dtype=torch.bool)
        return torch.cat([seen_cache, self.ancestor_mask()], dim=1).to(device)

    def truncated(self, max_depth: int) -> "Tree":
        """The nodes at most `max_depth` below the root (the decoding loop cuts guesses that would
        run past --max-new-tokens or the context)."""
        if max(self.depths) <= max_depth:
            return self
        return self.subtree([n for n in range(len(self.tokens)) if self.depths[n] <= max_depth])

    def subtree(self, keep: Sequence[int]) -> "Tree":
        """The nodes `keep` (ascending, the root and every kept node's parent among them), with their
        soft tokens, draft distributions and evidence."""
        new_index = {old: new for new, old in enumerate(keep)}
        kept = set(keep)
        kept_soft_rows = [row for row, (node, _, _) in enumerate(self.soft_slots()) if node in kept]
        return Tree([self.tokens[n] for n in keep],
                    [-1] + [new_index[self.parents[n]] for n in keep[1:]],
                    None if self.draft_probs is None else self.draft_probs[list(keep)],
                    [self.soft_counts[n] for n in keep], self.ensembles,
                    None if self.soft_inputs is None else self.soft_inputs[kept_soft_rows],
                    [self.evidence[n] for n in keep])

    def __repr__(self) -> str:
        return f"Tree(tokens={self.tokens}, parents={self.parents})"


# ---- sparse trees from measured accuracies (Medusa section 2.1.2; PPD section 4.2) ---------------
#
# accuracy[d][r]: how often the rank-r guess for the token at depth d+1 was right (measured on held-out
# text). Taking the ranks' successes as independent, a node whose path is ranks (r_1, .., r_d) is
# accepted with probability prod_i accuracy[i-1][r_i], and the expected number of accepted guesses of
# a tree is the sum of that over its nodes (PPD proposition 4.1).

def path_probability(accuracy: Sequence[Sequence[float]], path: Sequence[int]) -> float:
    """How often the node of rank path `path` is accepted: the product of its ranks' accuracies."""
    return math.prod(accuracy[depth][rank] for depth, rank in enumerate(path))


def expected_accepted(accuracy: Sequence[Sequence[float]], spec: Iterable[Sequence[int]]) -> float:
    """f(T): the expected number of accepted guesses of the sparse tree `spec`."""
    return sum(path_probability(accuracy, path) for path in spec)


def best_sparse_tree(accuracy: Sequence[Sequence[float]], size: int, max_depth: int | None = None) -> list[tuple]:
    """The `size`-node sparse tree (spec of rank paths, parents first) of the largest expected number
    of accepted guesses, at most `max_depth` deep: grow greedily by the most probable path whose
    parent is already in. A child is never more probable than its parent, so the `size` most
    probable paths are prefix-closed and the greedy choice is the optimum (Medusa's construction)."""
    max_depth = len(accuracy) if max_depth is None else min(max_depth, len(accuracy))
    frontier = [(-accuracy[0][rank], (rank,)) for rank in range(len(accuracy[0]))] if max_depth else []
    heapq.heapify(frontier)
    spec = []
    while frontier and len(spec) < size:
        negative_probability, path = heapq.heappop(frontier)
        spec.append(path)
        if len(path) < max_depth:
            for rank, accurate in enumerate(accuracy[len(path)]):
                heapq.heappush(frontier, (negative_probability * accurate, path + (rank,)))
    return spec
