"""EAGLE: a small draft head that continues the model's own features (Li et al. 2024, "EAGLE:
Speculative Sampling Requires Rethinking Feature Uncertainty"; the tree of "EAGLE-2: Faster Inference
of Language Models with Dynamic Draft Trees"; the reduced draft vocabulary and training-time test of
"EAGLE-3: Scaling up Inference Acceleration of Large Language Models via Training-Time Test", 2025).

Read in this order:
1. `EagleHead` (EAGLE section 3.1, "Drafting phase"): the model's feature f_i (its final hidden state at
   position i, what its LM head reads) and the embedding of the token that followed, e(t_{i+1}), go
   through one linear layer, [e; f] (2D) -> D, and one decoder layer (model.Block) to a guess of the
   next feature f_{i+1}; the LM head's rows for the draft vocabulary turn it into a distribution over
   t_{i+2}. Feeding the token that was actually chosen is what removes the feature's uncertainty (the
   paper's "shifted token"). The draft vocabulary is EAGLE-3's: the DRAFT_VOCAB tokens most frequent in
   the training answers (`draft_ids`, its id map): the default model's tied LM head is 28M of its 135M
   weights, so a draft step through all of it would read a fifth of what a pass reads, and through
   8192 rows a thirtieth.
2. `EagleDrafter` (EAGLE-2 section 4): the head keeps its own one-layer K/V cache over the history
   (the prompt's last PROMPT_WINDOW positions on; one row per accepted node: that node's feature and
   the token after it), read when it next drafts (`read_history`). Drafting
   then grows a `DraftTree` one depth at a time (4.1, "Expansion"): the frontier is the `expand` nodes
   of highest *value*, the product of the draft's confidences along the path (an estimate of the chance
   the node is accepted), and each frontier node's `top_k` children join the tree. The tree's best
   nodes by value are kept (4.2, "Reranking"; a child's value never exceeds its parent's, so they form
   a tree) and cost-aware drafting (cost_aware.py) cuts them to what pays, with the draft's confidence
   as each guess's prior. A depth is drafted only while its nodes could pay for the step's time
   (`worth_another_step`), and a pass is drafted for only while the trees drafted lately made their
   passes faster than they would have been without them (`worth_drafting`, `realized_gain`).
3. `eagle_loss` (EAGLE section 3.2, EAGLE-3 section 3.2): with the model frozen, the head learns to
   regress the next feature (smooth L1) and to match the model's next-token distribution through the
   LM head (cross-entropy, weight CLASSIFICATION_WEIGHT), over `steps` draft steps: step s feeds the
   head's own features of step s - 1, as decoding will (EAGLE-3's training-time test), each position
   seeing the true history and its own earlier steps. `python train_prompt.py eagle` runs it.

Verification is every method's (verify.py): the guesses are the draft's top tokens, deterministic, so
greedy output is vanilla's and sampling stays exact.
"""

import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from methods import artifacts
from methods.cost_aware import best_rate
from drafters import Drafter, Request
from kv_cache import KVCache
from model import Block, LlamaConfig, at_least_float32, causal_mask, rope_inverse_frequencies, rotary_cos_sin
from tree import Evidence, Tree

DRAFT_VOCAB = 8192  # EAGLE-3 drafts over a reduced vocabulary: the most frequent tokens
CLASSIFICATION_WEIGHT = 0.1  # w_cls of EAGLE section 3.2 (the regression's weight is 1)
FEATURE_NOISE = 0.1  # EAGLE section 3.2's data augmentation: uniform noise on the input features
MAX_DEPTH = 8  # draft steps per pass at most


class EagleHead(nn.Module):
    """The draft head: fc([e(t_{i+1}); f_i]) -> one decoder layer -> the guessed feature f_{i+1}.

    draft_ids [W]: the token id of each draft-vocabulary row (EAGLE-3's id map); the LM head's rows
    for them are gathered once (`use_lm_head`) and stay frozen: the model's own LM head, in fewer rows."""

    def __init__(self, config: LlamaConfig, draft_ids: torch.Tensor):
        super().__init__()
        self.config = config
        self.fc = nn.Linear(2 * config.hidden_size, config.hidden_size)
        self.layer = Block(config)
        self.register_buffer("draft_ids", draft_ids.long())
        self.register_buffer("inv_freq", rope_inverse_frequencies(config), persistent=False)
        self.draft_lm_head: torch.Tensor | None = None  # [W, D], use_lm_head

    def use_lm_head(self, lm_head: nn.Linear) -> "EagleHead":
        self.draft_lm_head = lm_head.weight.detach()[self.draft_ids]  # [W, D]
        return self

    def forward(self, features, embeddings, positions, cache=None, slots=None, mask=None):
        """features, embeddings [B, T, D] (f_i and e(t_{i+1})), positions [T] (i) -> guessed features
        [B, T, D] (f_{i+1}). cache/slots/mask as model.Llama.hidden_states (a one-layer cache)."""
        x = self.fc(torch.cat([embeddings, features], dim=-1))  # [B, T, 2D] -> [B, T, D]
        T = x.shape[1]
        if mask is None and T > 1:
            mask = causal_mask(0 if cache is None else slots.start, T, x.device)
        cos, sin = rotary_cos_sin(self.inv_freq, positions.view(-1, T), x.dtype)
        return self.layer(x, cos, sin, 0, cache, slots, mask)

    def logits(self, features):
        """[..., D] -> [..., W]: logits over the draft vocabulary."""
        if features.dim() == 2 and not features.requires_grad:  # drafting: (W x^T)^T reads the rows of W in
            return (self.draft_lm_head @ features.T).T  # order, 1.7x faster on a CPU than x W^T for a few rows
        return features @ self.draft_lm_head.T


def draft_vocabulary(token_lists, vocab_size: int, size: int = DRAFT_VOCAB) -> torch.Tensor:
    """The `size` tokens most frequent in `token_lists` (ties: the lower id), then the lowest ids not
    seen, so that the map always has `size` rows (fewer if the vocabulary is smaller). Ascending ids."""
    counts = torch.zeros(vocab_size, dtype=torch.long)
    for tokens in token_lists:
        counts += torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=vocab_size)
    order = sorted(range(vocab_size), key=lambda token: (-counts[token].item(), token))
    return torch.tensor(sorted(order[:min(size, vocab_size)]))


class EagleDrafter(Drafter):
    """EAGLE with EAGLE-2's dynamic tree of at most `inputs` - 1 guesses (see the module docstring).

    expand: frontier nodes per depth; top_k: children drafted per frontier node; depth: draft steps."""

    WARM_UP = 4  # gains of trees drafted before they decide
    # the head reads the prompt's last positions only: through all of a 2,000-token RAG prompt, its first
    # reading cost a few passes; a guess of the next feature leans on the latest ones
    PROMPT_WINDOW = 64

    def __init__(self, model, head: EagleHead, inputs: int, depth: int = 5, expand: int = 4, top_k: int = 4,
                 costs=None):
        head.requires_grad_(False)
        self.model, self.head = model, head
        self.size, self.depth, self.expand, self.top_k = inputs - 1, depth, expand, top_k
        self.max_extra_inputs = self.size
        self.costs = costs  # cost-aware drafting (cost_aware.Costs): what a draft step may cost

    def begin(self, request: Request):
        super().begin(request)
        c = self.head.config
        capacity = (request.max_length or c.max_positions) + self.depth * self.expand + 1
        self.cache = KVCache(1, c.num_kv_heads, c.head_dim, capacity, dtype=self.model.dtype, device=self.model.device)
        self.pending: list[torch.Tensor] = []  # [n, D] features of accepted nodes the head has not read yet
        self.unread = 0  # the prompt's first positions, which the head never reads (PROMPT_WINDOW)
        self.step_seconds: list[float] = []  # each draft step's time (a frontier through the head)
        self.child_confidence: list[float] = [0.5]  # the draft's confidence in a drafted node's likeliest child
        self.steady_reads: list[float] = []  # each reading of one pass's accepted nodes (read_history)
        self.drafted_last = False  # whether the head drafted for the last pass (so has read all but it)
        self.gains: list[float] = []  # per tree drafted: what drafting it made its pass's rate (realized_gain)
        self.tree_seconds = 0.0  # the latest tree's drafting, after the reading of the history

    def after_pass(self, done):
        """Keep the accepted nodes' features (each with the token after it, now in the history): the head
        reads them when it next drafts (`read_history`), all at once, so a pass that drafts nothing costs
        the head nothing."""
        super().after_pass(done)
        followers = len(self.history) - done.cache_length - 1  # the accepted nodes with a token after them
        self.pending.append(done.hidden[done.path[:followers]])  # [n, D]
        if self.costs is not None and self.drafted_last and done.verdict is not None and len(self.steady_reads) > 1:
            self.gains.append(self.realized_gain(done))  # (not the first tree's: no read of one pass yet)

    def read_history(self) -> torch.Tensor | None:
        """Run the head over every history position it has not read, the pair (the model's feature there,
        the next token), into its cache: [D], its guess of the root's feature (None: nothing to read)."""
        features = torch.cat(self.pending)  # [n, D]
        self.pending = []
        if self.cache.length == 0 and len(features) > self.PROMPT_WINDOW:
            self.unread = len(features) - self.PROMPT_WINDOW
            features = features[self.unread:]
        start = self.unread + self.cache.length  # the position of the first pair read
        if not len(features):
            return None
        tokens = torch.tensor(self.history[start + 1:start + 1 + len(features)], device=self.model.device)
        positions = torch.arange(start, start + len(features), device=self.model.device)
        guessed = self.head(features[None], self.model.embed(tokens)[None], positions,
                            cache=self.cache, slots=self.cache.claim(len(features)))
        return guessed[0, -1]

    def propose(self) -> Tree:
        """EAGLE-2's expansion and reranking (sections 4.1, 4.2) from the head's guess of the root's
        feature; nothing where cost-aware drafting says the head's time would not pay (`worth_drafting`)."""
        root = Tree.chain(self.history[-1], [])
        drafted_last, self.drafted_last = self.drafted_last, False
        if self.size == 0 or not self.worth_drafting():
            return root
        started = time.perf_counter()
        guessed = self.read_history()
        read = time.perf_counter()
        if guessed is None:
            return root
        tree = self.drafted(guessed)
        self.drafted_last = True
        if drafted_last or not self.steady_reads:
            self.steady_reads.append(read - started)
        self.tree_seconds = time.perf_counter() - read
        return tree

    def realized_gain(self, done) -> float:
        """What the head's tree made the pass `done` worth: its tokens per second (the pass's own seconds, and
        the head's drafting with its reading of the history priced as one pass's: the median of the latest)
        over those of the same pass without the head's guesses (its seconds scaled by L(n) to fewer inputs).
        In `auto` other sources guess too; a guess another source made as well is theirs. What was accepted
        counts, not what the draft expected, so that over-confident guesses stop the drafting too."""
        others = [node for node in range(len(done.tree))
                  if not node or any(key[0] != "eagle" for key, _ in done.tree.evidence[node])]
        accepted = done.path[:1 + done.guesses_kept]
        accepted_without = next((i for i, node in enumerate(accepted) if node not in others), len(accepted))
        reads = self.steady_reads[1:][-9:]  # (the first read the prompt)
        seconds = self.tree_seconds + sorted(reads)[len(reads) // 2]
        latency = self.costs.latency
        # the pass as timed (L(n) where it was not), and without the head's guesses scaled by L(n)'s ratio
        pass_seconds = done.seconds or latency(done.tree.input_count)
        without = pass_seconds * latency(len(others)) / latency(done.tree.input_count)
        return len(accepted) / (pass_seconds + seconds) / (accepted_without / without)

    def worth_drafting(self) -> bool:
        """Whether to draft this pass: always without cost-aware drafting; with it, once L(1) is measured,
        for the first WARM_UP trees, then while the trees drafted lately made their passes faster on average
        than they would have been without them (realized gains over 1), and on Costs' probes (a pass it
        skips counts as one whose guesses were cut): how well the head guesses changes with the text, and
        a tree costs its steps whatever is sent."""
        if self.costs is None:
            return True
        if not self.costs.latency.measured_enough(1):
            return False
        recent = self.gains[-8:]
        if len(self.gains) < self.WARM_UP or self.costs.idle >= self.costs.probe_after or sum(recent) > len(recent):
            return True
        self.costs.idle += 1
        return False

    def drafted(self, guessed: torch.Tensor) -> Tree:
        """The tree grown from `guessed`, the head's guess of the root's feature."""
        started, history = time.perf_counter(), self.cache.length  # the root sits at this position
        draft = DraftTree(self.history[-1])
        feature_of = {0: guessed}  # node -> the head's guess of its feature: its children's logits
        slot_of = {}  # drafted node -> its row in the head's cache
        expanded = [0]  # the nodes whose children this depth drafts
        for depth in range(1, self.depth + 1):
            step_started = time.perf_counter()
            features = torch.stack([feature_of[node] for node in expanded])  # [F, D]
            logits = self.head.logits(features)  # [F, W]
            log_probs = torch.log_softmax(logits.to(at_least_float32(logits.dtype)), dim=-1)
            top = log_probs.topk(min(self.top_k, log_probs.shape[-1]), dim=-1)
            children = draft.grow(expanded, [[(int(self.head.draft_ids[index]), math.exp(log_p))
                                              for log_p, index in zip(row_log_probs.tolist(), row_indices.tolist())]
                                             for row_log_probs, row_indices in zip(top.values, top.indices)])
            if depth > 1:
                self.child_confidence += top.values[:, 0].exp().tolist()
            frontier = draft.frontier(children, self.expand)
            if depth == self.depth or not self.worth_another_step(frontier, draft.values, time.perf_counter() - started):
                break
            self.step(frontier, draft, feature_of, slot_of, history, depth)
            expanded = frontier
            self.step_seconds.append(time.perf_counter() - step_started)
        self.cache.truncate(history)
        return self.reranked(draft)

    def step(self, frontier, draft: "DraftTree", feature_of, slot_of, history, depth) -> None:
        """One draft step: each frontier node, as the pair (its parent's guessed feature, its token) at its
        parent's position, through the head, seeing the history and its own drafted ancestors; their
        guessed features go to `feature_of`."""
        device = self.model.device
        features = torch.stack([feature_of[draft.parents[node]] for node in frontier])  # [F, D]
        embeddings = self.model.embed(torch.tensor([draft.tokens[node] for node in frontier], device=device))  # [F, D]
        slots = self.cache.claim(len(frontier))
        mask = torch.zeros(len(frontier), self.cache.length, dtype=torch.bool)  # [F, S]
        mask[:, :history] = True
        for row, node in enumerate(frontier):
            slot_of[node] = slots.start + row
            ancestor = node
            while ancestor:  # (the root's own row is the history's last)
                mask[row, slot_of[ancestor]] = True
                ancestor = draft.parents[ancestor]
        positions = torch.full((len(frontier),), self.unread + history + depth - 1, device=device)
        guessed = self.head(features[None], embeddings[None], positions, cache=self.cache, slots=slots,
                            mask=mask.to(device))
        for row, node in enumerate(frontier):
            feature_of[node] = guessed[0, row]

    def worth_another_step(self, frontier, values, spent: float) -> bool:
        """Whether drafting one depth more pays for its time (SpecDec++'s rule, with a step priced as
        measured): the best tokens per second the tree could reach now, against the same with each frontier
        node's likeliest child added, at the frontier node's value times the draft's mean confidence in
        its likeliest child so far (`child_confidence`), and a step's time (the mean of the last steps)
        added to the `spent` seconds of this proposal. Without cost-aware drafting: always."""
        if self.costs is None or not self.step_seconds:
            return True
        step = sum(self.step_seconds[-16:]) / len(self.step_seconds[-16:])
        confidence = sum(self.child_confidence[-64:]) / len(self.child_confidence[-64:])
        drafted = values[1:]
        deeper = drafted + [values[node] * confidence for node in frontier]
        return (best_rate(deeper, self.size, self.costs.latency, spent + step)
                > best_rate(drafted, self.size, self.costs.latency, spent))

    def reranked(self, draft: "DraftTree") -> Tree:
        """The draft's best `size` nodes (`DraftTree.best`) as a tree whose guesses carry the draft's
        confidence."""
        keep = [0] + draft.best(self.size)
        row = {node: i for i, node in enumerate(keep)}
        evidence = [()] + [(Evidence(("eagle", draft.depths[node], min(int(draft.confidences[node] * 10), 9)),
                                     draft.confidences[node]),) for node in keep[1:]]
        return Tree([draft.tokens[node] for node in keep], [-1] + [row[draft.parents[node]] for node in keep[1:]],
                    evidence=evidence)


class DraftTree:
    """EAGLE-2's draft tree as it grows (section 4). Per node: its token, its parent, its depth, the
    draft's confidence in it (its probability under the draft, given its path) and its *value*, the
    product of the confidences on its path: the draft's estimate of the chance the node is accepted.
    Node 0 is the root, the history's last token, with value 1."""

    def __init__(self, root: int):
        self.tokens, self.parents, self.depths = [root], [-1], [0]
        self.confidences, self.values = [1.0], [1.0]

    def grow(self, expanded: list[int], children: list[list[tuple[int, float]]]) -> list[int]:
        """Give each node of `expanded` its drafted children, `children[i]` for `expanded[i]`: (token, the
        draft's confidence) pairs, added in that order (section 4.1, "Expansion"). -> the new nodes."""
        added = []
        for parent, drafted in zip(expanded, children):
            for token, confidence in drafted:
                self.tokens.append(token)
                self.parents.append(parent)
                self.depths.append(self.depths[parent] + 1)
                self.confidences.append(confidence)
                self.values.append(self.values[parent] * confidence)
                added.append(len(self.tokens) - 1)
        return added

    def frontier(self, nodes: list[int], expand: int) -> list[int]:
        """The `expand` nodes of `nodes` of highest value, the highest first (ties: the earlier node): the
        nodes the next draft step expands (section 4.1: the likeliest paths, not the likeliest last steps)."""
        return sorted(nodes, key=lambda node: (-self.values[node], node))[:expand]

    def best(self, size: int) -> list[int]:
        """The `size` drafted nodes of highest value (section 4.2, "Reranking"), in the order they were
        drafted. A child's value is never above its parent's, so with ties going to the shallower node they
        form a tree: of all trees of `size` drafted nodes, the one whose values sum highest."""
        ranked = sorted(range(1, len(self.tokens)), key=lambda node: (-self.values[node], self.depths[node], node))
        return sorted(ranked[:size])


def load_head(model, path: Path) -> EagleHead:
    """The head saved at `path` by train_prompt.py (checked to be made for `model`)."""
    tensors, meta = artifacts.load(path, "eagle", model)
    with artifacts.unpacking(path, "eagle"):
        head = EagleHead(model.config, tensors["draft_ids"]).to(model.device)
        head.load_state_dict(tensors)
        return head.to(model.dtype).use_lm_head(model.lm_head).eval()


def load_drafter(model, path: Path, inputs: int, costs=None) -> EagleDrafter:
    """EAGLE's drafter with the head saved at `path`."""
    return EagleDrafter(model, load_head(model, path), inputs, costs=costs)


# ---- training (the model frozen) -------------------------------------------------------------------

class EarlierSteps:
    """The head's one-layer cache while training: each step's keys and values joined after the earlier
    steps' (autograd sees through), so that step s sees steps 1..s (the mask says which rows)."""

    def __init__(self):
        self.keys, self.values = [], []

    def write(self, layer, slots, k, v):
        self.keys.append(k)
        self.values.append(v)
        return torch.cat(self.keys, dim=2), torch.cat(self.values, dim=2)


def unrolled_mask(T: int, step: int, device=None) -> torch.Tensor:
    """[T, step * T]: what row i of draft step `step` (its pair at position i + step - 1) sees: the true
    history's pairs at positions 0..i (step 1's rows 0..i), and its own rows of steps 2..step (the
    guesses it was drafted through). EAGLE-3's training-time test; step 1 alone is the causal mask."""
    rows = torch.arange(T, device=device)
    history = rows[None, :] <= rows[:, None]  # [T, T]
    own = torch.eye(T, dtype=torch.bool, device=device)
    return torch.cat([history] + [own] * (step - 1), dim=1)


def unrolled(model, head: EagleHead, features, tokens, steps: int, noise: float = 0.0, generator=None):
    """The head over one sequence (features [T, D], tokens [T]) for `steps` draft steps, as decoding
    runs it: step 1 reads the model's features (plus uniform noise of this size), step s the head's own
    guesses of step s - 1. Yields (step, guessed features [T, D]): row i guesses f_{i+step}."""
    T = len(tokens)
    cache = EarlierSteps()
    guessed = features
    if noise:
        guessed = features + (torch.rand(features.shape, generator=generator) * 2 - 1).to(features) * noise
    for step in range(1, steps + 1):
        ahead = torch.cat([tokens[step:], tokens.new_zeros(step)])  # x_{i+step} (0 past the end)
        positions = torch.arange(T) + step - 1
        guessed = head(guessed[None], model.embed(ahead)[None], positions, cache=cache, slots=slice(0, T),
                       mask=unrolled_mask(T, step))[0]
        yield step, guessed


def answer_rows(T: int, step: int, answer_start: int) -> torch.Tensor:
    """The rows of draft step `step` over a sequence of T tokens that are judged: row i guesses f_{i+step},
    whose next token (at i + step + 1) must be in the answer (position answer_start on) and exist."""
    return torch.arange(max(0, answer_start - step - 1), T - step)


def eagle_loss(model, head: EagleHead, features, tokens, answer_start: int, steps: int = 1,
               noise: float = FEATURE_NOISE, generator=None) -> torch.Tensor:
    """EAGLE's loss on one sequence, summed over the draft steps: smooth L1 between the guessed and the
    model's next features, plus CLASSIFICATION_WEIGHT times the cross-entropy of the draft vocabulary's
    distribution of the guess against the model's own (over the same rows), on the rows whose predicted
    token is in the answer (position answer_start on)."""
    T, total = len(tokens), 0.0
    for step, guessed in unrolled(model, head, features, tokens, steps, noise, generator):
        rows = answer_rows(T, step, answer_start)
        if not len(rows):
            break
        target = features[rows + step]  # [R, D]
        regression = F.smooth_l1_loss(guessed[rows], target)
        teacher = torch.softmax(head.logits(target), dim=-1)  # [R, W]
        classification = -(teacher * torch.log_softmax(head.logits(guessed[rows]), dim=-1)).sum(-1).mean()
        total = total + regression + CLASSIFICATION_WEIGHT * classification
    return total


@torch.no_grad()
def eagle_accuracy(model, head: EagleHead, sequences, steps: int, ranks: int = 10) -> list[list[float]]:
    """accuracy[s][r]: on held-out sequences (features, tokens, answer_start), how often draft step s+1's
    rank-r token is the model's own greedy choice there (its LM head over all of the vocabulary), the
    earlier tokens being the sequence's."""
    hits, counts = torch.zeros(steps, ranks), torch.zeros(steps, 1)
    for features, tokens, answer_start in sequences:
        T = len(tokens)
        for step, guessed in unrolled(model, head, features, tokens, steps):
            rows = answer_rows(T, step, answer_start)
            if not len(rows):
                break
            choice = model.lm_head(features[rows + step]).argmax(-1)  # [R]
            guesses = head.draft_ids[head.logits(guessed[rows]).topk(ranks, dim=-1).indices]  # [R, ranks]
            hits[step - 1] += (guesses == choice[:, None]).sum(0)
            counts[step - 1] += len(rows)
    return (hits / counts.clamp(min=1)).tolist()
