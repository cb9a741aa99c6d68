"""Token Recycling (Luo et al. 2024, "Turning Trash into Treasure: Accelerating Inference of Large
Language Models with Token Recycling", section 3): guesses read from the model's own top-k of earlier
passes, with no training and no draft model.

    python decode.py --method recycling --prompt "Give me three tips for learning a language."

Every pass computes logits at every input, and the loop uses only the argmax along the accepted path;
the rest, the other likely tokens and everything computed at rejected guesses, is thrown away. Those
tokens often come back. Token Recycling keeps, for every token of the vocabulary, the k tokens the
model found most likely to follow it the last time it was an input:

    M[token] = top-k(logits at that input)     # the adjacency matrix, [V, k] token ids (k = 8)

Drafting ("draft tree retrieval"): a tree is read from M breadth first, starting at the root (the
last token): the root's children are M[root]'s first few, each child's children M[child]'s first few,
and so on, along a fixed shape of ranks (the paper's static tree, about 80 nodes for a GPU). Here the
shape is the best sparse tree for the acceptance rates of each rank, measured on held-out
prompts (tree.best_sparse_tree; the rates are the guesses' priors too), `--tree-rows` inputs at most,
and cost-aware drafting cuts it each pass to the part that pays on this machine.

Updating ("matrix update"): after each pass, each input's row becomes the top-k of its logits, the
rejected guesses' rows too: their "trash" is what later passes recycle. The newest row wins; the
matrix lives as long as the drafter (the paper's hot start: later prompts inherit it),
(V x 8 int32: 1.5 MB for the default model). A token never seen as an input has no row, and nothing is guessed after it; the
prefill gives the last prompt token's row only (the loop projects no other prompt token), so a first
prompt starts nearly empty.

Verification is the tree rule of verify.py, so greedy output is vanilla's and sampling stays exact.
"""

import numpy as np

from drafters import Drafter
from tree import Evidence, Tree, best_sparse_tree

TOP_K = 8  # the paper's k: candidates kept per token

# P(a recycled guess is accepted | its parent was), per rank in its parent's row: measured with
# `python bench.py acceptance --methods recycling-fixed --tree-rows 64` (18 held-out prompts, 9
# categories, 9345 judged guesses). They hardly depend on depth (rank 0: 0.47, 0.47, 0.47, 0.51 at
# depths 1-4), so one row serves every depth. They shape the candidate tree and are cost-aware
# drafting's priors.
RANK_ACCEPTANCE = [0.47, 0.11, 0.05, 0.03, 0.015, 0.015, 0.01, 0.01]
MAX_DEPTH = 8

class RecyclingDrafter(Drafter):
    """Token Recycling: a tree of `size` guesses read from the adjacency matrix (see the module docstring)."""

    DEFAULT_ROWS = 16  # inputs per pass, the root included: the candidates cost-aware drafting cuts from

    def __init__(self, vocab_size: int, size: int):
        self.matrix = np.full((vocab_size, TOP_K), -1, dtype=np.int32)  # -1: no row yet (numpy's indexing: a
        # few microseconds a pass where torch's took a tenth of a millisecond)
        self.spec = best_sparse_tree([RANK_ACCEPTANCE] * MAX_DEPTH, size)  # rank paths, e.g. (0, 1): best, then its second
        self.max_extra_inputs = len(self.spec)

    def propose(self):
        root = self.history[-1]
        tokens, parents, evidence = [root], [-1], [()]
        node_of_path = {(): 0}
        rows = {}  # the matrix rows read so far, as lists
        for path in self.spec:  # parents come first in the spec
            parent = node_of_path.get(path[:-1])
            if parent is None:
                continue  # its parent had no row
            parent_token = tokens[parent]
            if parent_token not in rows:
                rows[parent_token] = self.matrix[parent_token].tolist()
            token = rows[parent_token][path[-1]]
            if token < 0:
                continue
            node_of_path[path] = len(tokens)
            tokens.append(token)
            parents.append(parent)
            rank = path[-1]
            evidence.append((Evidence(("recycling", rank), RANK_ACCEPTANCE[rank]),))
        return Tree(tokens, parents, evidence=evidence)

    def after_pass(self, done):
        super().after_pass(done)
        nodes = range(done.logits_start, len(done.tree))  # the inputs whose logits the pass projected
        top = done.logits[:len(nodes)].topk(TOP_K, dim=-1).indices  # [R, k]
        self.matrix[[done.tree.tokens[node] for node in nodes]] = top.cpu().numpy()
