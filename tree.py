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

PPD (Chen et al. 2024, "Hardware-Aware Parallel Prompt Decoding") also appends *prompt tokens* to
tree nodes: a node carrying k of them gets k extra inputs after it (distance 1..k), each one in
`ensembles` copies (EPTs, section 3.2) whose outputs guess the tokens 1..k places after the token
the node's own logits will choose. They ride in the same forward pass as the candidates (Figure 2);
their rows come after the nodes, and their K/V are never kept. `dynamic_sparse_tree` decides, per
tree state, how many each node carries (section 4.2, propositions 4.1-4.4).

Pure Python and torch tensors, no model code, so it can be property-tested exhaustively.
"""

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch


class Tree:
    """tokens[i] is node i's token, parents[i] its parent (-1 for the root, otherwise < i).

    draft_probs (optional, [N, V]): row i is the distribution q that node i's token was *sampled*
    from (row 0, the root's, is unused). None means every guess was chosen deterministically
    (n-grams, a trie, top-k, or a draft model decoding greedily); verify.py then treats q as a point
    mass on the guessed token.
    """

    def __init__(self, tokens: Sequence[int], parents: Sequence[int],
                 draft_probs: torch.Tensor | None = None, prompt_counts: Sequence[int] | None = None,
                 ensembles: int = 1):
        if not tokens or len(tokens) != len(parents) or parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        if draft_probs is not None and len(draft_probs) != len(tokens):
            raise ValueError(f"draft_probs has {len(draft_probs)} rows for {len(tokens)} nodes")
        if prompt_counts is not None and len(prompt_counts) != len(tokens):
            raise ValueError(f"prompt_counts has {len(prompt_counts)} entries for {len(tokens)} nodes")
        self.tokens = list(tokens)
        self.parents = list(parents)
        self.draft_probs = draft_probs
        self.prompt_counts = list(prompt_counts) if prompt_counts is not None else [0] * len(tokens)
        self.ensembles = ensembles
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
    def chain(cls, root: int, draft: Sequence[int], draft_probs: torch.Tensor | None = None) -> "Tree":
        """root -> draft[0] -> draft[1] -> ...; draft_probs [len(draft), V]: what each was sampled from."""
        if draft_probs is not None:
            draft_probs = torch.cat([draft_probs.new_zeros(1, draft_probs.shape[-1]), draft_probs])  # root's row
        return cls([root, *draft], list(range(-1, len(draft))), draft_probs)

    @classmethod
    def from_branches(cls, root: int, branches: Iterable[Sequence[int]], budget: int,
                      merge: bool = True) -> "Tree":
        """Hang each branch (a guessed continuation of the root) under the root, best branch first,
        until `budget` draft nodes are used (the last branch that fits only partly is cut).

        merge=True shares common prefixes, so a branch costs only its tokens not yet in the tree
        (Lookahead's hierarchical draft); merge=False lays every branch out whole (parallel draft).
        """
        tokens, parents = [root], [-1]
        child_with_token = {}  # (parent node, token) -> node, for merging
        for branch in branches:
            parent = 0
            for token in branch:
                if merge and (parent, token) in child_with_token:
                    parent = child_with_token[parent, token]
                    continue
                if len(tokens) > budget:
                    return cls(tokens, parents)
                tokens.append(token)
                parents.append(parent)
                child_with_token[parent, token] = len(tokens) - 1
                parent = len(tokens) - 1
        return cls(tokens, parents)

    @classmethod
    def from_topk(cls, root: int, candidates: Sequence[Sequence[int]],
                  spec: Iterable[Sequence[int]], prompt_counts: Sequence[int] | None = None,
                  ensembles: int = 1) -> "Tree":
        """A sparse tree over per-depth candidates: candidates[d][i] is the (i+1)-th best guess for
        the token at depth d+1. Each path in `spec` (e.g. (0, 1): best guess, then second best)
        becomes one node; every path's prefix must come earlier in the spec. prompt_counts: PPD's
        prompt tokens per node (root first), as `dynamic_sparse_tree` allots them."""
        tokens, parents = [root], [-1]
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
        return cls(tokens, parents, prompt_counts=prompt_counts, ensembles=ensembles)

    # ---- what the forward pass needs ----

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def draft_size(self) -> int:
        """Guessed nodes: everything but the root."""
        return len(self.tokens) - 1

    def prompt_slots(self) -> list[tuple[int, int, int]]:
        """(node, distance, ensemble group) of every prompt-token input, in the order their rows
        follow the N nodes: node by node, distance 1..count, group 0..ensembles-1."""
        return [(node, distance, group) for node, count in enumerate(self.prompt_counts)
                for distance in range(1, count + 1) for group in range(self.ensembles)]

    def prompt_rows(self, node: int) -> list[int]:
        """Input rows (after the N nodes) of the prompt tokens `node` carries."""
        return [row for row, slot in enumerate(self.prompt_slots(), start=len(self.tokens)) if slot[0] == node]

    def positions(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + P] RoPE positions: a node sits as far after the cache as it is deep in the tree; its
        prompt token at distance d sits d places after it, where the tokens it guesses for would be."""
        slots = [self.depths[node] + distance for node, distance, _ in self.prompt_slots()]
        return torch.tensor(self.depths + slots, device=device) + cache_length

    def ancestor_mask(self) -> torch.Tensor:
        """[N + P, N + P] bool: mask[i, j] is True when row j is row i or one of its ancestors. A
        prompt token's ancestors are its node, the node's ancestors, and the same node's prompt tokens
        at smaller distances *in its own ensemble group* (PPD appendix B.5.1, the ensemble mask: the
        n-th EPT sees only the n-th EPTs before it). Nodes never see prompt tokens."""
        n, slots = len(self.tokens), self.prompt_slots()
        mask = torch.eye(n + len(slots), dtype=torch.bool)
        for node in range(1, n):  # parents come first, so each parent's row is already complete
            mask[node] |= mask[self.parents[node]]
        previous_in_group = {}  # (node, group) -> row of the prompt token one distance closer
        for row, (node, _, group) in enumerate(slots, start=n):
            mask[row] |= mask[previous_in_group.get((node, group), node)]
            previous_in_group[node, group] = row
        return mask

    def attention_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N + P, cache_length + N + P] bool: every row sees the whole cache, then its ancestors."""
        rows = len(self.tokens) + sum(self.prompt_counts) * self.ensembles
        seen_cache = torch.ones(rows, cache_length, dtype=torch.bool)
        return torch.cat([seen_cache, self.ancestor_mask()], dim=1).to(device)

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path, as node indices."""
        leaves = [n for n in range(len(self.tokens)) if not self.children[n]]
        return [self.path_to(leaf) for leaf in leaves]

    def path_to(self, node: int) -> list[int]:
        path = [node]
        while self.parents[path[-1]] != -1:
            path.append(self.parents[path[-1]])
        return path[::-1]

    def truncated(self, max_depth: int) -> "Tree":
        """The nodes at most `max_depth` below the root (the decoding loop cuts guesses that would
        run past --max-new-tokens or the context)."""
        if max(self.depths) <= max_depth:
            return self
        keep = [n for n in range(len(self.tokens)) if self.depths[n] <= max_depth]
        new_index = {old: new for new, old in enumerate(keep)}
        return Tree([self.tokens[n] for n in keep],
                    [-1] + [new_index[self.parents[n]] for n in keep[1:]],
                    None if self.draft_probs is None else self.draft_probs[keep],
                    [self.prompt_counts[n] for n in keep], self.ensembles)

    def __repr__(self) -> str:
        return f"Tree(tokens={self.tokens}, parents={self.parents})"


# ---- sparse trees from measured accuracies (Medusa section 2.1.2; PPD section 4.2) ---------------
#
# accuracy[d][r]: how often the rank-r guess for the token at depth d+1 was right (measured on held-out
# text). Taking the ranks' successes as independent, a node whose path is ranks (r_1, .., r_d) is
# accepted with probability prod_i accuracy[i-1][r_i], and the expected number of accepted guesses of
# a tree is the sum of that over its nodes (PPD proposition 4.1).

def path_probability(accuracy: Sequence[Sequence[float]], path: Sequence[int]) -> float:
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


def end_probabilities(accuracy: Sequence[Sequence[float]], spec: Sequence[Sequence[int]]) -> list[float]:
    """For the root and each node of `spec`: the probability that the accepted path ends there (the
    node is accepted, none of its children is; children are different tokens, so disjoint events)."""
    reach = [1.0] + [path_probability(accuracy, path) for path in spec]
    node_of_path = {(): 0} | {tuple(path): i for i, path in enumerate(spec, start=1)}
    ends = list(reach)
    for node, path in enumerate(spec, start=1):
        ends[node_of_path[tuple(path[:-1])]] -= reach[node]
    return [max(e, 0.0) for e in ends]


@dataclass
class PromptTreeState:
    """One state T_k of a PPD tree: the candidate spec (at most k deep, as the last accepted node
    carried k prompt tokens) and how many prompt tokens each node carries (root first)."""
    spec: list[tuple]
    prompt_counts: list[int]
    expected_accepted: float  # f(T_k)


@dataclass
class PromptTree:
    """PPD's dynamic sparse tree: states[k] is used when the last accepted node carried k prompt
    tokens. `tokens_per_pass` = 1 + R(T), the amortised tokens per forward pass (proposition 4.4)."""
    states: dict[int, PromptTreeState]
    ensembles: int
    tokens_per_pass: float

    @property
    def rows(self) -> int:
        """The most inputs a forward pass gets: the root, the candidates and every prompt-token copy
        (a shallow state can hold fewer candidates than asked for: depth 1 has only so many ranks)."""
        return max(1 + len(s.spec) + sum(s.prompt_counts) * self.ensembles for s in self.states.values())


def allot_prompt_tokens(accuracy, spec, prompt_tokens: int, max_per_node: int,
                        f: dict[int, float]) -> list[int]:
    """Give every node `max_per_node` prompt tokens, then take them away one at a time where it
    costs the least expected tokens at the next step, P(path ends at c) * (f(T_i) - f(T_i-1))
    (proposition 4.3, with the end probability in place of p(c): the next state is set by the node
    the accepted path *ends* at), keeping at least one per node, until `prompt_tokens` are left."""
    ends = end_probabilities(accuracy, spec)
    counts = [max_per_node] * (len(spec) + 1)
    removable = [(ends[node] * (f[max_per_node] - f[max_per_node - 1]), node) for node in range(len(counts))
                 if max_per_node > 1]
    heapq.heapify(removable)
    while sum(counts) > prompt_tokens and removable:
        _, node = heapq.heappop(removable)
        counts[node] -= 1
        if counts[node] > 1:
            heapq.heappush(removable, (ends[node] * (f[counts[node]] - f[counts[node] - 1]), node))
    return counts


def steady_state(transition: list[list[float]], steps: int = 200) -> list[float]:
    """The stationary distribution of a Markov chain (rows sum to 1), by power iteration."""
    pi = [1.0 / len(transition)] * len(transition)
    for _ in range(steps):
        pi = [sum(pi[i] * transition[i][j] for i in range(len(pi))) for j in range(len(pi))]
    return pi


def prompt_tree_for(accuracy, candidates: int, prompt_tokens: int, max_prompt: int, ensembles: int,
                    dynamic: bool = True) -> PromptTree:
    """States T_1..T_m with `candidates` candidate nodes each (the best tree at most k deep) and
    `prompt_tokens` prompt tokens allotted by `allot_prompt_tokens` (dynamic), or `max_prompt` on every
    node (static: then `prompt_tokens` is ignored and only state m occurs)."""
    specs = {k: best_sparse_tree(accuracy, candidates, k) for k in range(1, max_prompt + 1)}
    f = {0: 0.0} | {k: expected_accepted(accuracy, spec) for k, spec in specs.items()}
    states = {}
    for k, spec in specs.items():
        counts = (allot_prompt_tokens(accuracy, spec, prompt_tokens, max_prompt, f) if dynamic
                  else [max_prompt] * (len(spec) + 1))
        states[k] = PromptTreeState(spec, counts, f[k])
    if not dynamic:
        states = {max_prompt: states[max_prompt]}
    order = sorted(states)
    transition = []
    for k in order:  # from state k, the next state is the prompt count of the node the path ends at
        ends = end_probabilities(accuracy, states[k].spec)
        row = [sum(e for e, c in zip(ends, states[k].prompt_counts) if c == i) for i in order]
        transition.append([x / sum(row) for x in row])
    pi = steady_state(transition)
    return PromptTree(states, ensembles, 1 + sum(p * states[k].expected_accepted for p, k in zip(pi, order)))


def best_prompt_tree(accuracy, rows: int, max_prompt: int, ensembles: int, dynamic: bool = True) -> PromptTree:
    """The PPD tree of the most tokens per pass whose forward pass has at most `rows` inputs: every
    split of the rows into candidates and prompt tokens is tried (PPD section 4.2, c(n_c, n_p))."""
    best = None
    for candidates in range(rows):
        spare = rows - 1 - candidates  # rows left for prompt-token copies
        per_copy = spare // ensembles
        if per_copy < (candidates + 1) * (1 if dynamic else max_prompt):
            break  # every node needs at least one prompt token (static: max_prompt)
        tree = prompt_tree_for(accuracy, candidates, min(per_copy, (candidates + 1) * max_prompt),
                               max_prompt, ensembles, dynamic)
        if best is None or tree.tokens_per_pass > best.tokens_per_pass:
            best = tree
    if best is None:
        raise ValueError(f"{rows} rows cannot hold a root with {ensembles} prompt-token copies")
    return best
