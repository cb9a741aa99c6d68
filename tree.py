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

After the nodes a tree may carry *extra inputs* that are not tokens (`ExtraInputs`): PPD's trained
soft tokens (Chen et al. 2024, Figure 2; ppd.py lays them out). Each hangs on a node and sees what
that node sees; they ride in the same forward pass, after all the nodes, and their K/V are never
kept. A tree without them is all that every other method needs.

What verifying a tree keeps of it is a `Verdict`: a root-to-node path and a bonus token (verify.py
decides which).

Pure Python and torch tensors, no model code, so it can be property-tested exhaustively.
"""

import heapq
import math
from dataclasses import dataclass
from itertools import repeat
from collections.abc import Iterable, Sequence
from typing import NamedTuple

import torch


class Evidence(NamedTuple):
    """Why a node was guessed, as one source saw it. `key` files the guess's outcome for cost-aware
    drafting (cost_aware.py), e.g. ("anpd", 4, 2): an n-gram of level 4 seen twice; `prior` is the
    source's own estimate of the guess's chance of acceptance."""
    key: tuple
    prior: float


@dataclass(frozen=True)
class ExtraInputs:
    """S inputs that are not tokens, fed after a tree's N nodes (PPD's soft tokens: ppd.py).

    Extra row r hangs on node `node[r]`: it sees that node and its ancestors, and also extra row
    `follows[r]` (on the same node, earlier; -1 for none) with all that row sees, and it sits
    `offset[r]` places after its node. `embeddings` [S, D] are their inputs (None: the layout
    alone, for training, which makes its own inputs).
    """
    node: tuple[int, ...]
    offset: tuple[int, ...]
    follows: tuple[int, ...]
    embeddings: torch.Tensor | None = None

    def __post_init__(self):
        if not len(self.node) == len(self.offset) == len(self.follows):
            raise ValueError("extra inputs need a node, an offset and a row it follows, each")
        for row, (node, earlier) in enumerate(zip(self.node, self.follows)):
            if earlier != -1 and not (0 <= earlier < row and self.node[earlier] == node):
                raise ValueError(f"extra row {row} follows row {earlier}: an earlier row on the same node, or -1")
        if self.embeddings is not None and len(self.embeddings) != len(self.node):
            raise ValueError(f"{len(self.embeddings)} embeddings for {len(self.node)} extra inputs")

    def __len__(self) -> int:
        return len(self.node)

    def of_nodes(self, nodes: Sequence[int]) -> "ExtraInputs":
        """The rows hung on `nodes` (ascending), each node renumbered as its index in `nodes`."""
        new_node = {old: new for new, old in enumerate(nodes)}
        rows = [row for row, node in enumerate(self.node) if node in new_node]
        new_row = {old: new for new, old in enumerate(rows)}
        return ExtraInputs(tuple(new_node[self.node[r]] for r in rows), tuple(self.offset[r] for r in rows),
                           tuple(new_row.get(self.follows[r], -1) for r in rows),
                           None if self.embeddings is None else self.embeddings[rows])


class Tree:
    """tokens[i] is node i's token, parents[i] its parent (-1 for the root, otherwise < i).

    draft_probs (optional, [N, V]): row i is the distribution q that node i's token was *sampled*
    from (row 0, the root's, is unused). None means every guess was chosen deterministically
    (n-grams, a trie, top-k, or a draft model decoding greedily); verify.py then treats q as a point
    mass on the guessed token.

    evidence[i]: why node i was guessed, one `Evidence` per source that guessed it; () for the root.

    extra (optional): inputs fed after the nodes (`ExtraInputs`).
    """

    def __init__(self, tokens: Sequence[int], parents: Sequence[int],
                 draft_probs: torch.Tensor | None = None, evidence: Sequence[tuple[Evidence, ...]] | None = None,
                 extra: ExtraInputs | None = None):
        if not tokens or len(tokens) != len(parents) or parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        if draft_probs is not None and len(draft_probs) != len(tokens):
            raise ValueError(f"draft_probs has {len(draft_probs)} rows for {len(tokens)} nodes")
        if evidence is not None and len(evidence) != len(tokens):
            raise ValueError(f"evidence has {len(evidence)} entries for {len(tokens)} nodes")
        if extra is not None and not all(0 <= node < len(tokens) for node in extra.node):
            raise ValueError("an extra input hangs on a node the tree does not have")
        self.tokens = list(tokens)
        self.parents = list(parents)
        self.draft_probs = draft_probs
        self.evidence = list(evidence) if evidence is not None else [()] * len(tokens)
        self.extra = extra
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
              evidence: Sequence[tuple[Evidence, ...]] | None = None) -> "Tree":
        """root -> draft[0] -> draft[1] -> ...; draft_probs [len(draft), V]: what each was sampled from;
        evidence: each guess's (see the class)."""
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs.new_zeros(1, draft_probs.shape[-1]), draft_probs])  # root's row
        return cls([root, *draft], list(range(-1, len(draft))), draft_probs,
                   evidence=None if evidence is None else [(), *evidence])

    @classmethod
    def from_branches(cls, root: int, branches: Iterable[Sequence[int]], budget: int,
                      merge: bool = True, evidence: Iterable[Sequence[tuple[Evidence, ...]]] | None = None) -> "Tree":
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
    def from_topk(cls, root: int, candidates: Sequence[Sequence[int]], spec: Iterable[Sequence[int]],
                  accuracy: Sequence[Sequence[float]] | None = None, source: str = "top-k") -> "Tree":
        """A sparse tree over per-depth candidates: candidates[d][i] is the (i+1)-th best guess for
        the token at depth d+1. Each path in `spec` (e.g. (0, 1): best guess, then second best)
        becomes one node; every path's prefix must come earlier in the spec. accuracy[d][r]
        (optional): how often the rank-r guess at depth d+1 is right, each node's evidence
        (key (source, depth, rank), prior that accuracy)."""
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
            evidence.append((Evidence((source, depth + 1, rank), accuracy[depth][rank]),) if accuracy else ())
        return cls(tokens, parents, evidence=evidence)

    @classmethod
    def shape_of(cls, spec: Iterable[Sequence[int]], accuracy: Sequence[Sequence[float]], source: str) -> "Tree":
        """`from_topk`'s tree of `spec` with placeholder tokens: its shape and evidence, which depend on
        where its nodes are and not on what they guess (cost-aware drafting judges a guesser's next
        tree by it before the guesser runs)."""
        return cls.from_topk(0, [[0] * len(ranks) for ranks in accuracy], spec, accuracy=accuracy, source=source)

    def with_extra(self, extra: ExtraInputs | None) -> "Tree":
        """The same nodes, carrying `extra` inputs instead."""
        return Tree(self.tokens, self.parents, self.draft_probs, self.evidence, extra)

    # ---- what the forward pass needs: the nodes ----

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def draft_size(self) -> int:
        """Guessed nodes: everything but the root."""
        return len(self.tokens) - 1

    def positions(self, cache_length: int, device=None) -> torch.Tensor:
        """[N] RoPE positions: a node sits as far after the cache as it is deep in the tree."""
        return torch.tensor(self.depths, device=device) + cache_length

    def ancestor_mask(self) -> torch.Tensor:
        """[N, N] bool: mask[i, j] is True when node j is node i or one of its ancestors."""
        mask = torch.eye(len(self.tokens), dtype=torch.bool)
        for node in range(1, len(self.tokens)):  # parents come first, so each parent's row is already complete
            mask[node] |= mask[self.parents[node]]
        return mask

    def attention_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N, cache_length + N] bool: every node sees the whole cache, then its ancestors."""
        seen_cache = torch.ones(len(self.tokens), cache_length, dtype=torch.bool)
        return torch.cat([seen_cache, self.ancestor_mask()], dim=1).to(device)

    # ---- what the forward pass needs: the nodes, then the extra inputs ----

    @property
    def input_count(self) -> int:
        """Inputs of the forward pass: N nodes + S extra inputs."""
        return len(self.tokens) + (len(self.extra) if self.extra else 0)

    def inputs_of(self, node: int) -> int:
        """The inputs `node` brings to a pass: itself and the extra inputs hung on it."""
        return 1 + len(self.extra_rows(node))

    def extra_rows(self, node: int) -> list[int]:
        """The input rows (after the N nodes) of the extra inputs hung on `node`."""
        hung = self.extra.node if self.extra else ()
        return [len(self.tokens) + row for row, on in enumerate(hung) if on == node]

    def input_embeddings(self, embed) -> torch.Tensor:
        """[1, N + S, D]: the nodes' token embeddings (`embed`: the model's), then the extra inputs'."""
        nodes = embed(torch.tensor([self.tokens], device=embed.weight.device))
        if not self.extra:
            return nodes
        return torch.cat([nodes, self.extra.embeddings[None].to(nodes)], dim=1)

    def input_positions(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + S]: the nodes' positions, then each extra input's: its node's + its offset."""
        if not self.extra:
            return self.positions(cache_length, device)
        extra = [self.depths[node] + offset for node, offset in zip(self.extra.node, self.extra.offset)]
        return torch.tensor(self.depths + extra, device=device) + cache_length

    def input_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + S, cache_length + N + S] bool: the attention mask over every input. An extra input
        sees the cache, its node and the node's ancestors, and the extra row it follows with all that
        one sees; no node sees an extra input."""
        if not self.extra:
            return self.attention_mask(cache_length, device)
        n, rows = len(self.tokens), self.input_count
        own = torch.zeros(rows, rows, dtype=torch.bool)
        own[:n, :n] = self.ancestor_mask()
        for row, (node, earlier) in enumerate(zip(self.extra.node, self.extra.follows), start=n):
            own[row] = own[node if earlier == -1 else n + earlier]
            own[row, row] = True
        return torch.cat([torch.ones(rows, cache_length, dtype=torch.bool), own], dim=1).to(device)

    # ---- cutting ----

    def truncated(self, max_depth: int) -> "Tree":
        """The nodes at most `max_depth` below the root (the decoding loop cuts guesses that would
        run past --max-new-tokens or the context)."""
        if max(self.depths) <= max_depth:
            return self
        return self.subtree([n for n in range(len(self.tokens)) if self.depths[n] <= max_depth])

    def subtree(self, keep: Sequence[int]) -> "Tree":
        """The nodes `keep` (ascending, the root and every kept node's parent among them), with their
        draft distributions, evidence and extra inputs."""
        keep = list(keep)
        new_index = {old: new for new, old in enumerate(keep)}
        return Tree([self.tokens[n] for n in keep],
                    [-1] + [new_index[self.parents[n]] for n in keep[1:]],
                    None if self.draft_probs is None else self.draft_probs[keep],
                    [self.evidence[n] for n in keep],
                    self.extra.of_nodes(keep) if self.extra else None)

    def __repr__(self) -> str:
        return f"Tree(tokens={self.tokens}, parents={self.parents})"


@dataclass
class Verdict:
    """What verifying a tree kept (verify.py decides it): the accepted path and the new tokens."""
    path: list[int]  # accepted node indices, root first (their K/V stay in the cache)
    tokens: list[int]  # the new tokens: the accepted guesses (path[1:]) and then the bonus token
    proposed: int = 0  # guessed nodes the pass scored (the tree but its root)
    rejected: bool = False  # the path ends at a node with children: a guess was rejected there
    # (else the walk ran out of guesses)

    @classmethod
    def of(cls, tree: Tree, path: list[int], bonus: int) -> "Verdict":
        """The verdict of accepting `path` of `tree`, then the `bonus` token."""
        return cls(path, [tree.tokens[n] for n in path[1:]] + [bonus], tree.draft_size, bool(tree.children[path[-1]]))

    @property
    def accepted_guesses(self) -> int:
        return len(self.path) - 1


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
