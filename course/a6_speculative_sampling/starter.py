"""Assignment a6_speculative_sampling: your code (see handout.md). Each stub below has the reference's
signature and docstring; replace its NotImplementedError with your implementation, then run

    python -m pytest course/a6_speculative_sampling
"""

from tree import Tree, Verdict
from verify import Chance
import torch


def verify_speculative(tree: Tree, probs: torch.Tensor, chance: Chance) -> Verdict:
    """Exact speculative sampling over a tree (see the module docstring). probs: [N, V]."""
    raise NotImplementedError("a6_speculative_sampling: implement verify_speculative")


def residual_after_rejection(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p - q)): where the mass of a rejected guess goes. For a point mass q on x this is
    p with p(x) set to 0, renormalised."""
    raise NotImplementedError("a6_speculative_sampling: implement residual_after_rejection")
