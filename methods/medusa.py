"""Medusa (Cai et al. 2024, "Medusa: Simple LLM Inference Acceleration Framework with Multiple
Decoding Heads"): extra heads on the model's last hidden state guess the tokens further ahead.

Read in this order:
1. `MedusaHeads` (section 2.1.1): head k maps the final hidden state h_t to a distribution over the
   token at t+k+1, through a residual block and the LM head.
2. `MedusaDrafter` (section 2.1.2): after each pass, the heads read the last accepted node's hidden
   state; their top-k candidates, laid out as a *sparse tree* (tree.best_sparse_tree: the tree of the
   largest expected accepted length, given the heads' measured accuracies), are the next guesses. The
   tree goes through the model with tree attention (tree.py) and is verified like any other
   (verify.py: greedy, exact speculative sampling, or Medusa's own lossy typical acceptance, 2.3.1).
3. `medusa_loss` (Medusa-1, section 2.2.1): with the base model frozen, head k learns the token k+1
   places ahead, L = sum_k lambda_k CE(p_t^(k), y_(t+k+1)), lambda_k = 0.8^k, on the model's own
   answers (self-distillation, section 2.3.2; self_distill.py). `medusa_accuracy` measures on held-out
   answers how often each head's rank-r guess is right: the table the sparse tree is built from.
   `python train_prompt.py medusa` runs the training (train_prompt.py: the data, the loop).

With cost-aware drafting (cost_aware.py), the heads cost their time whatever is sent, so the drafter
runs them only when the best part of their tree would pay for it (cost_aware.Costs.worth_running),
and projects them onto a shortlist of the vocabulary (SHORTLIST), not all of it.
"""

import copy
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from methods import artifacts
from drafters import TOP_RANKS, TopKDrafter
from tree import Tree, best_sparse_tree, expected_accepted

LOSS_DECAY = 0.8  # lambda_k = 0.8^k (section 2.2.1)

# While decoding, the heads guess among the vocabulary's first SHORTLIST tokens only: their LM-head
# product over the whole vocabulary would take a sixth of a pass on this CPU; this reads a twelfth of
# its rows. A BPE vocabulary lists its tokens in the order their merges were learned, most frequent
# first: the first 4096 of the default model's 49152 are 77% of the tokens it writes (8192: 86%), and
# the heads lose little by it: over 4096 rather than 8192, tokens per pass changed by -1.9% to +0.5%
# per category (-0.6% over six) and the heads took 1.4 ms a pass instead of 2.0, 1.6% of a pass
# (docs/constants.md). A token past them is never guessed by a head (verification still finds it:
# nothing is lost but that guess).
SHORTLIST = 4096


class ResBlock(nn.Module):
    """x + SiLU(W x + b), W and b zero at the start so the block begins as the identity (Medusa's
    head body, section 2.1.1)."""

    def __init__(self, size: int):
        super().__init__()
        self.linear = nn.Linear(size, size)
        nn.init.zeros_(self.linear.weight)
        nn.init.zeros_(self.linear.bias)

    def forward(self, x):
        return x + nn.functional.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """K Medusa heads. Head k (1-based) maps the final hidden state at position t to logits for the
    token at t+k+1: p_t^(k) = softmax(LM_head(ResBlock_k(h_t))) (section 2.1.1).

    Medusa gives each head its own copy of the LM head, initialised from it and trained. Here the
    copy is the model's LM head itself, shared and frozen: a copy would be 28M parameters per head for
    the default model (113 MB in float32), too big to ship and too slow to train on 2 CPU cores. So
    head k starts as the model's own next-token guess, and its ResBlock learns to look further.
    """

    def __init__(self, hidden_size: int, count: int):
        super().__init__()
        self.blocks = nn.ModuleList(ResBlock(hidden_size) for _ in range(count))

    def forward(self, hidden: torch.Tensor, lm_head) -> torch.Tensor:
        """hidden [..., D] -> logits [K, ..., V]: one LM-head product for all K heads (while decoding,
        K rows cost about what one does)."""
        return lm_head(torch.stack([block(hidden) for block in self.blocks]))


class MedusaDrafter(TopKDrafter):
    """Medusa: the heads' top-k along a fixed sparse tree `spec` (tree.best_sparse_tree of the heads'
    measured accuracies, `accuracy[d][r]`: how often head d+1's rank-r guess was right)."""

    def __init__(self, model, heads: MedusaHeads, accuracy: list[list[float]], inputs: int, costs=None):
        self.model, self.heads = model, heads.requires_grad_(False)
        self.accuracy = accuracy
        self.spec = best_sparse_tree(accuracy, inputs - 1)  # the root and inputs - 1 guesses per pass
        self.max_extra_inputs = len(self.spec)
        # 1 + the expected number of accepted guesses, taking the heads' hits as independent
        self.predicted_tokens_per_pass = 1 + expected_accepted(accuracy, self.spec)
        self.costs = costs  # cost-aware drafting (cost_aware.Costs), or None: the heads always run
        self.shortlist_head = shortlist_head(model.lm_head, SHORTLIST)
        self.shape = Tree.shape_of(self.spec, accuracy, "medusa")  # the tree's shape and evidence, whatever the heads guess

    def begin(self, request):
        super().begin(request)
        self.heads_seconds: list[float] = []  # each time the heads ran

    def after_pass(self, done):
        super().after_pass(done)
        if self.costs is not None and not self.costs.worth_running(self.shape, self.heads_seconds):
            self.candidates = []  # their guesses would all be cut: the next pass is the root alone
            return
        started = time.perf_counter()
        self.keep_top(self.heads(done.last_hidden(), self.shortlist_head))  # [K, SHORTLIST] -> top-k per head
        self.heads_seconds.append(time.perf_counter() - started)

    def propose(self):
        if not self.candidates:
            return super().propose()
        return Tree.from_topk(self.history[-1], self.candidates, self.spec, accuracy=self.accuracy, source="medusa")


def shortlist_head(lm_head: nn.Linear, size: int) -> nn.Linear:
    """The LM head over the vocabulary's first `size` tokens: a view of its weight, not a copy, in a
    module of the LM head's own class and settings (a backend's kernels included: its rows are a prefix
    of the LM head's, of the same width)."""
    head = copy.copy(lm_head)  # the LM head's class and attributes, with a weight of its own:
    head._parameters = {"weight": nn.Parameter(lm_head.weight[:size], requires_grad=False), "bias": None}
    head.out_features = min(size, lm_head.out_features)
    return head


def load_drafter(model, path: Path, inputs: int, costs=None) -> MedusaDrafter:
    """The heads saved at `path` by train_prompt.py (checked to be made for `model`), with the sparse
    tree of `inputs` inputs per pass that their held-out accuracies make best."""
    tensors, meta = artifacts.load(path, "medusa", model)
    with artifacts.unpacking(path, "medusa"):
        heads = MedusaHeads(model.config.hidden_size, meta["heads"]).to(model.device, model.dtype)
        heads.load_state_dict(tensors)
        return MedusaDrafter(model, heads.eval(), meta["accuracy"], inputs, costs)


# ---- training (Medusa-1: the base model frozen) ---------------------------------------------------

def medusa_loss(model, heads: MedusaHeads, hidden, targets) -> torch.Tensor:
    """Medusa-1's loss on a batch of hidden states [B, D] and their targets [B, 8]."""
    logits = heads(hidden, model.lm_head)  # [K, B, V]
    losses = [F.cross_entropy(logits[k], targets[:, k + 1], ignore_index=-1) for k in range(len(logits))]
    return sum(LOSS_DECAY ** (k + 1) * loss for k, loss in enumerate(losses))


@torch.no_grad()
def medusa_accuracy(model, heads: MedusaHeads, hidden, targets) -> list[list[float]]:
    """accuracy[d][r]: how often head d+1's rank-r guess is the token d+2 places ahead."""
    hits, counts = torch.zeros(len(heads.blocks), TOP_RANKS), torch.zeros(len(heads.blocks), 1)
    for start in range(0, len(hidden), 512):
        guesses = heads(hidden[start:start + 512], model.lm_head).topk(TOP_RANKS).indices  # [K, B, R]
        for k in range(len(heads.blocks)):
            target = targets[start:start + 512, k + 1]
            hits[k] += (guesses[k] == target[:, None]).sum(0)
            counts[k] += (target >= 0).sum()
    return (hits / counts.clamp(min=1)).tolist()
