"""Verifiers: which guessed tokens of a candidate tree the model accepts, from one forward pass.

Greedy verification (Stern et al. 2018, "Blockwise parallel decoding", section 3; ANPD Algorithm 1
lines 17-31; Lookahead section 4.1 "Verification and Accept"): the forward pass over the tree gives,
at every node, the token the model itself would choose next (its argmax). A guessed node is right
when its token equals that choice at its parent. Accept the longest root-to-node path of right
guesses, then append the model's own choice after the path's last node (the *bonus* token). Every
accepted token is exactly what vanilla greedy decoding would have produced, and a pass yields at
least one token (the bonus) even when every guess is wrong.

Pure functions of a tree and its logits, no model code.
"""

from dataclasses import dataclass

import torch

from sampling import Sampling, choose_token
from tree import Tree


@dataclass
class Verdict:
    path: list[int]  # accepted node indices, root first (their K/V stay in the cache)
    tokens: list[int]  # the new tokens: the accepted guesses (path[1:]) and then the bonus token

    @property
    def accepted_guesses(self) -> int:
        return len(self.path) - 1


def verify_greedy(tree: Tree, logits: torch.Tensor) -> Verdict:
    """logits: [N, V], row i scoring the token after node i."""
    choice = logits.argmax(dim=-1).tolist()  # the model's own next token after each node

    def longest_right_path(node: int) -> list[int]:
        # several children may carry the right token (parallel branches repeat a prefix): the one
        # leading deepest wins; each node is visited once, as a node has only one parent
        best = []
        for child in tree.children[node]:
            if tree.tokens[child] == choice[node]:
                below = longest_right_path(child)
                if len(below) + 1 > len(best):
                    best = [child] + below
        return best

    path = [0] + longest_right_path(0)
    return Verdict(path, [tree.tokens[n] for n in path[1:]] + [choice[path[-1]]])


def verify(tree: Tree, logits: torch.Tensor, sampling: Sampling, generator=None) -> Verdict:
    """Greedy verification, or for sampling the root's draw from p (guesses under sampling need
    rejection sampling, which decode.py does not ask for yet)."""
    if sampling.greedy:
        return verify_greedy(tree, logits)
    if tree.draft_size:
        raise NotImplementedError("verifying guesses under sampling needs speculative sampling")
    return Verdict([0], [choose_token(logits[0], sampling, generator)])
