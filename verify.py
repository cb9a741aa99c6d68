"""Verifiers: which guessed tokens of a candidate tree the model accepts, from one forward pass.

The forward pass over the tree gives, at every node i, the model's next-token logits; `sampling.py`
turns them into p_i, the distribution vanilla decoding would sample from after node i. Walking down
from the root, a guess is either accepted (its node's K/V stay) or the walk ends with a *bonus* token
chosen at the last accepted node. So a pass always yields at least one token.

Greedy (Stern et al. 2018, "Blockwise parallel decoding", section 3; ANPD Algorithm 1 lines 17-31;
Lookahead section 4.1): a guess is right when it is the argmax of p at its parent. Accept the longest
root-to-node path of right guesses, then the argmax after its last node. Every token equals vanilla
greedy's.

Exact speculative sampling (Leviathan et al. 2023, "Fast Inference from Transformers via Speculative
Decoding", section 2.3 and appendix A.1; Chen et al. 2023, "Accelerating Large Language Model
Decoding with Speculative Sampling", Algorithm 2): a guess x that was drawn from q is accepted with probability
min(1, p(x) / q(x)); on rejection the token is drawn from norm(max(0, p - q)) instead. The emitted token
is then distributed exactly as p:  P(x) = q(x) min(1, p(x)/q(x)) + P(reject) norm(max(0, p - q))(x) = p(x).
A node with several children tries them in order, each judged against the *residual* left by the
rejections before it (SpecInfer's multi-step speculative sampling, Miao et al. 2024, section 4.2).
When the guesses were chosen deterministically (n-grams, trie, top-k heads, soft tokens) q is a
point mass on x, and the rule becomes: accept child c with probability p'(c); on
rejection set p'(c) = 0, renormalise and try the next child; if all fail, draw the bonus from the
final p'. An accepted child continues the walk with the p the model computed there; a rejected
token cannot come back as the bonus, so "the output starts with a guessed path" and "the walk went
through that path" are the same event, which is why every emitted token has exactly vanilla's
conditional distribution (tests/test_verify.py checks this by enumerating every outcome).

Typical acceptance (Cai et al. 2024, "Medusa", section 2.3.1) is LOSSY: accept a guess x when
p(x) > min(epsilon, delta * exp(-H(p))), take the longest such path, and sample the bonus from p at its
end. It accepts more guesses but its output does NOT follow the model's distribution; it is offered
only as the explicit `--acceptance typical`.

Pure functions of a tree and its logits, no model code.
"""

import math
from dataclasses import dataclass

import torch

from errors import UserError
from sampling import Sampling, target_probs
from tree import Tree, Verdict


@dataclass(frozen=True)
class TypicalAcceptance:
    """Medusa's thresholds; its reference code defaults to epsilon 0.09 and delta = sqrt(epsilon)."""
    epsilon: float = 0.09  # hard threshold: a guess with p(x) > epsilon always passes
    delta: float = 0.3  # scales exp(-entropy): a flat p (high entropy) lowers the bar

    def __post_init__(self):
        if not 0 < self.epsilon <= 1 or not 0 < self.delta < math.inf:
            raise UserError(f"typical acceptance needs 0 < epsilon <= 1 and a finite delta > 0, "
                            f"got epsilon {self.epsilon} and delta {self.delta}")

    def thresholds(self, probs: torch.Tensor) -> torch.Tensor:
        """[N, V] -> [N]: the probability a guess must exceed after each node."""
        entropy = torch.special.entr(probs).sum(-1)  # entr(p) = -p log p, and 0 at p = 0
        return torch.clamp(self.delta * torch.exp(-entropy), max=self.epsilon)


class Chance:
    """The verifiers' two random choices, behind one small interface so that tests can replace it
    and enumerate every outcome exactly."""

    def __init__(self, generator: torch.Generator | None = None):
        self.generator = generator
        self.device = generator.device if generator is not None else torch.device("cpu")

    def accept(self, probability) -> bool:
        """True with the given probability (1 or more: always)."""
        return float(torch.rand((), generator=self.generator, device=self.device)) < float(probability)

    def draw(self, probs: torch.Tensor) -> int:
        """A token drawn from probs [V]."""
        return int(torch.multinomial(probs, 1, generator=self.generator))


def verify(tree: Tree, logits: torch.Tensor, sampling: Sampling, generator=None,
           typical: TypicalAcceptance | None = None) -> Verdict:
    """logits: [N (+ S), V], row i scoring the token after node i (rows after the N nodes, a tree's
    extra inputs, are not judged). Greedy when sampling.greedy; else exact speculative sampling, or the
    lossy typical acceptance when `typical` is given."""
    logits = logits[:len(tree)]
    if sampling.greedy:
        return verify_greedy(tree, logits)
    probs = target_probs(logits, sampling)  # [N, V]: the very p vanilla sampling draws from
    if typical is not None:
        return verify_typical(tree, probs, typical, Chance(generator))
    return verify_speculative(tree, probs, Chance(generator))


def verify_greedy(tree: Tree, logits: torch.Tensor) -> Verdict:
    """Accept the longest root-to-node path on which every guess is the model's own choice (the
    argmax of its parent's logits), then add the bonus token: the choice after the path's last node.
    logits: [N, V], row i scoring the token after node i."""
    choice = logits.argmax(dim=-1).tolist()  # the model's own next token after each node
    path = longest_path(tree, lambda node: tree.tokens[node] == choice[tree.parents[node]])
    return Verdict.of(tree, path, choice[path[-1]])


def verify_typical(tree: Tree, probs: torch.Tensor, typical: TypicalAcceptance, chance: Chance) -> Verdict:
    parents = torch.tensor(tree.parents[1:], dtype=torch.long, device=probs.device)
    tokens = torch.tensor(tree.tokens[1:], dtype=torch.long, device=probs.device)
    # passes[node]: p at its parent gives node's token more than the parent's threshold
    passes = [True] + (probs[parents, tokens] > typical.thresholds(probs)[parents]).tolist()
    path = longest_path(tree, lambda node: passes[node])
    return Verdict.of(tree, path, chance.draw(probs[path[-1]]))


def longest_path(tree: Tree, is_right) -> list[int]:
    """The longest root-to-node path on which every node's token is right after its parent
    (is_right(node)). Several children may carry a right token (parallel branches repeat a
    prefix): the one leading deepest wins. Each node is visited once, as a node has only one parent."""

    def below(node: int) -> list[int]:
        best = []
        for child in tree.children[node]:
            if is_right(child):
                deeper = below(child)
                if len(deeper) + 1 > len(best):
                    best = [child] + deeper
        return best

    return [0] + below(0)


def verify_speculative(tree: Tree, probs: torch.Tensor, chance: Chance) -> Verdict:
    """Exact speculative sampling over a tree (see the module docstring). probs: [N, V]."""
    path = [0]
    while True:
        residual = probs[path[-1]]  # p', what is left of p after this node's rejected children
        for child in tree.children[path[-1]]:
            token = tree.tokens[child]
            q = guess_distribution(tree, child, residual)
            if chance.accept(residual[token] / q[token]):  # probability min(1, p'(x) / q(x))
                path.append(child)
                break
            residual = residual_after_rejection(residual, q)
        else:  # every child rejected (or none): the bonus token comes from the final p'
            return Verdict.of(tree, path, chance.draw(residual))


def guess_distribution(tree: Tree, node: int, like: torch.Tensor) -> torch.Tensor:
    """q [V]: what node's token was drawn from; a point mass when it was chosen deterministically."""
    if tree.draft_probs is not None:
        return tree.draft_probs[node].to(like.dtype)
    q = torch.zeros_like(like)
    q[tree.tokens[node]] = 1.0
    return q


def residual_after_rejection(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where the mass of a rejected guess goes. For a point mass q on x this is
    p with p(x) set to 0, renormalised."""
    residual = (p - q).clamp(min=0)
    total = residual.sum()
    # a rejection means p(x) < q(x), so p > q somewhere and total > 0; only rounding (p == q up to
    # float error) can leave nothing, and then p itself is the limit of the rule
    return residual / total if total > 0 else p
