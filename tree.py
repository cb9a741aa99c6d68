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
  (Medusa section 2.1.2; PPD section 4.2 uses the same kind of spec).

Pure Python and torch tensors, no model code, so it can be property-tested exhaustively.
"""

from collections.abc import Iterable, Sequence

import torch


class Tree:
    """tokens[i] is node i's token, parents[i] its parent (-1 for the root, otherwise < i).

    draft_probs (optional, [N, V]): row i is the distribution q that node i's token was *sampled*
    from (row 0, the root's, is unused). None means every guess was chosen deterministically
    (n-grams, a trie, top-k, or a draft model decoding greedily); verify.py then treats q as a point
    mass on the guessed token.
    """

    def __init__(self, tokens: Sequence[int], parents: Sequence[int],
                 draft_probs: torch.Tensor | None = None):
        if not tokens or len(tokens) != len(parents) or parents[0] != -1:
            raise ValueError("a tree needs a root (parent -1) and one parent per token")
        if draft_probs is not None and len(draft_probs) != len(tokens):
            raise ValueError(f"draft_probs has {len(draft_probs)} rows for {len(tokens)} nodes")
        self.tokens = list(tokens)
        self.parents = list(parents)
        self.draft_probs = draft_probs
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
                  spec: Iterable[Sequence[int]]) -> "Tree":
        """A sparse tree over per-depth candidates: candidates[d][i] is the (i+1)-th best guess for
        the token at depth d+1. Each path in `spec` (e.g. (0, 1): best guess, then second best)
        becomes one node; every path's prefix must come earlier in the spec."""
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
        return cls(tokens, parents)

    # ---- what the forward pass needs ----

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
        n = len(self.tokens)
        mask = torch.eye(n, dtype=torch.bool)
        for node in range(1, n):  # parents come first, so each parent's row is already complete
            mask[node] |= mask[self.parents[node]]
        return mask

    def attention_mask(self, cache_length: int, device=None) -> torch.Tensor:
        """[N, cache_length + N] bool: every node sees the whole cache, then its ancestors."""
        seen_cache = torch.ones(len(self.tokens), cache_length, dtype=torch.bool)
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
                    None if self.draft_probs is None else self.draft_probs[keep])

    def __repr__(self) -> str:
        return f"Tree(tokens={self.tokens}, parents={self.parents})"
