"""Drafters: where the guesses come from. Each one proposes a candidate tree rooted at the last
chosen token; decode.py scores it in one forward pass, verifies it and tells the drafter what came of it.

    drafter.begin(request)              # a new request: its prompt, sampling settings, random generator
    drafter.prefill_tree(prompt_ids)    # what the prefill scores: the prompt as a chain (PPD hangs its
                                        # soft tokens on the last prompt token)
    drafter.propose() -> Tree           # guesses after history[-1] (the root)
    drafter.after_pass(done: Pass)      # what a pass made: its tree, verdict and new tokens, and the
                                        # last accepted node's hidden state and extra inputs' logits

- `Drafter` itself proposes nothing: that is vanilla decoding.
- `NGramDrafter`: ANPD (Ou et al. 2024, "Lossless Acceleration of Large Language Model via Adaptive
  N-gram Parallel Decoding"): a multi-level n-gram table (section 3.2, Algorithm 2) built from the
  prompt and updated with every accepted token (section 3.1; A.8 "Runtime Update"), drafting a chain
  of K tokens (Algorithm 1, lines 11-16). Defaults N=5, K=7 (section 4.4).
- `DraftModelDrafter`: speculative decoding (Leviathan et al. 2023, Algorithm 1; Chen et al. 2023,
  Algorithm 2): a small draft model samples a chain of gamma tokens; the built-in one, the model's
  own first layers, reads their K/V from the loop's cache (LayerSkip, Elhoushi et al. 2024, section 4.2).
- `TrieDrafter`: Lookahead (Zhao et al. 2023, "Lookahead: An Inference Acceleration Framework for
  Large Language Model with Lossless Generation Accuracy"): a trie of token sequences from the prompt
  and from generated output (section 4.3.1), queried with multi-stage retrieval (section 4.3.2) for a
  multi-branch draft, hierarchical or parallel (section 4.2). The trie outlives requests. (Not Fu et
  al.'s Jacobi-iteration "Lookahead decoding", which is another method.)
- `TopKDrafter`: the shared base of the learned guessers, whose guesses are the top-ranked tokens of
  logits computed in the previous pass: Medusa heads (medusa.py) and PPD soft tokens (ppd.py).
"""

import dataclasses
import heapq
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from errors import UserError
from kv_cache import KVCache
from model import Llama
from sampling import Sampling, choose_token_and_probs
from tree import Evidence, Tree, Verdict


@dataclass
class Request:
    """What a drafter is told when a generation starts."""
    prompt_ids: Sequence[int]
    sampling: Sampling = Sampling()  # how the target chooses tokens (a draft model samples alike)
    generator: torch.Generator | None = None  # the generation's random numbers
    max_length: int | None = None  # prompt + the most new tokens (None: the model's context)
    cache: KVCache | None = None  # the loop's cache, holding the model's K/V of all the history but the root


@dataclass
class Pass:
    """One forward pass of the decoding loop, as the drafter (and a watcher) is told of it."""
    tree: Tree  # the tree it scored (the prefill's: the prompt as a chain)
    cache_length: int  # tokens cached before it: node i sat at position cache_length + depth(i)
    path: list[int]  # the nodes whose K/V stay: the accepted path (the prefill's: every prompt token)
    emitted: list[int]  # the tokens it added to the answer (the stop rule can cut a verdict's)
    hidden: torch.Tensor  # [N + S, D] final hidden states of its inputs (nodes, then extra inputs)
    logits: torch.Tensor  # [R, V]: logits of its inputs from row `logits_start` on
    verdict: Verdict | None = None  # what the verifier accepted; None for the prefill, which verifies nothing
    logits_start: int = 0  # (the prefill projects only its last token and the extra inputs)
    seconds: float = 0.0  # its wall-clock time: forward pass, logits, verification, keep (what L(n) is)

    @property
    def guesses_proposed(self) -> int:
        return self.verdict.proposed if self.verdict else 0

    @property
    def guesses_kept(self) -> int:
        """Accepted guesses that reached the answer."""
        return min(self.verdict.accepted_guesses, len(self.emitted)) if self.verdict else 0

    @property
    def rejected(self) -> bool:
        return bool(self.verdict and self.verdict.rejected)

    @property
    def bonus_emitted(self) -> bool:
        """Whether the bonus token reached the answer (the stop rule can end it among the guesses)."""
        return len(self.emitted) > self.guesses_kept

    @property
    def choices(self) -> list[int]:
        """Per node, the model's most likely next token there (its greedy choice)."""
        return self.logits[:len(self.tree) - self.logits_start].argmax(dim=-1).tolist()

    def last_hidden(self) -> torch.Tensor:
        """[D]: the final hidden state of the last accepted node (Medusa's heads read it)."""
        return self.hidden[self.path[-1]]

    def last_extra_logits(self) -> torch.Tensor:
        """[S', V]: the logits of the extra inputs hung on the last accepted node, in row order (PPD's
        soft tokens guess from them)."""
        rows = [row - self.logits_start for row in self.tree.extra_rows(self.path[-1])]
        if rows and rows[-1] - rows[0] == len(rows) - 1:  # consecutive, as PPD lays them out: a slice
            return self.logits[rows[0]:rows[-1] + 1]  # (indexing by a list copies it to the GPU first)
        return self.logits[rows]

    def outcomes(self) -> list[str]:
        """Per node: "accepted" (on the path; the root always is), "rejected" (its parent is on the
        path but the walk did not go on to it) or "unreached" (an ancestor was rejected)."""
        on_path = set(self.path)
        return ["accepted" if node in on_path else "rejected" if parent in on_path else "unreached"
                for node, parent in enumerate(self.tree.parents)]


class Drafter:
    """The empty drafter: the tree is the root alone, so every pass yields one token (vanilla)."""

    max_extra_inputs = 0  # the most inputs a pass holds besides the root: guesses and extra inputs (sizes the KV cache)
    predicted_tokens_per_pass = None  # tau, when the drafter can predict it (learned guessers)

    def begin(self, request: Request) -> None:
        self.history = list(request.prompt_ids)

    def prefill_tree(self, prompt_ids: Sequence[int]) -> Tree:
        """The prompt as a chain: each token sees the ones before it (the plain causal pass)."""
        return Tree.chain(prompt_ids[0], prompt_ids[1:])

    def propose(self) -> Tree:
        return Tree.chain(self.history[-1], [])

    def after_pass(self, done: Pass) -> None:
        self.history.extend(done.emitted)


# ---- ANPD: multi-level n-grams -------------------------------------------------------------------

class MultiLevelNGram:
    """Levels n = 2..N: for every context of 1..N-1 tokens, the next tokens seen after it and how
    often. A query tries the longest context first (Algorithm 2, as its text describes; the
    pseudocode's loop would let the shortest level win) and answers the most frequent next token,
    the most recent one among equally frequent ones."""

    def __init__(self, n: int):
        self.n = n
        self.counts: dict[tuple, dict[int, int]] = {}  # context -> {next token: times seen}
        self.best: dict[tuple, int] = {}  # context -> its most frequent next token

    def add(self, tokens: Sequence[int], end: int) -> None:
        """Record tokens[end] as the continuation of each context of 1..N-1 tokens ending before it."""
        following = tokens[end]
        for length in range(1, min(self.n - 1, end) + 1):
            context = tuple(tokens[end - length:end])
            counts = self.counts.setdefault(context, {})
            counts[following] = counts.get(following, 0) + 1
            if counts[following] >= counts.get(self.best.get(context), 0):
                self.best[context] = following

    def query(self, tokens: Sequence[int]) -> int | None:
        """The predicted token after `tokens`, or None when no level has seen its context."""
        for length in range(min(self.n - 1, len(tokens)), 0, -1):
            prediction = self.best.get(tuple(tokens[-length:]))
            if prediction is not None:
                return prediction
        return None

    def support(self, tokens: Sequence[int], following: int) -> tuple[int, int]:
        """How strongly the table backs `following` after `tokens`: the longest context length that saw
        it next, and how often (the evidence cost-aware drafting files the guess under)."""
        for length in range(min(self.n - 1, len(tokens)), 0, -1):
            seen = self.counts.get(tuple(tokens[-length:]), {}).get(following)
            if seen:
                return length, seen
        return 0, 0


class NGramDrafter(Drafter):
    """ANPD: a chain of up to K tokens, each the n-gram prediction after the previous ones."""

    DEFAULT_N, DEFAULT_K = 5, 7  # section 4.4
    MAX_N, MAX_K = 32, 128

    def __init__(self, n: int = DEFAULT_N, k: int = DEFAULT_K):
        if not 2 <= n <= self.MAX_N:
            raise UserError(f"the n-gram order N must be in 2..{self.MAX_N}, got {n}")
        if not 1 <= k <= self.MAX_K:
            raise UserError(f"the draft length K must be in 1..{self.MAX_K}, got {k}")
        self.n, self.k = n, k
        self.max_extra_inputs = k

    def begin(self, request):
        self.ngrams = MultiLevelNGram(self.n)  # initialised from the prompt (section 3.1)
        self.history = []
        self.learn(request.prompt_ids)

    def after_pass(self, done):
        self.learn(done.emitted)

    def learn(self, tokens):
        for token in tokens:  # runtime update (A.8): every accepted token joins the statistics
            self.history.append(token)
            self.ngrams.add(self.history, len(self.history) - 1)

    def propose(self):
        context = self.history[-(self.n - 1):]
        draft, evidence = [], []
        while len(draft) < self.k:
            guess = self.ngrams.query(context)
            if guess is None:
                break  # no level knows this context: a shorter draft beats a blind guess
            draft.append(guess)
            evidence.append((ngram_evidence(*self.ngrams.support(context, guess)),))
            context = (context + [guess])[-(self.n - 1):]
        return Tree.chain(self.history[-1], draft, evidence=evidence)


# Acceptance rates per evidence key, cost-aware drafting's priors (measured: docs/constants.md).
NGRAM_PRIORS = {  # (context length of the match, up to 4; times seen, up to 3) -> P(accepted)
    (1, 1): 0.21, (1, 2): 0.26, (1, 3): 0.37, (2, 1): 0.41, (2, 2): 0.61, (2, 3): 0.65,
    (3, 1): 0.58, (3, 2): 0.75, (3, 3): 0.79, (4, 1): 0.83, (4, 2): 0.81, (4, 3): 0.77}
TRIE_PRIORS = {  # (context length of the match, up to 4; share of the siblings' occurrences, in quarters)
    (1, 0): 0.06, (1, 1): 0.15, (1, 2): 0.21, (1, 3): 0.46,
    (2, 0): 0.06, (2, 1): 0.10, (2, 2): 0.26, (2, 3): 0.72,
    (3, 0): 0.06, (3, 1): 0.10, (3, 2): 0.26, (3, 3): 0.79,
    (4, 0): 0.06, (4, 1): 0.10, (4, 2): 0.21, (4, 3): 0.92}


def ngram_evidence(level: int, seen: int) -> Evidence:
    """The evidence of an n-gram guess whose context of `level` tokens was followed by it `seen`
    times. Its prior is the acceptance rate measured for such guesses (docs/constants.md); a
    generation's own outcomes soon outweigh it."""
    level, seen = min(level, 4), min(seen, 3)
    return Evidence(("anpd", level, seen), NGRAM_PRIORS.get((level, seen), 0.3))


# ---- speculative decoding with a draft model --------------------------------------------------

def first_layers(model, count: int) -> Llama:
    """A draft model for self-speculative decoding: `model`'s embedding, its first `count` layers, then
    its final norm and LM head (the same tensors, nothing copied). An early exit in the spirit of Draft &
    Verify (Zhang et al. 2024) and LayerSkip (Elhoushi et al. 2024), without their training: the shallow
    hidden state is read by a head trained on the last. Its layers' K/V of a text are the model's own,
    so it reads them from the model's cache (`FirstLayers`)."""
    if not 1 <= count < model.config.num_layers:
        raise UserError(f"a draft needs between 1 and {model.config.num_layers - 1} of the model's "
                        f"{model.config.num_layers} layers, got {count}")
    with torch.device("meta"):
        draft = Llama(dataclasses.replace(model.config, num_layers=count))
    draft.embed, draft.norm, draft.lm_head = model.embed, model.norm, model.lm_head
    draft.layers = torch.nn.ModuleList(model.layers[:count])
    draft.inv_freq = model.inv_freq
    draft.early_exit = True  # its layers are `model`'s first ones: it shares the loop's cache
    return draft.eval()


def logits_after(model, tokens: list[int], cache: KVCache) -> torch.Tensor:
    """Feed `tokens`, which follow what `cache` holds (positions cache.length onwards, causal
    attention), into the cache; return the logits [V] after the last of them: a draft model's step."""
    slots = cache.claim(len(tokens))
    positions = torch.arange(slots.start, slots.stop, device=model.device)
    hidden = model.hidden_states(torch.tensor([tokens], device=model.device), positions=positions,
                                 cache=cache, slots=slots)
    return model.logits(hidden[0, -1])


class FirstLayers(KVCache):
    """The first `count` layers of the decoding loop's `cache`, read and written in place: the cache of
    a draft made of the model's own first layers (`first_layers`). The model's passes already
    wrote those layers' K/V for every token the draft would read (same weights, same tokens, same
    positions), so the draft reads none of the history itself: self-drafting and verifying share one
    cache, as in LayerSkip (Elhoushi et al. 2024, section 4.2, "Reusing the Cache").

    Its length is its own: `follow()` sets it to the loop's before the draft reads the root and its own
    guesses, whose K/V go to the slots after the history, the ones the model's next pass claims and
    overwrites. The loop's cache may move its K/V to another buffer (backends/cuda_graphs.py adopts it), so the
    layers are looked up at every use, never held; and the cache itself is held weakly, since a drafter
    outlives its generation and the cache should not (a graphed model's buffer serves one live cache)."""

    def __init__(self, cache: KVCache, count: int):
        if not 1 <= count <= cache.keys.shape[0]:
            raise ValueError(f"a cache of {cache.keys.shape[0]} layers has no first {count}")
        self.loop, self.count = weakref.ref(cache), count
        self.capacity = cache.capacity
        self.length = cache.length

    @property
    def keys(self):  # [count, B, K, capacity, E]: a view, writes go to the loop's cache
        return self.loop().keys[:self.count]

    @property
    def values(self):
        return self.loop().values[:self.count]

    def follow(self) -> None:
        """Forget the draft's guesses: what attention reads is the loop's history again."""
        self.length = self.loop().length


class DraftModelDrafter(Drafter):
    """A chain of `gamma` tokens decoded by a smaller model with the same vocabulary: sampled from
    its own distribution q (shaped by the same temperature / top-k / top-p as the target's p, and
    handed to the verifier with the tree), or its argmax when decoding greedily.

    A separate draft model keeps its own KV cache. After verification it keeps the K/V of the longest
    prefix of its guesses that was accepted and reads the rest (the bonus token, or the last guess it
    never read) at the start of the next proposal: rollback is just moving the cache's length back.
    Over passes that guess nothing it reads nothing, and catches up on them at its next proposal.

    A draft made of the model's own first layers (`first_layers`) keeps no cache: the loop's
    holds those layers' K/V of the whole history already (`FirstLayers`), so each proposal
    reads only the root and its own guesses, and a pass that guesses nothing costs it nothing.

    With `costs` (cost-aware drafting, cost_aware.Costs) every guess costs a draft step before it can
    be cut, so each proposal first asks how many guesses pay (Costs.draft_length).
    """

    DEFAULT_GAMMA = 4  # Chen et al. 2023 draft K = 4 tokens per step (Leviathan et al. try 3-10)
    MAX_GAMMA = 64
    # how often the built-in self-draft (the first 4 of 30 layers, untrained) is right on held-out prompts
    # (`bench.py acceptance --methods speculative-fixed`): cost-aware drafting's prior, so that its first
    # passes are not drafted into near-certain misses before its verdicts arrive
    SELF_DRAFT_ALPHA = 0.045
    UNKNOWN_DRAFT_ALPHA = 0.5  # any other draft's, until its verdicts say more

    def __init__(self, model, gamma: int = DEFAULT_GAMMA, step_cost: float = 0.0, costs=None,
                 prior_alpha: float = UNKNOWN_DRAFT_ALPHA):
        if not 1 <= gamma <= self.MAX_GAMMA:
            raise UserError(f"gamma (draft tokens per step) must be in 1..{self.MAX_GAMMA}, got {gamma}")
        self.model, self.gamma = model, gamma
        self.step_cost = step_cost  # a draft step's cost over a pass of the target over one token (c)
        self.costs = costs
        self.prior_alpha = prior_alpha  # its acceptance rate as known before a generation's verdicts
        self.max_extra_inputs = gamma

    def begin(self, request):
        super().begin(request)
        self.sampling, self.generator = request.sampling, request.generator
        if getattr(self.model, "early_exit", False) and request.cache is not None:
            self.cache = FirstLayers(request.cache, self.model.config.num_layers)
        else:
            length = request.max_length or self.model.config.max_positions
            self.cache = KVCache.for_model(self.model, capacity=length + self.gamma)
        self.read_guesses = []  # guesses the draft read while drafting: their K/V follow history

    def after_pass(self, done):
        if isinstance(self.cache, FirstLayers):  # the pass wrote over its guesses' slots: propose() follows the loop
            return super().after_pass(done)
        # its own cache holds history, then read_guesses; keep what the accepted tokens agree with, but
        # never the last token: the next proposal needs the logits after it, so it reads it again
        tokens, agreed = done.emitted, 0
        while agreed < min(len(tokens) - 1, len(self.read_guesses)) and tokens[agreed] == self.read_guesses[agreed]:
            agreed += 1
        # (before the first proposal the cache is still empty: min keeps it so)
        self.cache.truncate(min(self.cache.length, len(self.history) + agreed))
        self.read_guesses = []
        super().after_pass(done)

    def propose(self):
        gamma = self.gamma if self.costs is None else self.costs.draft_length(self.step_cost, self.gamma, self.prior_alpha)
        if gamma == 0:
            return Tree.chain(self.history[-1], [])
        if isinstance(self.cache, FirstLayers):
            self.cache.follow()  # the history but the root, as the loop's pass kept it
        unread = self.history[self.cache.length:]  # at least the root; with its own cache, the whole prompt at first
        guesses, guess_probs, evidence = [], [], []
        for _ in range(gamma):
            logits = logits_after(self.model, unread, self.cache)
            token, q = choose_token_and_probs(logits, self.sampling, self.generator)  # q: None if greedy
            guesses.append(token)
            guess_probs.append(q)
            # how sure the draft was *before* drawing: with sampling, a cut that depended on the drawn
            # token would bias the output (cost_aware.py)
            confidence = float((q if q is not None else torch.softmax(logits.float(), -1)).max())
            evidence.append((draft_evidence(confidence),))
            unread = [token]
        self.read_guesses = guesses[:-1]  # the last guess is never read: it has no successor
        draft_probs = None if self.sampling.greedy else torch.stack(guess_probs)  # [gamma, V]
        return Tree.chain(self.history[-1], guesses, draft_probs, evidence)


# ---- learned guessers: the top-k of logits from the previous pass ------------------------------

TOP_RANKS = 10  # candidates kept per distance; sparse trees rank them 0..9 (accuracy tables too)


class TopKDrafter(Drafter):
    """A drafter whose guesses are the top-ranked tokens of per-distance logits computed in the
    previous pass: candidates[d] ranks guesses for the token d+1 places after the root."""

    def begin(self, request):
        super().begin(request)
        self.candidates: list[list[int]] = []

    def keep_top(self, logits: torch.Tensor) -> None:
        """logits [distances, V] -> the TOP_RANKS best tokens per distance (none for no rows)."""
        self.candidates = logits.topk(min(TOP_RANKS, logits.shape[-1]), dim=-1).indices.tolist()


# ---- Lookahead: a trie of token sequences --------------------------------------------------------

class TrieNode:
    __slots__ = ("token", "parent", "children", "prompt_count", "output_count")

    def __init__(self, token, parent):
        self.token, self.parent = token, parent
        self.children: dict[int, TrieNode] = {}
        self.prompt_count = 0  # occurrences of this node's token sequence in the current prompt
        self.output_count = 0  # occurrences in generated output, over all requests so far


class Trie:
    """Every token sequence of up to `depth` tokens seen in the text, with how often it occurred.

    A node stands for the sequence on its root path, so counts shrink (or stay) going down.
    Prompt occurrences are kept apart so they can be boosted while their request runs and then
    eliminated (section 4.3.1); output occurrences stay for later requests, up to `capacity` nodes.
    """

    def __init__(self, depth: int):
        self.depth = depth
        self.root = TrieNode(None, None)
        self.node_count = 0
        self.prompt_nodes: list[TrieNode] = []  # nodes the current prompt counted in

    def add(self, tokens: Sequence[int], new_from: int, *, first_start: int = 0,
            from_prompt: bool = False) -> None:
        """Count the occurrences that end at each of tokens[new_from:], among the sequences that
        start at or after `first_start` (branch inserting, done token by token)."""
        for end in range(max(new_from, first_start), len(tokens)):
            for start in range(max(first_start, end - self.depth + 1), end + 1):
                node = self.find(tokens[start:end], create=True)
                node = self._child(node, tokens[end])
                if from_prompt:
                    if node.prompt_count == 0:
                        self.prompt_nodes.append(node)
                    node.prompt_count += 1
                else:
                    node.output_count += 1

    def find(self, sequence: Sequence[int], create: bool = False) -> TrieNode | None:
        node = self.root
        for token in sequence:
            child = node.children.get(token)
            if child is None:
                if not create:
                    return None
                child = self._child(node, token)
            node = child
        return node

    def _child(self, node: TrieNode, token: int) -> TrieNode:
        child = node.children.get(token)
        if child is None:
            child = node.children[token] = TrieNode(token, node)
            self.node_count += 1
        return child

    def eliminate_prompt(self) -> None:
        """Forget the last prompt's occurrences (branch eliminating, once its request is over)."""
        for node in self.prompt_nodes:
            node.prompt_count = 0
            if node.output_count == 0:  # its whole subtree has no output occurrences either
                self._remove(node)
        self.prompt_nodes = []
        self.node_count = self._descendants(self.root)

    def prune(self, capacity: int) -> None:
        """Remove the least frequent nodes until at most `capacity` remain (node pruning). Sorting by
        (count, deeper first) removes children before their parents, so each removal is a leaf."""
        nodes = []  # (count, -depth, order, node)
        stack = [(child, 1) for child in self.root.children.values()]
        while stack:
            node, depth = stack.pop()
            nodes.append((node.output_count + node.prompt_count, -depth, len(nodes), node))
            stack.extend((child, depth + 1) for child in node.children.values())
        excess = len(nodes) - capacity
        for *_, node in sorted(nodes)[:max(excess, 0)]:
            self._remove(node)
        self.node_count = self._descendants(self.root)

    @staticmethod
    def _remove(node: TrieNode) -> None:
        node.parent.children.pop(node.token, None)

    def _descendants(self, node: TrieNode) -> int:
        return sum(1 + self._descendants(child) for child in node.children.values())


class TrieDrafter(Drafter):
    """Lookahead: branches retrieved from a trie that lives as long as the drafter (the process),
    so earlier requests' output warms it up for later ones."""

    PREFIX_LENGTHS = (4, 3, 2, 1)  # multi-stage retrieval tries the longest context match first
    PROMPT_BOOST = 10  # prompt occurrences outweigh output ones while their request runs (4.3.2)
    CAPACITY_PER_DRAFT_TOKEN = 16  # trie nodes kept between requests: 16x the decoding length (Table 6)

    # smaller than the paper's (up to 64 on an A100) because a CPU pass over more costs more (docs/constants.md)
    DEFAULT_DECODING_LENGTH, DEFAULT_BRANCH_LENGTH = 8, 8
    MAX_DECODING_LENGTH, MAX_BRANCH_LENGTH = 256, 64

    def __init__(self, decoding_length: int = DEFAULT_DECODING_LENGTH,
                 branch_length: int = DEFAULT_BRANCH_LENGTH, hierarchical: bool = True):
        if not 1 <= decoding_length <= self.MAX_DECODING_LENGTH:
            raise UserError(f"the decoding length must be in 1..{self.MAX_DECODING_LENGTH} draft tokens, "
                            f"got {decoding_length}")
        if not 1 <= branch_length <= self.MAX_BRANCH_LENGTH:
            raise UserError(f"the branch length must be in 1..{self.MAX_BRANCH_LENGTH} tokens, got {branch_length}")
        self.decoding_length, self.branch_length = decoding_length, branch_length
        self.hierarchical = hierarchical
        self.max_extra_inputs = decoding_length
        self.trie = Trie(depth=max(self.PREFIX_LENGTHS) + branch_length)

    def begin(self, request):
        # the last request's prompt is forgotten (branch eliminating) and the trie kept to its
        # capacity (node pruning) before this one's prompt is added
        self.trie.eliminate_prompt()
        self.trie.prune(self.CAPACITY_PER_DRAFT_TOKEN * self.decoding_length)
        super().begin(request)
        self.prompt_length = len(self.history)
        self.trie.add(self.history, 0, from_prompt=True)

    def after_pass(self, done):
        new_from = len(self.history)
        super().after_pass(done)
        self.trie.add(self.history, new_from, first_start=self.prompt_length)

    def propose(self):
        branches = self.retrieve()
        return Tree.from_branches(self.history[-1], branches, self.decoding_length, merge=self.hierarchical,
                                  evidence=[self.branch_evidence(branch) for branch in branches])

    def retrieve(self) -> list[list[int]]:
        """Multi-stage retrieval: the branches after the longest matching context first; while they
        hold fewer tokens than the decoding length, add those after a shorter context."""
        branches, seen, tokens = [], set(), 0
        for length in self.PREFIX_LENGTHS:
            node = self.trie.find(self.history[-length:]) if length <= len(self.history) else None
            if node is None:
                continue
            for branch in self.best_branches(node):
                if tuple(branch) not in seen:
                    seen.add(tuple(branch))
                    branches.append(branch)
                    tokens += len(branch)
            if tokens >= self.decoding_length:
                break
        return branches

    def branch_evidence(self, branch: Sequence[int]) -> list[tuple[Evidence, ...]]:
        """Per token of a retrieved branch, its evidence (key, prior): after the longest context the
        branch continues in the trie, that context's length and each token's share of its siblings'
        occurrences (in quarters)."""
        for length in self.PREFIX_LENGTHS:
            node = self.trie.find(self.history[-length:]) if length <= len(self.history) else None
            if node is not None and branch and branch[0] in node.children:
                break
        else:
            return [()] * len(branch)
        evidence = []
        for token in branch:
            child = node.children.get(token)
            if child is None:  # (a retrieve that strays from the trie: no evidence for the rest)
                return evidence + [()] * (len(branch) - len(evidence))
            share = self.score(child) / sum(self.score(c) for c in node.children.values())
            evidence.append((trie_evidence(length, share),))
            node = child
        return evidence

    def score(self, node: TrieNode) -> int:
        """A node's weight in retrieval: its occurrences, the current prompt's boosted (4.3.2)."""
        return self.PROMPT_BOOST * node.prompt_count + node.output_count

    def best_branches(self, start: TrieNode) -> list[list[int]]:
        """The `decoding_length` most frequent nodes below `start` (at most `branch_length` deep),
        picked best-first so they form a connected subtree, returned as its root-to-leaf branches,
        more frequent children first."""
        score = self.score
        frontier = [(-score(c), i, c, 1) for i, c in enumerate(start.children.values())]
        heapq.heapify(frontier)
        chosen, order = set(), len(frontier)
        while frontier and len(chosen) < self.decoding_length:
            _, _, node, depth = heapq.heappop(frontier)
            chosen.add(node)
            if depth < self.branch_length:
                for child in node.children.values():
                    heapq.heappush(frontier, (-score(child), order, child, depth + 1))
                    order += 1

        branches = []

        def walk(node, prefix):
            picked = sorted((c for c in node.children.values() if c in chosen), key=score, reverse=True)
            if not picked and prefix:
                branches.append(prefix)
            for child in picked:
                walk(child, prefix + [child.token])

        walk(start, [])
        return branches


def trie_evidence(context: int, share: float) -> Evidence:
    """The evidence of a trie guess in a branch found after `context` tokens of the output matched
    (multi-stage retrieval, section 4.3: the longer the match, the likelier the branch), that took
    `share` of its siblings' occurrences (priors: docs/constants.md)."""
    quarter = min(int(share * 4), 3)
    return Evidence(("lookahead", context, quarter), TRIE_PRIORS.get((context, quarter), 0.3))


def draft_evidence(confidence: float) -> Evidence:
    """The evidence of a draft model's guess made where its most likely token had probability
    `confidence` (in tenths): its own estimate, as cost-aware drafting's prior."""
    return Evidence(("speculative", min(int(confidence * 10), 9)), confidence)
