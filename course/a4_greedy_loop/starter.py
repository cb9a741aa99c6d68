"""Assignment a4_greedy_loop: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a4_greedy_loop
"""

from decode import Generation
from drafters import Drafter
from sampling import Sampling
from tree import Tree, Verdict
from verify import TypicalAcceptance
import torch


def verify_greedy(tree: Tree, logits: torch.Tensor) -> Verdict:
    """Accept the longest root-to-node path on which every guess is the model's own choice (the
    argmax of its parent's logits), then add the bonus token: the choice after the path's last node.
    logits: [N, V], row i scoring the token after node i."""
    raise NotImplementedError("a4_greedy_loop: implement verify_greedy")


def longest_path(tree: Tree, is_right) -> list[int]:
    """The longest root-to-node path on which every node's token is right after its parent
    (is_right(node)). Several children may carry a right token (parallel branches repeat a
    prefix): the one leading deepest wins. Each node is visited once, as a node has only one parent."""
    raise NotImplementedError("a4_greedy_loop: implement longest_path")


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
             drafter: Drafter | None = None, sampling: Sampling = Sampling(), generator=None,
             typical: TypicalAcceptance | None = None, on_tokens=None, on_pass=None) -> Generation:
    """Decode one prompt with `drafter`'s guesses (none: vanilla), greedily or by sampling (exactly,
    or with the lossy `typical` acceptance). `on_tokens(ids, guessed)` is called after every pass
    with its new tokens, of which the first `guessed` were accepted guesses; `on_pass(Pass)` after
    every pass but the prefill."""
    raise NotImplementedError("a4_greedy_loop: implement generate")
