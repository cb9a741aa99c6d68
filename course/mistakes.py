"""Typical student mistakes, planted in the reference one at a time (`pytest course --mistake NAME`).

Each is the smallest change to the reference that a tired student makes. CI (tests/test_course.py)
grades every one and checks that its assignment's grader fails with a message that points at it
(`caught_by`, a fragment of that message).
"""

from dataclasses import dataclass
from unittest import mock

import torch

import calibrate
import decode
import drafters
import kv_cache
import model
import tree
import verify
from methods import eagle
from tree import Verdict


@dataclass(frozen=True)
class Mistake:
    assignment: str
    name: str  # the graded function or class it replaces
    implementation: object
    caught_by: str  # a fragment of the grader's failure message


# ---- a1: RMSNorm, RoPE, grouped-query attention ----------------------------------------------------

def apply_rotary_interleaved(x, cos, sin):  # pairs (x_2i, x_2i+1) (GPT-J's layout), not (x_i, x_i+E/2)
    rotated = torch.stack([-x[..., 1::2], x[..., 0::2]], dim=-1).flatten(-2)
    return x * cos + rotated * sin


def grouped_attention_heads_modulo(q, k, v, mask):  # query head h uses K/V head h % K, not h // G
    groups = q.shape[1] // k.shape[1]
    return model.grouped_attention(q, k.repeat(1, groups, 1, 1), v.repeat(1, groups, 1, 1), mask)


def rotary_cos_sin_of_the_first_row(inv_freq, positions, dtype):  # every row of a batch at row 0's positions
    return model.rotary_cos_sin(inv_freq, positions[:1].expand_as(positions), dtype)


def grouped_attention_with_the_first_mask(q, k, v, mask):  # a [B, T, S] mask's first row for every sequence
    return model.grouped_attention(q, k, v, mask[0] if mask is not None and mask.dim() == 3 else mask)


def grouped_attention_none_as_tril(q, k, v, mask):  # no mask read as the textbook causal one, blind to the cache
    if mask is None:
        mask = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril()
    return model.grouped_attention(q, k, v, mask)


def rms_norm_by_the_sum(x, weight, eps):  # divides by sqrt(sum(x^2)), not sqrt(mean(x^2))
    return weight * x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


def rms_norm_eps_outside_the_root(x, weight, eps):  # x / (sqrt(mean(x^2)) + eps)
    return weight * x / (x.pow(2).mean(-1, keepdim=True).sqrt() + eps)


def rms_norm_in_the_inputs_dtype(x, weight, eps):  # no float32 upcast: bfloat16 sums in bfloat16
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


# ---- a2: the KV cache ------------------------------------------------------------------------------

class KeepWithoutPacking(kv_cache.KVCache):
    def keep(self, start, offsets):  # keeps the first len(offsets) slots after start, not the chosen ones
        self.truncate(start + len(offsets))


class WriteReturnsOnlyTheNew(kv_cache.KVCache):
    def write(self, layer, slots, k, v):  # returns the pass's own K/V: attention would not see the cache
        super().write(layer, slots, k, v)
        return k, v


class WriteAtTheEnd(kv_cache.KVCache):
    def write(self, layer, slots, k, v):  # writes the last slots in use, wherever `slots` says
        return super().write(layer, slice(self.length - k.shape[2], self.length), k, v)


class KeepKeysOnly(kv_cache.KVCache):
    def keep(self, start, offsets):  # moves the kept keys down, and forgets that the values must move too
        offsets = torch.as_tensor(offsets, dtype=torch.long)
        self.keys[:, :, :, start:start + len(offsets)] = self.keys[:, :, :, start + offsets]
        self.truncate(start + len(offsets))


# ---- a3: tree attention mask and positions ----------------------------------------------------------

class PositionsByIndex(tree.Tree):
    def positions(self, cache_length, device=None):  # the node's index in the layout instead of its depth
        return torch.arange(len(self.tokens), device=device) + cache_length


class CausalMask(tree.Tree):
    def ancestor_mask(self):  # ordinary decoding's mask: every earlier row, not only the ancestors
        rows = len(self.tokens)
        return torch.ones(rows, rows, dtype=torch.bool).tril()


class PositionsFromOne(tree.Tree):
    def positions(self, cache_length, device=None):  # the root one past the cache: cache length + depth + 1
        return torch.tensor(self.depths, device=device) + cache_length + 1


class DescendantMask(tree.Tree):
    def ancestor_mask(self):  # mask[i, j] set when i is an ancestor of j: the transpose
        return super().ancestor_mask().T


# ---- a4: greedy verification and the loop ---------------------------------------------------------

def verify_greedy_own_row(tree, logits):  # a guess checked against the choice after itself, not its parent
    choice = logits.argmax(dim=-1).tolist()
    path = verify.longest_path(tree, lambda node: tree.tokens[node] == choice[node])
    return Verdict.of(tree, path, choice[path[-1]])


def longest_path_first_right_child(tree, is_right):  # follows the first right child, not the deepest path
    path = [0]
    while right := [child for child in tree.children[path[-1]] if is_right(child)]:
        path.append(right[0])
    return path


def generate_without_packing(*args, **kwargs):
    with mock.patch.object(decode, "KVCache", KeepWithoutPacking):  # the loop keeps the wrong slots
        return decode.generate(*args, **kwargs)


def generate_without_counting_the_prefill(*args, **kwargs):  # counts the loop's passes, not the prefill
    generation = decode.generate(*args, **kwargs)
    generation.counts.forward_passes -= 1
    return generation


def generate_with_a_greedy_prefill(*args, **kwargs):  # the first token is the argmax even when sampling
    with mock.patch.object(decode, "choose_token", lambda logits, sampling, generator=None: int(logits.argmax())):
        return decode.generate(*args, **kwargs)


def generate_telling_the_drafter_the_new_tokens_only(*args, **kwargs):  # max_length without the prompt
    request = decode.Request
    with mock.patch.object(decode, "Request", lambda prompt_ids, *rest, max_length, **named: request(
            prompt_ids, *rest, max_length=max_length - len(prompt_ids), **named)):
        return decode.generate(*args, **kwargs)


def generate_recording_no_seconds(*args, **kwargs):  # the drafter is told of a pass, but not what it cost
    record = decode.Pass
    with mock.patch.object(decode, "Pass", lambda *fields, seconds=0.0, **named: record(*fields, **named)):
        return decode.generate(*args, **kwargs)


# ---- a5: ANPD's multi-level n-grams --------------------------------------------------------------

class ShortestContextFirst(drafters.MultiLevelNGram):
    def query(self, tokens):  # the shortest matching context wins (the pseudocode's loop order)
        for length in range(1, min(self.n - 1, len(tokens)) + 1):
            prediction = self.best.get(tuple(tokens[-length:]))
            if prediction is not None:
                return prediction
        return None


class FirstSeenWinsTies(drafters.MultiLevelNGram):
    def add(self, tokens, end):  # a tie keeps the token seen first instead of the most recent
        following = tokens[end]
        for length in range(1, min(self.n - 1, end) + 1):
            counts = self.counts.setdefault(tuple(tokens[end - length:end]), {})
            counts[following] = counts.get(following, 0) + 1
            if counts[following] > counts.get(self.best.get(tuple(tokens[end - length:end])), 0):
                self.best[tuple(tokens[end - length:end])] = following


class LevelsOneShort(drafters.MultiLevelNGram):
    def add(self, tokens, end):  # range(1, min(n - 1, end)): contexts of N - 1 tokens are never recorded
        self.n -= 1
        try:
            super().add(tokens, end)
        finally:
            self.n += 1


class ContextFromTheStart(drafters.MultiLevelNGram):
    def query(self, tokens):  # the context is the first `length` tokens, not the last
        for length in range(min(self.n - 1, len(tokens)), 0, -1):
            prediction = self.best.get(tuple(tokens[:length]))
            if prediction is not None:
                return prediction
        return None


# ---- a6: exact speculative sampling ----------------------------------------------------------------

def verify_speculative_accepting_with_p(tree, probs, chance):  # accepts x with p(x), not p(x) / q(x)
    path = [0]
    while True:
        residual = probs[path[-1]]
        for child in tree.children[path[-1]]:
            q = verify.guess_distribution(tree, child, residual)
            if chance.accept(residual[tree.tokens[child]]):
                path.append(child)
                break
            residual = verify.residual_after_rejection(residual, q)
        else:
            return Verdict.of(tree, path, chance.draw(residual))


def residual_is_p(p, q):  # after a rejection, draws from p again instead of norm(max(0, p - q))
    return p


def residual_without_a_guard(p, q):  # 0 / 0 (nan) when nothing of p is above q, as p == q up to rounding
    residual = (p - q).clamp(min=0)
    return residual / residual.sum()


def verify_speculative_siblings_against_p(tree, probs, chance):  # each sibling is tried against p itself,
    path = [0]                                                     # not against what rejections left of it
    while True:
        p = residual = probs[path[-1]]
        for child in tree.children[path[-1]]:
            q = verify.guess_distribution(tree, child, p)
            if chance.accept(p[tree.tokens[child]] / q[tree.tokens[child]]):
                path.append(child)
                break
            residual = verify.residual_after_rejection(residual, q)
        else:
            return Verdict.of(tree, path, chance.draw(residual))


class ChanceOnlyAboveOne:
    """The ratio p(x) / q(x) used as a test, not a probability: accept only when it exceeds 1."""

    def __init__(self, chance):
        self.chance = chance

    def accept(self, probability) -> bool:
        return float(probability) > 1

    def draw(self, probs) -> int:
        return self.chance.draw(probs)


def verify_speculative_accepting_only_above_one(tree, probs, chance):  # accepts x when p(x) > q(x), never by chance
    return verify.verify_speculative(tree, probs, ChanceOnlyAboveOne(chance))


def verify_speculative_with_the_parents_q(tree, probs, chance):  # q read from the parent's row, not the guess's
    own_q = verify.guess_distribution
    with mock.patch.object(verify, "guess_distribution", lambda tree, node, like: own_q(tree, tree.parents[node], like)):
        return verify.verify_speculative(tree, probs, chance)


# ---- a7: Lookahead's trie ------------------------------------------------------------------------

class PruneTheMostFrequent(drafters.Trie):
    def prune(self, capacity):  # removes the most frequent node first, one at a time
        while self.node_count > capacity:
            nodes, stack = [], list(self.root.children.values())
            while stack:
                nodes.append(stack.pop())
                stack.extend(nodes[-1].children.values())
            self._remove(max(nodes, key=lambda node: node.prompt_count + node.output_count))
            self.node_count = self._descendants(self.root)


class CountsOneTokenTooFew(drafters.Trie):
    def add(self, tokens, new_from, *, first_start=0, from_prompt=False):  # sequences of depth - 1 tokens at most
        self.depth -= 1
        try:
            super().add(tokens, new_from, first_start=first_start, from_prompt=from_prompt)
        finally:
            self.depth += 1


class RetrievesRepeatedBranches(drafters.TrieDrafter):
    def retrieve(self):  # each context's branches appended, also those a longer context already gave
        branches, tokens = [], 0
        for length in self.PREFIX_LENGTHS:
            node = self.trie.find(self.history[-length:]) if length <= len(self.history) else None
            if node is not None:
                found = self.best_branches(node)
                branches += found
                tokens += sum(map(len, found))
            if tokens >= self.decoding_length:
                break
        return branches


class RetrievesPastTheDecodingLength(drafters.TrieDrafter):
    def retrieve(self):  # every matching context's branches, however many tokens the longer ones gave
        branches = []
        for length in self.PREFIX_LENGTHS:
            node = self.trie.find(self.history[-length:]) if length <= len(self.history) else None
            if node is not None:
                branches += [branch for branch in self.best_branches(node) if branch not in branches]
        return branches


class ShortestContextRetrievedFirst(drafters.TrieDrafter):
    PREFIX_LENGTHS = (1, 2, 3, 4)  # retrieval tries the shortest context first


class StopsAtTheLongestContext(drafters.TrieDrafter):
    def retrieve(self):  # one stage only: the longest matching context's branches, however few tokens they hold
        for length in self.PREFIX_LENGTHS:
            node = self.trie.find(self.history[-length:]) if length <= len(self.history) else None
            if node is not None:
                return self.best_branches(node)
        return []


# ---- a8: sparse trees from accuracies ------------------------------------------------------------

def best_sparse_tree_by_last_rank(accuracy, size, max_depth=None):  # a path's worth: its last step only
    every = tree.best_sparse_tree(accuracy, sum(len(a) for a in accuracy) ** len(accuracy), max_depth)
    chosen, candidates = [], [path for path in every if len(path) == 1]
    while candidates and len(chosen) < size:
        best = max(candidates, key=lambda path: accuracy[len(path) - 1][path[-1]])
        chosen.append(best)
        candidates = [path for path in candidates if path != best] + [p for p in every if p[:-1] == best]
    return chosen


def best_sparse_tree_one_level_too_deep(accuracy, size, max_depth=None):  # max_depth counted from 0, not 1
    return tree.best_sparse_tree(accuracy, size, None if max_depth is None else max_depth + 1)


def expected_accepted_counting_the_root(accuracy, spec):  # counts the root, which is no guess
    return 1 + tree.expected_accepted(accuracy, spec)


def path_probability_of_the_last_step(accuracy, path):  # the last rank's accuracy, not the whole chain's product
    return accuracy[len(path) - 1][path[-1]]


# ---- a9: the hardware-aware tree size --------------------------------------------------------------

def calibrate_for_the_most_guesses(model, method, tau_of_rows):  # the largest tau(n), whatever a pass costs
    _, table = calibrate.calibrate(model, method, tau_of_rows)
    return max(table, key=lambda entry: entry["tau"])["rows"], table


def calibrate_with_the_ratio_upside_down(model, method, tau_of_rows):  # tau(n) L(n) / L(1)
    _, table = calibrate.calibrate(model, method, tau_of_rows)
    table = [entry | {"predicted_speedup": entry["tau"] ** 2 / entry["predicted_speedup"]} for entry in table]
    return max(table, key=lambda entry: entry["predicted_speedup"])["rows"], table


def calibrate_without_dividing_by_l1(model, method, tau_of_rows):  # tau(n) / L(n): seconds, not a speedup
    _, table = calibrate.calibrate(model, method, tau_of_rows)
    one = calibrate.latencies(model, [1])[1]
    table = [entry | {"predicted_speedup": round(entry["predicted_speedup"] / one, 3)} for entry in table]
    return max(table, key=lambda entry: entry["predicted_speedup"])["rows"], table


def calibrate_with_the_smallest_tree_as_l1(model, method, tau_of_rows):  # L(1) never measured: L(ROWS[0]) instead
    measured = calibrate.latencies
    with mock.patch.object(calibrate, "latencies",
                           lambda model, sizes, **options: measured(model, sizes, **options) | {
                               1: measured(model, [calibrate.ROWS[0]], **options)[calibrate.ROWS[0]]}):
        return calibrate.calibrate(model, method, tau_of_rows)


# ---- a10: EAGLE-2's draft tree ----------------------------------------------------------------------

class ValueIsTheLastConfidence(eagle.DraftTree):  # a node's value: its own confidence, not its path's product
    def grow(self, expanded, children):
        added = super().grow(expanded, children)
        for node in added:
            self.values[node] = self.confidences[node]
        return added


class FrontierByTheLastConfidence(eagle.DraftTree):  # expands the most confident last steps
    def frontier(self, nodes, expand):
        return sorted(nodes, key=lambda node: (-self.confidences[node], node))[:expand]


class RerankDeeperFirstOnTies(eagle.DraftTree):  # on a tie the deeper node first: a child before its parent
    def best(self, size):
        ranked = sorted(range(1, len(self.tokens)), key=lambda node: (-self.values[node], -self.depths[node], node))
        return sorted(ranked[:size])


class RerankKeepsTheRoot(eagle.DraftTree):  # ranks the root among the guesses
    def best(self, size):
        return sorted(sorted(range(len(self.tokens)), key=lambda node: (-self.values[node], self.depths[node]))[:size])


MISTAKES = {
    "a1/rope-interleaved-pairs": Mistake("a1_llama", "apply_rotary", apply_rotary_interleaved,
                                         "x_i pairs with x_(i+E/2)"),
    "a1/gqa-heads-modulo": Mistake("a1_llama", "grouped_attention", grouped_attention_heads_modulo,
                                   "consecutive query heads share one"),
    "a1/rms-by-the-sum": Mistake("a1_llama", "rms_norm", rms_norm_by_the_sum, "x / sqrt(mean(x^2) + eps)"),
    "a1/eps-outside-the-root": Mistake("a1_llama", "rms_norm", rms_norm_eps_outside_the_root,
                                       "x / sqrt(mean(x^2) + eps)"),
    "a1/norm-in-bfloat16": Mistake("a1_llama", "rms_norm", rms_norm_in_the_inputs_dtype, "in at least float32"),
    "a1/rope-first-row-positions": Mistake("a1_llama", "rotary_cos_sin", rotary_cos_sin_of_the_first_row,
                                           "must turn by its own positions"),
    "a1/gqa-first-mask": Mistake("a1_llama", "grouped_attention", grouped_attention_with_the_first_mask,
                                 "must attend where mask["),
    "a1/gqa-no-mask-as-tril": Mistake("a1_llama", "grouped_attention", grouped_attention_none_as_tril,
                                      "mask None means attention allowed everywhere"),
    "a2/keep-without-packing": Mistake("a2_kv_cache", "KVCache", KeepWithoutPacking, "must hold the K/V written"),
    "a2/write-returns-only-the-new": Mistake("a2_kv_cache", "KVCache", WriteReturnsOnlyTheNew,
                                             "the layer's whole history"),
    "a2/write-at-the-end": Mistake("a2_kv_cache", "KVCache", WriteAtTheEnd, "must put k's first row in slot 4"),
    "a3/positions-by-index": Mistake("a3_tree_mask", "Tree", PositionsByIndex, "deep, so its position must be"),
    "a3/causal-mask": Mistake("a3_tree_mask", "Tree", CausalMask, "which is not its ancestor"),
    "a4/own-row": Mistake("a4_greedy_loop", "verify_greedy", verify_greedy_own_row,
                          "is not the model's choice after its parent"),
    "a4/first-right-child": Mistake("a4_greedy_loop", "longest_path", longest_path_first_right_child,
                                    "a deeper path of right guesses"),
    "a4/keep-without-packing": Mistake("a4_greedy_loop", "generate", generate_without_packing,
                                       "differs from vanilla greedy"),
    "a4/prefill-not-counted": Mistake("a4_greedy_loop", "generate", generate_without_counting_the_prefill,
                                      "the prefill too"),
    "a4/greedy-prefill": Mistake("a4_greedy_loop", "generate", generate_with_a_greedy_prefill,
                                 "not chosen greedily"),
    "a4/max-length-without-the-prompt": Mistake("a4_greedy_loop", "generate",
                                                generate_telling_the_drafter_the_new_tokens_only,
                                                "the text may grow to"),
    "a4/pass-without-its-seconds": Mistake("a4_greedy_loop", "generate", generate_recording_no_seconds,
                                           "Pass.seconds is the pass's measured time"),
    "a5/shortest-context": Mistake("a5_ngrams", "MultiLevelNGram", ShortestContextFirst,
                                   "the longest context seen before"),
    "a5/first-seen-wins-ties": Mistake("a5_ngrams", "MultiLevelNGram", FirstSeenWinsTies,
                                       "the one seen last among equally frequent"),
    "a6/accept-with-p": Mistake("a6_speculative_sampling", "verify_speculative", verify_speculative_accepting_with_p,
                                "min(1, p(x) / q(x))"),
    "a6/residual-is-p": Mistake("a6_speculative_sampling", "residual_after_rejection", residual_is_p,
                                "norm(max(0, p - q))"),
    "a6/residual-nan-when-p-equals-q": Mistake("a6_speculative_sampling", "residual_after_rejection",
                                               residual_without_a_guard, "is not a distribution"),
    "a7/prune-the-most-frequent": Mistake("a7_trie", "Trie", PruneTheMostFrequent, "the least frequent go first"),
    "a7/counts-one-token-too-few": Mistake("a7_trie", "Trie", CountsOneTokenTooFew, "each occurrence once"),
    "a7/shortest-context-first": Mistake("a7_trie", "TrieDrafter", ShortestContextRetrievedFirst,
                                         "that branch comes first"),
    "a7/retrieves-past-the-decoding-length": Mistake("a7_trie", "TrieDrafter", RetrievesPastTheDecodingLength,
                                                     "retrieval stops there"),
    "a7/repeated-branches": Mistake("a7_trie", "TrieDrafter", RetrievesRepeatedBranches, "more than once"),
    "a8/last-rank-only": Mistake("a8_sparse_trees", "best_sparse_tree", best_sparse_tree_by_last_rank,
                                 "the best tree of"),
    "a9/most-guesses": Mistake("a9_capstone", "calibrate", calibrate_for_the_most_guesses,
                               "the largest tau(n) L(1) / L(n)"),
    "a9/ratio-upside-down": Mistake("a9_capstone", "calibrate", calibrate_with_the_ratio_upside_down,
                                    "predicted speedup tau(n) L(1) / L(n)"),
    "a8/one-level-too-deep": Mistake("a8_sparse_trees", "best_sparse_tree", best_sparse_tree_one_level_too_deep,
                                     "no node deeper than"),
    "a2/keep-keys-only": Mistake("a2_kv_cache", "KVCache", KeepKeysOnly, "the values move with the keys"),
    "a3/positions-from-one": Mistake("a3_tree_mask", "Tree", PositionsFromOne, "deep, so its position must be"),
    "a3/descendant-mask": Mistake("a3_tree_mask", "Tree", DescendantMask, "which is not its ancestor"),
    "a5/levels-one-short": Mistake("a5_ngrams", "MultiLevelNGram", LevelsOneShort, "the longest context seen before"),
    "a5/context-from-the-start": Mistake("a5_ngrams", "MultiLevelNGram", ContextFromTheStart, "no end of the query was seen"),
    "a6/siblings-against-p": Mistake("a6_speculative_sampling", "verify_speculative",
                                     verify_speculative_siblings_against_p, "distribution is not the model's"),
    "a6/accept-only-when-p-above-q": Mistake("a6_speculative_sampling", "verify_speculative",
                                             verify_speculative_accepting_only_above_one,
                                             "so every pass yields its 2 guesses"),
    "a6/the-parents-q": Mistake("a6_speculative_sampling", "verify_speculative", verify_speculative_with_the_parents_q,
                                "accepts a guess with probability nan"),
    "a7/stops-at-the-longest-context": Mistake("a7_trie", "TrieDrafter", StopsAtTheLongestContext, "then shorter ones"),
    "a8/path-probability-of-the-last-step": Mistake("a8_sparse_trees", "path_probability",
                                                    path_probability_of_the_last_step, "is accepted with"),
    "a9/speedup-not-divided-by-l1": Mistake("a9_capstone", "calibrate", calibrate_without_dividing_by_l1, "the predicted speedup tau(n) L(1) / L(n) is"),
    "a9/smallest-tree-as-l1": Mistake("a9_capstone", "calibrate", calibrate_with_the_smallest_tree_as_l1, "the predicted speedup tau(n) L(1) / L(n) is"),
    "a8/root-counted": Mistake("a8_sparse_trees", "expected_accepted", expected_accepted_counting_the_root,
                               "the root is no guess"),
    "a10/value-is-the-last-confidence": Mistake("a10_eagle_trees", "DraftTree", ValueIsTheLastConfidence,
                                                "is the product of the confidences on its path"),
    "a10/frontier-by-the-last-confidence": Mistake("a10_eagle_trees", "DraftTree", FrontierByTheLastConfidence,
                                                   "not its last confidence"),
    "a10/rerank-deeper-first-on-ties": Mistake("a10_eagle_trees", "DraftTree", RerankDeeperFirstOnTies,
                                               "the shallower node goes first"),
    "a10/rerank-keeps-the-root": Mistake("a10_eagle_trees", "DraftTree", RerankKeepsTheRoot, "the root, is"),
}
