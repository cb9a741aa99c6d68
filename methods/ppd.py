"""PPD (Chen et al. 2024, "Hardware-Aware Parallel Prompt Decoding for Memory-Efficient Acceleration
of LLM Inference"): trained embeddings ride along in each forward pass and guess the next tokens.

The paper calls them *prompt tokens* (trained as in prompt tuning); this code calls them **soft
tokens**, so that "prompt tokens" always means the prompt's own tokens. Read in this order:

1. `SoftTokens` (sections 3.1-3.2): m trained embeddings (distances 1..m), each in n ensemble copies
   (EPTs) whose logits are averaged. They are the method's only new parameters (a few thousand).
2. `PPDDrafter` (section 3, Figure 2): the soft tokens are the tree's extra inputs, fed after its
   nodes in the same forward pass that verifies them (`soft_layout`: which node carries which, their
   positions and the ensemble mask, appendix B.5.1; tree.ExtraInputs); the soft tokens of the last
   accepted node guess the next tree's candidates. The prompt's last token carries all m in the
   prefill, so the first tree already has guesses.
3. The dynamic sparse tree (section 4, propositions 4.1-4.4): `dynamic_sparse_tree` builds, per state
   T_k (the last accepted node carried k soft tokens, so k distances are guessed), the best candidate
   tree and allots soft tokens to its nodes where they pay most (`allot_soft_tokens`); the states form
   a Markov chain whose stationary distribution gives the tokens per pass (`DynamicSparseTree`).
   `best_dynamic_sparse_tree` splits a budget of inputs per pass between candidates and soft tokens
   (section 4.2's c(n_c, n_p)); calibrate.py chooses that budget for this machine (hardware-aware).
4. Training (section 3.3): `ppd_loss` takes soft tokens inserted after given points of an answer and
   distils the model's distribution at each distance into them (eq. 1), with the same mask decoding
   uses (`insertion_layout`); `guess_hits` counts how often the rank-r guess at distance d is right,
   the table the tree is built from. `python train_prompt.py ppd` runs it (train_prompt.py: the
   model's own answers, the random points, the loop).
"""

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from methods import artifacts
from methods.cost_aware import Costs, best_subtree_nodes, reach
from drafters import TOP_RANKS, Pass, TopKDrafter
from errors import TooFewRows
from training.self_distill import FrozenPrefix
from tree import ExtraInputs, Tree, best_sparse_tree, expected_accepted, path_probability

LOSS_DECAY = 0.8  # alpha of equation 1 (the paper gives no value)


class SoftTokens(nn.Module):
    """PPD's only trained parameters: embeddings [m, n, D] of m soft tokens (distances 1..m), each
    in n ensemble copies (EPTs, section 3.2)."""

    def __init__(self, embeddings: torch.Tensor):
        super().__init__()
        self.embeddings = nn.Parameter(embeddings)

    @property
    def count(self) -> int:
        return self.embeddings.shape[0]

    @property
    def ensembles(self) -> int:
        return self.embeddings.shape[1]

    def ensemble_average(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits of k soft tokens' copies [k * n, V] -> [k, V], averaged over each soft token's n
        EPTs (section 3.2; appendix B.6: averaging beats learned weights)."""
        return logits.view(-1, self.ensembles, logits.shape[-1]).mean(1)


def soft_layout(counts: Sequence[int], ensembles: int, soft_tokens: SoftTokens | None = None) -> ExtraInputs:
    """The extra inputs of a tree whose node i carries counts[i] soft tokens (distances 1..counts[i]),
    each in `ensembles` copies: rows node by node, distance by distance, copy by copy. The soft token
    at distance d sits d places after its node, where the token it guesses would be, and sees its
    node, the node's ancestors and the same copy's soft tokens at smaller distances (appendix B.5.1,
    the ensemble mask: the n-th EPT sees only the n-th EPTs before it). Their inputs are
    `soft_tokens`' embeddings (None: the layout alone)."""
    node, distance, follows, group = [], [], [], []
    for carrier, count in enumerate(counts):
        first = len(node)
        for d in range(1, count + 1):
            for g in range(ensembles):
                node.append(carrier)
                distance.append(d)
                follows.append(-1 if d == 1 else first + (d - 2) * ensembles + g)
                group.append(g)
    embeddings = None if soft_tokens is None else soft_tokens.embeddings[[d - 1 for d in distance], group]
    return ExtraInputs(tuple(node), tuple(distance), tuple(follows), embeddings)  # embeddings: [S, D]


class PPDDrafter(TopKDrafter):
    """PPD: the soft tokens carried by the last accepted node guessed k distances ahead, so the next
    tree is the state T_k of the dynamic sparse tree (section 4, Figure 3), its nodes carrying the
    soft tokens the tree allots them."""

    def __init__(self, model, soft_tokens: SoftTokens, dynamic_tree: "DynamicSparseTree",
                 accuracy: list[list[float]], costs=None):
        self.model, self.soft_tokens, self.dynamic_tree = model, soft_tokens.requires_grad_(False), dynamic_tree
        self.accuracy = accuracy  # accuracy[d][r], held out: the prior of each guess's acceptance
        prefill_inputs = soft_tokens.count * soft_tokens.ensembles  # after the prompt, in the prefill
        self.max_extra_inputs = max(prefill_inputs, dynamic_tree.inputs - 1)
        self.predicted_tokens_per_pass = dynamic_tree.tokens_per_pass
        self.costs = costs  # cost-aware drafting (SoftTokenCosts): soft tokens ride only where they pay
        fullest = dynamic_tree.states[max(dynamic_tree.states)]  # the tree after a node carrying them all
        self.shape = Tree.shape_of(fullest.spec, accuracy, "ppd")
        self.layouts: dict[tuple[int, ...], ExtraInputs] = {}  # soft tokens per node -> their extra inputs (carrying)

    def carrying(self, tree: Tree, counts: Sequence[int]) -> Tree:
        """`tree` with counts[i] soft tokens (all their copies) on node i. Each layout is made once: the
        dynamic tree has a few states, and gathering the soft tokens' embeddings anew each pass cost a
        copy to the GPU and a wait for it."""
        counts = tuple(counts)
        if counts not in self.layouts:
            self.layouts[counts] = soft_layout(counts, self.soft_tokens.ensembles, self.soft_tokens)
        return tree.with_extra(self.layouts[counts])

    def prefill_tree(self, prompt_ids):
        prompt = super().prefill_tree(prompt_ids)
        return self.carrying(prompt, [0] * (len(prompt) - 1) + [self.soft_tokens.count])

    def after_pass(self, done):
        super().after_pass(done)
        soft_logits = done.last_extra_logits()  # [k * n, V]: the last accepted node's k soft tokens, n copies each
        self.candidates = []
        if len(soft_logits):  # (every node carries some, except where another drafter built the tree)
            self.keep_top(self.soft_tokens.ensemble_average(soft_logits))

    def propose(self):
        if not self.candidates:  # the last pass carried no soft tokens: the root carries them all, as in the prefill
            tree = Tree.chain(self.history[-1], [])
            counts = [self.soft_tokens.count]
        else:
            state = self.dynamic_tree.states[len(self.candidates)]
            tree = Tree.from_topk(self.history[-1], self.candidates, state.spec, self.accuracy, source="ppd")
            counts = state.soft_counts
        carried = self.carrying(tree, counts)
        # their gain: what their next tree is worth beyond its time, as this generation's outcomes of
        # their guesses (the held-out accuracies at first) stand
        if self.costs is None:
            return carried
        if not self.costs.extra_inputs_pay(tree, carried, self.costs.surplus(self.shape)):
            return tree  # a pass without soft tokens: the next one has no guesses of theirs
        if self.costs.carried_for_probe:  # a ride for the next pass's probe: as far ahead as it will guess,
            depth = self.costs.probe_depth(self.shape)  # in as many as a state of the tree follows (static: all)
            ride = min(k for k in self.dynamic_tree.states if k >= depth)
            return self.carrying(tree, [min(count, ride) for count in counts])
        return carried


class SoftTokenCosts(Costs):
    """Cost-aware drafting (cost_aware.Costs) for a drafter whose trees can carry soft tokens (PPD, and
    `--method auto`, which carries them on its root): they ride along only when what their guesses make
    the next pass worth pays for their inputs in this one (`extra_inputs_pay`), and a run of passes that
    left them out ends in a probe over two passes: they ride along in one (only as far ahead as the
    probe will guess, `probe_depth`), and the next probes the guesses they made (cut as usual, those
    guesses would go unjudged, and their estimates could never recover)."""

    def begin(self) -> None:
        super().begin()
        self.withheld = False  # whether extra_inputs_pay left this pass's soft tokens out
        self.carried_for_probe = self.probe_due = False  # their probe: they ride now, their guesses next

    def cut(self, candidates: Tree) -> Tree:
        tree = super().cut(candidates)
        self.withheld = self.probe_due = False
        return tree

    def left_something_out(self, candidates: Tree) -> bool:
        return super().left_something_out(candidates) or self.withheld

    def probe_now(self) -> bool:
        return super().probe_now() or self.probe_due

    def learn(self, done: Pass) -> None:
        super().learn(done)
        self.probe_due, self.carried_for_probe = self.carried_for_probe, False

    def probe_depth(self, shape: Tree) -> int:
        """How far ahead a probe of a tree of this shape guesses (`probe`): soft tokens that ride along
        for a probe need make guesses no further ahead. PPD's three soft tokens rode along whole on a
        probe (4 inputs) where the next pass probed one or two of their guesses; carried as far as this,
        decisions priced at one fixed L(n) gained 0.7-1.6 points (docs/results.md). `--method auto`
        carries them all: its probe also judges the other sources' guesses, as deep as they go."""
        return max(self.probe(shape).depths)

    def extra_inputs_pay(self, tree: Tree, carried: Tree, gain: float) -> bool:
        """Whether `carried` (`tree` with extra inputs on some of its nodes, whose guesses make the
        next pass worth `gain` tokens beyond its time (`surplus`) when this one's accepted path ends
        at such a node) beats `tree`, both cut to the part of `tree` that pays: the next pass gets
        them with probability P = the sum, over the nodes that carry them, of the chance that the path
        ends there (reached, and none of its children taken: they are different tokens), so they pay
        when (E + P gain) / L(their inputs too) > E / L(tree's inputs). After PROBE_EVERY passes in a row
        that left them out or cut every guess, they ride along once (`carried_for_probe`: PPD then
        carries only those that guess within `probe_depth`), so that `gain`, estimated from their
        guesses' outcomes, can recover; the next pass then probes their guesses (`cut`)."""
        if self.idle >= self.probe_after:  # a probe over two passes: they ride along in this one, and
            self.idle, self.withheld, self.carried_for_probe = 0, False, True  # their guesses are probed in the next
            return True
        nodes = best_subtree_nodes(tree, self.estimates_of(tree), self.pass_cost)
        best, best_carried = tree.subtree(nodes), carried.subtree(nodes)
        p = self.estimates_of(best)
        reached = reach(best, p)
        expected = sum(reached)
        carriers = set(best_carried.extra.node) if best_carried.extra else set()
        ends = sum(reached[node] * max(0.0, 1.0 - sum(p[child] for child in best.children[node])) for node in carriers)
        pays = ((expected + ends * gain) / self.pass_cost(best_carried.input_count)
                > expected / self.pass_cost(best.input_count))
        self.withheld = not pays
        return pays

    def surplus(self, shape: Tree) -> float:
        """What a pass over the part of a tree of this shape that pays (its evidence depends on where its
        nodes are, not on their tokens) is worth beyond sending the root alone, in tokens: those it is
        expected to yield, less those its time would yield one a pass, L(its inputs) / L(1). Its
        accepted guesses alone would count its extra inputs as free: on a CPU where L(4) is 1.45 L(1),
        half a guess a pass is worth 0.05 tokens. Never below 0: the part that pays is the root alone
        (worth 0) unless its tokens per second beat the root's."""
        best = self.best_part(shape)
        return self.expected_tokens(best) - self.pass_cost(best.input_count) / self.pass_cost(1)


def load_drafter(model, path: Path, inputs: int, static: bool = False, costs=None) -> PPDDrafter:
    """The soft tokens saved at `path` by train_prompt.py (checked to be made for `model`), with the
    dynamic sparse tree (or, `static`, every node carrying all soft tokens) of at most `inputs` inputs
    per pass that their held-out accuracies make best."""
    tensors, meta = artifacts.load(path, "ppd", model)
    with artifacts.unpacking(path, "ppd"):
        embeddings = tensors["embeddings"]
        if embeddings.dim() != 3 or embeddings.shape[-1] != model.config.hidden_size:
            raise ValueError(f"embeddings of shape {tuple(embeddings.shape)}, not [m, n, {model.config.hidden_size}]")
        soft_tokens = SoftTokens(embeddings)
        m, n = soft_tokens.count, soft_tokens.ensembles
        smallest = 1 + (m if static else 1) * n  # the root and its soft-token copies
        if inputs < smallest:
            raise TooFewRows(f"--tree-rows {inputs} cannot hold the root and its soft tokens ({m} soft tokens "
                             f"x {n} EPTs{'' if static else ', at least one per node'}): use at least {smallest}")
        tree = best_dynamic_sparse_tree(meta["accuracy"], inputs, m, n, dynamic=not static)
        return PPDDrafter(model, soft_tokens, tree, meta["accuracy"], costs)


# ---- the dynamic sparse tree (section 4) ---------------------------------------------------------
#
# accuracy[d][r]: how often the rank-r guess at distance d+1 was right on held-out answers (tree.py
# explains the independence model and f(T), the expected number of accepted guesses of a tree).

def end_probabilities(accuracy, spec) -> list[float]:
    """For the root and each node of `spec`: the probability that the accepted path ends there (the
    node is accepted, none of its children is; children are different tokens, so disjoint events)."""
    reach = [1.0] + [path_probability(accuracy, path) for path in spec]
    node_of_path = {(): 0} | {tuple(path): i for i, path in enumerate(spec, start=1)}
    ends = list(reach)
    for node, path in enumerate(spec, start=1):
        ends[node_of_path[tuple(path[:-1])]] -= reach[node]
    return [max(e, 0.0) for e in ends]


@dataclass
class TreeState:
    """One state T_k: the candidate spec (at most k deep, as the last accepted node carried k soft
    tokens) and how many soft tokens each node carries (root first)."""
    spec: list[tuple]
    soft_counts: list[int]
    expected_accepted: float  # f(T_k)


@dataclass
class DynamicSparseTree:
    """PPD's dynamic sparse tree: states[k] is used when the last accepted node carried k soft
    tokens. `tokens_per_pass` = 1 + R(T), the amortised tokens per forward pass (proposition 4.4).
    A static tree (every node carrying all m soft tokens, Figure 8a's baseline) has the one state m."""
    states: dict[int, TreeState]
    ensembles: int
    tokens_per_pass: float

    @property
    def inputs(self) -> int:
        """The most inputs a forward pass gets: the root, the candidates and every soft-token copy
        (a shallow state can hold fewer candidates than asked for: depth 1 has only so many ranks)."""
        return max(1 + len(s.spec) + sum(s.soft_counts) * self.ensembles for s in self.states.values())


def allot_soft_tokens(accuracy, spec, soft_tokens: int, max_per_node: int, f: dict[int, float]) -> list[int]:
    """Give every node `max_per_node` soft tokens, then take them away one at a time where it
    costs the least expected tokens at the next step, P(path ends at c) * (f(T_i) - f(T_i-1))
    (proposition 4.3, with the end probability in place of p(c): the next state is set by the node
    the accepted path *ends* at), keeping at least one per node, until `soft_tokens` are left."""
    ends = end_probabilities(accuracy, spec)
    counts = [max_per_node] * (len(spec) + 1)
    removable = [(ends[node] * (f[max_per_node] - f[max_per_node - 1]), node) for node in range(len(counts))
                 if max_per_node > 1]
    heapq.heapify(removable)
    while sum(counts) > soft_tokens and removable:
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


def dynamic_sparse_tree(accuracy, candidates: int, soft_tokens: int, max_soft: int, ensembles: int,
                        dynamic: bool = True) -> DynamicSparseTree:
    """States T_1..T_m with `candidates` candidate nodes each (the best tree at most k deep) and
    `soft_tokens` soft tokens allotted by `allot_soft_tokens` (dynamic), or `max_soft` on every node
    (static: then `soft_tokens` is ignored and only state m occurs)."""
    specs = {k: best_sparse_tree(accuracy, candidates, k) for k in range(1, max_soft + 1)}
    f = {0: 0.0} | {k: expected_accepted(accuracy, spec) for k, spec in specs.items()}
    states = {}
    for k, spec in specs.items():
        counts = (allot_soft_tokens(accuracy, spec, soft_tokens, max_soft, f) if dynamic
                  else [max_soft] * (len(spec) + 1))
        states[k] = TreeState(spec, counts, f[k])
    if not dynamic:
        states = {max_soft: states[max_soft]}
    order = sorted(states)
    transition = []
    for k in order:  # from state k, the next state is the soft-token count of the node the path ends at
        ends = end_probabilities(accuracy, states[k].spec)
        row = [sum(e for e, c in zip(ends, states[k].soft_counts) if c == i) for i in order]
        transition.append([x / sum(row) for x in row])
    pi = steady_state(transition)
    return DynamicSparseTree(states, ensembles, 1 + sum(p * states[k].expected_accepted for p, k in zip(pi, order)))


def best_dynamic_sparse_tree(accuracy, inputs: int, max_soft: int, ensembles: int,
                             dynamic: bool = True) -> DynamicSparseTree:
    """The PPD tree of the most tokens per pass whose forward pass has at most `inputs` inputs: every
    split of the inputs into candidates and soft tokens is tried (section 4.2, c(n_c, n_p))."""
    best = None
    for candidates in range(inputs):
        spare = inputs - 1 - candidates  # inputs left for soft-token copies
        per_copy = spare // ensembles
        if per_copy < (candidates + 1) * (1 if dynamic else max_soft):
            break  # every node needs at least one soft token (static: max_soft)
        tree = dynamic_sparse_tree(accuracy, candidates, min(per_copy, (candidates + 1) * max_soft),
                                   max_soft, ensembles, dynamic)
        if best is None or tree.tokens_per_pass > best.tokens_per_pass:
            best = tree
    if best is None:
        raise ValueError(f"{inputs} inputs cannot hold a root with {ensembles} soft-token copies")
    return best


# ---- training (section 3.3): the base model frozen, only the soft tokens learn --------------------

def insertion_layout(points: list[int], count: int, ensembles: int, prefix_length: int):
    """Rows for soft tokens inserted after each of `points` (positions in the answer's sequence):
    the same layout as a tree whose nodes are those tokens, each carrying `count` soft tokens, so
    training sees the very mask decoding uses (`soft_layout`, the ensemble mask).
    Returns (positions [R], mask [R, prefix_length + R], distance of each row [R])."""
    star = Tree([0] + [1] * len(points), [-1] + [0] * len(points))
    star = star.with_extra(soft_layout([0] + [count] * len(points), ensembles))
    own = star.input_mask(0)[len(star):, len(star):]  # soft rows among themselves
    point = torch.tensor(points).repeat_interleave(count * ensembles)  # [R]
    distance = torch.tensor(star.extra.offset)
    sees_prefix = torch.arange(prefix_length)[None] <= point[:, None]  # the answer up to the insertion
    return point + distance, torch.cat([sees_prefix, own], dim=1), distance


def inserted_logits(model, soft_tokens: SoftTokens, prefix: FrozenPrefix, points: list[int]) -> torch.Tensor:
    """All m soft tokens (n EPTs each) inserted after each of `points` of the sequence whose K/V
    `prefix` holds, in one pass: their EPT-averaged logits [I, m, V]."""
    m, n = soft_tokens.count, soft_tokens.ensembles
    positions, mask, _ = insertion_layout(points, m, n, prefix.length)
    embeds = soft_tokens.embeddings.expand(len(points), m, n, -1).reshape(1, len(points) * m * n, -1)
    hidden = model.hidden_states(embeds=embeds, positions=positions, cache=prefix, slots=prefix.claim(len(positions)),
                                 mask=mask)[0]  # [I*m*n, D]
    return soft_tokens.ensemble_average(model.logits(hidden)).view(len(points), m, -1)


def ppd_loss(model, soft_tokens: SoftTokens, hidden: torch.Tensor, prefix: FrozenPrefix,
             points: list[int]) -> torch.Tensor:
    """Equation 1 on one sequence, whose frozen base pass gave `hidden` [T, D] and `prefix` (its K/V),
    soft tokens inserted after each of `points` (each at least m before the end):
    1/N sum_i KL(P_i || Q_i) alpha^(i-1), P_i the model's own distribution i places after the next
    token, Q_i the i-th soft token's EPT-averaged one."""
    m = soft_tokens.count
    student_logits = inserted_logits(model, soft_tokens, prefix, points)  # [I, m, V]
    with torch.no_grad():  # the teacher for soft token i after t: the model's own distribution at t+i
        teacher_rows = torch.tensor(points)[:, None] + torch.arange(1, m + 1)[None]
        teacher = F.log_softmax(model.logits(hidden[teacher_rows]), dim=-1)  # [I, m, V]
    kl = F.kl_div(F.log_softmax(student_logits, dim=-1), teacher, log_target=True, reduction="none").sum(-1)
    return (kl.mean(0) * LOSS_DECAY ** torch.arange(m)).mean()


@torch.no_grad()
def guess_hits(model, soft_tokens: SoftTokens, prefix: FrozenPrefix, tokens: list[int],
               points: list[int]) -> torch.Tensor:
    """[m, TOP_RANKS]: at how many of `points` (each at least m + 1 before the end of `tokens`, whose
    K/V `prefix` holds) the rank-r guess of soft token d+1 is the actual token d+1 places after the
    next one. Divided by the points, over held-out answers: the accuracy table the tree is built from."""
    m = soft_tokens.count
    guesses = inserted_logits(model, soft_tokens, prefix, points).topk(TOP_RANKS).indices  # [I, m, R]
    actual = torch.tensor(tokens)[torch.tensor(points)[:, None] + torch.arange(2, m + 2)[None]]  # [I, m]
    return (guesses == actual[..., None]).sum(0).float()


def initial_embeddings(model, count: int, ensembles: int, seed: int) -> torch.Tensor:
    """Soft tokens start as embeddings of ordinary tokens (section 5, "Training")."""
    ids = torch.randint(model.config.vocab_size, (count, ensembles), generator=torch.Generator().manual_seed(seed))
    return model.embed.weight[ids].detach().clone().float()
