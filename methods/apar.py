"""APAR: auto-parallel auto-regressive decoding (Liu et al. 2024), the forking engine.

    python decode.py --method apar --prompt "Give me five tips for learning a language."
    python decode.py --method apar --apar-guesses anpd --prompt "Give me five tips for learning a language."

APAR changes the model: fine-tuned on paragraph trees (apar_finetune.py, train_prompt.py apar), it writes
[Fork] after the first words of a point whose details could be written independently. The engine
(Algorithm 1, section 2.3) then runs one *generation thread* per open paragraph, all in ONE forward
pass per step:

    group = {root thread}                           # a sequence group: one prompt, one paragraph tree
    while a thread is unfinished:
        feed every live thread's last token         # one pass; a token sees only its own ancestors
        for each live thread s:
            x = sample(s's logits)
            if s's last token was [Fork]:           # fork(): s' shares s's prefix in the cache
                s' = s + [Child]                    # the child writes the detail of the point
                s's paragraph gets first_child = s'.paragraph, next_sibling = s.paragraph (new)
            s.append(x)                             # s itself goes on with the next point
            if x is EOS: s finishes; the cache slots only s used are released
    answer = RESTORE(root)                          # root - first child - next sibling

The output is therefore *not* the base model's. What holds exactly is the attention semantics: a
thread's logits are those of its own sequence (prompt, the paragraphs it descends from, its own
tokens) run alone through the model (tests/test_apar.py checks this in float64).

Cache: a pool of slots (SlotCache). Every token fed takes a free slot; a fork copies nothing (the
child's slot list starts as the parent's: prefix sharing, as with paged attention); a finished thread
gives back the slots no live thread attends to. So the peak of slots in use is APAR's "max cached
tokens" (section 3.4, Table 1), compared with the flattened answer decoded auto-regressively.

Control tokens: the default model's tokenizer has no spare ids, so two special tokens the chat model
never writes stand in for [Fork] and [Child] (FORK_TOKEN, CHILD_TOKEN). Their embedding rows (tied to
the LM head) are retrained with the adapter; the vocabulary does not grow.

APAR + a guesser (section 3.2's Medusa-APAR, here with ANPD's n-grams or Lookahead's trie, which need
no training): every thread has a drafter of its own, fed its own sequence, and in the same one pass
each thread's pending token is the root of its own candidate tree. Every row sees its thread's slots
and its ancestors in its own tree; each thread's tree is verified on its own (verify.py, greedy or
exact speculative sampling), so a thread writes what it would write without guesses (greedy: the
same tokens; sampling: the same distribution), in fewer passes.
Threads accept different numbers of guesses: the paper pads them to the longest and masks the rest
(appendix C.1); here each thread simply keeps the slots of its accepted path and gives the others
back, so nothing is padded. A [Fork] among the accepted guesses forks there.

Read in this order: `AparEngine` and `generate_apar` (Algorithm 1), `step` (one pass for every live
thread), `advance` (a thread's verdict: fork, append, keep its accepted slots), `Thread.fork`,
`finish_if_done` (RELEASECACHE), `SlotCache`, `restore`. The fine-tuning that makes the model fork
(data rules, the adapter, the loss) is apar_finetune.py.
"""

import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import accumulate

import torch

from methods import artifacts
from drafters import Drafter, Pass, Request
from errors import UserError
from kv_cache import KVCache
from decode import Counts, Meter, require_finite, room_for_new_tokens
from model import causal_mask
from sampling import Sampling
from tree import Tree, Verdict
from verify import verify

FORK_TOKEN = "<jupyter_script>"  # [Fork]
CHILD_TOKEN = "<empty_output>"  # [Child]


@dataclass(frozen=True)
class ControlTokens:
    fork: int
    child: int

    @classmethod
    def of(cls, tokenizer) -> "ControlTokens":
        ids = [tokenizer.token_id(name) for name in (FORK_TOKEN, CHILD_TOKEN)]
        if None in ids:
            raise UserError(f"this tokenizer has no {FORK_TOKEN} / {CHILD_TOKEN} tokens, which APAR uses as "
                            "[Fork] / [Child]; train an adapter for it with python train_prompt.py apar")
        return cls(*ids)


# ---- the paragraph tree -------------------------------------------------------------------------

@dataclass(eq=False)
class Paragraph:
    """A paragraph node: the tokens one thread wrote between two forks (Algorithm 1's PNODE)."""
    tokens: list[int] = field(default_factory=list)
    first_child: "Paragraph | None" = None  # the detail written by the thread forked at its end
    next_sibling: "Paragraph | None" = None  # what its own thread wrote after the fork


def restore(root: Paragraph) -> list[int]:
    """RESTORE: every paragraph's tokens in root - first child - next sibling order (depth first)."""
    tokens, stack = [], [root]
    while stack:
        node = stack.pop()
        tokens += node.tokens
        stack += [n for n in (node.next_sibling, node.first_child) if n is not None]  # child pops first
    return tokens


# ---- the cache: a pool of slots -----------------------------------------------------------------

class SlotCache(KVCache):
    """A KV cache whose slots are handed out from a pool and given back when no thread needs them:
    an allocator on top of KVCache, whose `write` stores each pass's K/V in the slots it was given.

    `allocate(n)` picks the n lowest free slots for the next forward pass; attention then runs over
    slots [0, length), `length` being the highest slot ever used + 1, and each row's mask says which
    of those it sees. `release` returns slots to the pool, to be reused by later tokens.
    """

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.free = list(range(self.capacity))  # a heap: the lowest slot first keeps `length` small
        self.in_use = self.peak = 0

    def allocate(self, count: int) -> list[int]:
        if count > len(self.free):
            raise RuntimeError(f"KV cache full: {self.in_use} slots in use, {count} more needed, capacity {self.capacity}")
        slots = [heapq.heappop(self.free) for _ in range(count)]
        self.length = max(self.length, max(slots) + 1)
        self.in_use += count
        self.peak = max(self.peak, self.in_use)
        return slots

    def release(self, slots) -> None:
        for slot in slots:
            heapq.heappush(self.free, slot)
        self.in_use -= len(slots)


# ---- loading: the base model with the adapter merged ---------------------------------------------

ADAPTED_LINEARS = ("attention.wqkv", "attention.wo")  # per layer: where the low-rank updates go (default)
ADAPTABLE_LINEARS = ADAPTED_LINEARS + ("mlp.w_gate_up", "mlp.w_down")  # where train_prompt.py --adapt may put them


def updated_linears(tensors: dict[str, torch.Tensor]) -> list[str]:
    """The Linears an adapter's tensors update, by name ("layers.3.attention.wqkv", from its
    "layers.3.attention.wqkv.up" and ".down"): what apply_adapter merges."""
    return [key.removesuffix(".up") for key in tensors if key.endswith(".up")]


def adapted_in(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Which of each layer's Linears an adapter's tensors update ("attention.wqkv", ...)."""
    found = {name.split(".", 2)[2] for name in updated_linears(tensors)}
    return [name for name in ADAPTABLE_LINEARS if name in found]


def adapted_linears(model, names=ADAPTED_LINEARS) -> dict[str, torch.nn.Module]:
    """The Linear modules an adapter of `names` (per layer) changes, by name ("layers.3.attention.wqkv")."""
    modules = dict(model.named_modules())
    return {f"layers.{i}.{name}": modules[f"layers.{i}.{name}"]
            for i in range(model.config.num_layers) for name in names}


def with_control_rows(weight: torch.Tensor, control: ControlTokens, rows: torch.Tensor) -> torch.Tensor:
    """The embedding matrix [V, D] with the [Fork] and [Child] rows replaced by `rows` [2, D] (out of
    place, so gradients reach `rows` when training)."""
    ids = torch.tensor([control.fork, control.child], device=weight.device)
    return weight.index_put((ids,), rows.to(weight.dtype))


@torch.no_grad()
def require_tied_embeddings(model) -> None:
    """The trained [Fork]/[Child] rows serve as both input embeddings and LM-head rows, which needs
    the two matrices to be one (as on the default model)."""
    if not model.config.tie_embeddings:
        raise UserError("APAR here supports models with tied embeddings only (the default model's): "
                        "the trained [Fork]/[Child] rows are input and output rows at once")


def apply_adapter(model, tensors: dict[str, torch.Tensor], control: ControlTokens) -> None:
    """Turn the base model into the APAR model, in place: W += up @ down for every adapted Linear
    (LoRA's update merged, so decoding costs nothing extra) and the control tokens' embedding rows,
    tied to the LM head, set to their trained values."""
    require_tied_embeddings(model)
    wide = torch.promote_types(model.dtype, torch.float32)  # bfloat16 weights are merged in float32
    modules = dict(model.named_modules())
    for name in updated_linears(tensors):  # what it was trained on
        linear = modules[name]
        update = tensors[f"{name}.up"].to(wide) @ tensors[f"{name}.down"].to(wide)
        linear.weight = torch.nn.Parameter((linear.weight.to(wide) + update.to(linear.weight.device)).to(model.dtype),
                                           requires_grad=False)
    embed = with_control_rows(model.embed.weight, control, tensors["control_embeddings"])
    model.embed.weight = torch.nn.Parameter(embed, requires_grad=False)
    model.lm_head.weight = model.embed.weight


def load_apar_model(model, tokenizer, path) -> "AparEngine":
    """Make `model` the APAR model with the adapter at `path` (made by train_prompt.py apar), in place;
    returns the engine that decodes with it."""
    control = ControlTokens.of(tokenizer)
    tensors, _ = artifacts.load(path, "apar", model)
    with artifacts.unpacking(path, "apar"):
        apply_adapter(model, tensors, control)
    return AparEngine(model, control)


# ---- threads and the engine ---------------------------------------------------------------------

@dataclass(eq=False)
class Thread:
    """A generation thread: a sequence of the group (Algorithm 1's s). tokens[-1] is chosen but not
    yet fed; slots[i] holds the K/V of tokens[i] for every token fed so far."""
    tokens: list[int]
    slots: list[int]
    paragraph: Paragraph  # the leaf it writes into (s.current_node)
    drafter: Drafter | None = None  # its own guesser (APAR + a guesser), told only its own sequence
    finished: bool = False
    writes_detail: bool = False  # a child: it writes one point's detail, which never forks (see verifier)
    passes: int = 0  # forward passes whose verdict it took (the last one may be cut by the budget)
    chosen: int = 0  # tokens it chose in them: accepted guesses and bonus tokens

    def append(self, token: int) -> None:
        self.tokens.append(token)
        self.paragraph.tokens.append(token)

    def fork(self, child_token: int) -> "Thread":
        """Algorithm 1, lines 20-29: the child shares everything this thread has (slots included,
        nothing copied) plus a forced [Child]; both go on in new paragraph nodes."""
        child = Thread(self.tokens + [child_token], list(self.slots), Paragraph([child_token]), writes_detail=True)
        self.paragraph.first_child = child.paragraph
        self.paragraph.next_sibling = Paragraph()
        self.paragraph = self.paragraph.next_sibling
        return child


@dataclass
class AparGeneration:
    """What one prompt produced with APAR, and what it cost (section 3.4 and appendix D's measures)."""
    token_ids: list[int] = field(default_factory=list)  # the restored answer, control tokens removed
    stop_reason: str = ""  # "eos" (every thread ended), "max_new_tokens" or "context"
    threads: int = 1  # generation threads in all (#T in Tables 7-8)
    counts: Counts = field(default_factory=Counts)  # forward passes (the prefill's included), guesses fed and accepted
    tokens_sampled: int = 0  # by all threads: the answer plus [Fork]s and EOSs
    max_cached_tokens: int = 0  # peak K/V slots in use (prompt included)
    attended_tokens: int = 0  # summed over every token fed after the prefill: the slots its row saw
    tokens_fed: int = 0  # tokens fed after the prefill (pending tokens, guesses and [Child]s)
    thread_tokens_per_pass: list[float] = field(default_factory=list)  # per thread: tokens chosen per verdict
    decode_seconds: float = 0.0
    kv_cache_bytes: int = 0


@dataclass
class ThreadPass:
    """One thread's part of a forward pass, as a watcher (visualize.py threads) is told of it."""
    number: int  # the forward pass (1: the prefill)
    thread: int  # the thread's index in the group (0: the root)
    tokens: list[int]  # the tokens it chose
    accepted: int  # of those, accepted guesses
    forked: list[int]  # the threads it forked, by index


@dataclass
class AparEngine:
    """The APAR model (the base model with the adapter merged, load_apar_model), its
    control tokens and, optionally, a guesser (() -> a Drafter) giving each thread a drafter of its own:
    what `--method apar` runs instead of the guess-and-verify loop."""
    model: torch.nn.Module
    control: ControlTokens
    guesser: Callable[[], Drafter] | None = None
    fork_bias: float = 0.0  # nats added to [Fork]'s logit where a thread may fork (verifier; --fork-bias)

    def generate(self, prompt_ids: list[int], **options) -> "AparGeneration":
        return generate_apar(self.model, prompt_ids, self.control, guesser=self.guesser, fork_bias=self.fork_bias,
                             **options)


# Guessed tokens fed in one pass over all threads, which share it (measured: docs/constants.md).
MAX_GUESSES_PER_PASS = 32
# --fork-bias's default: nats added to [Fork]'s logit where a thread may fork (verifier). Measured for the
# shipped adapter on held-out list prompts: more forks, at a perplexity past vanilla's 1.25x (docs/constants.md).
FORK_BIAS = 0.0
MAX_FORK_BIAS = 10.0


def generate_apar(model, prompt_ids: list[int], control: ControlTokens, *, max_new_tokens: int,
                  eos_ids: set[int], sampling: Sampling = Sampling(), generator=None,
                  guesser: Callable[[], Drafter] | None = None, max_guesses: int = MAX_GUESSES_PER_PASS,
                  fork_bias: float = 0.0, watch=None) -> AparGeneration:
    """Decode one prompt with APAR. `guesser()` (optional) makes each new thread's drafter; a pass
    feeds at most `max_guesses` guesses over all threads (each live thread gets an even share of them,
    cut from its tree). Each thread's tree is verified on its own (`verifier`). At most
    `max_new_tokens` tokens are chosen over all threads. `watch(ThreadPass)` is told every verdict
    taken (visualize.py threads draws them). `fork_bias` is added to [Fork]'s logit where a thread may
    fork (see verifier)."""
    context = model.config.max_positions
    budget = room_for_new_tokens(model, prompt_ids, max_new_tokens)
    judge = verifier(control, sampling, generator, fork_bias)

    def started(thread: Thread) -> Thread:  # a new thread's drafter learns the thread's own sequence
        if guesser is not None:
            thread.drafter = guesser()
            thread.drafter.begin(Request(thread.tokens, sampling, generator))
        return thread

    # every chosen token and every forced [Child] (at most one per [Fork]) is fed once; guesses on top
    cache = SlotCache.for_model(model, capacity=len(prompt_ids) + 2 * budget + (max_guesses if guesser else 0))
    meter, counts = Meter(model.device), Counts()
    root = prefill(model, cache, prompt_ids, judge)  # 1. the prompt's pass: the root thread's first token
    counts.add_pass()
    root_paragraph, group = root.paragraph, [started(root)]
    tokens_fed = attended_tokens = 0  # after the prefill: rows fed, and the slots each row saw
    if watch:
        watch(ThreadPass(1, 0, root.tokens[-1:], 0, []))
    chosen, stop_reason = 1, ""  # tokens chosen over all threads
    finish_if_done(root, eos_ids, cache, group)
    while not stop_reason:
        live = [thread for thread in group if not thread.finished]
        if not live:
            stop_reason = "eos"
            break
        if max(len(t.tokens) for t in live) > context:  # a pending token's position is len - 1
            stop_reason = "context"
            break
        trees = [proposal(thread, max_guesses // len(live), min(budget - chosen - 1, context - len(thread.tokens)))
                 for thread in live]  # 2. propose: each thread its pending token and guesses
        fed, attended = step(model, cache, live, trees)  # 3. ONE forward pass for every live thread
        tokens_fed, attended_tokens = tokens_fed + sum(map(len, trees)), attended_tokens + attended
        proposed = accepted = 0
        for thread, tree, (hidden, logits, slots) in zip(live, trees, fed):  # 4. each thread takes its verdict
            if chosen == budget:
                stop_reason = "max_new_tokens"
                break
            verdict = judge(tree, logits, thread)
            threads_before, fed_before = len(group), len(thread.slots) - 1  # (its pending token's slot joined)
            new_tokens = advance(thread, verdict, slots, budget - chosen, control, eos_ids, group, started)
            guessed = min(len(new_tokens), verdict.accepted_guesses)  # (the budget or an EOS may cut the path)
            chosen, proposed, accepted = chosen + len(new_tokens), proposed + tree.draft_size, accepted + guessed
            if thread.drafter is not None:
                thread.drafter.after_pass(Pass(tree, fed_before, verdict.path, new_tokens, hidden, logits, verdict))
            if watch:
                watch(ThreadPass(counts.forward_passes + 1, group.index(thread), new_tokens, guessed,
                                 list(range(threads_before, len(group)))))
            kept = set(thread.slots[-len(slots):])  # the pending token's and the accepted guesses'
            cache.release([slot for slot in slots if slot not in kept])  # rejected, unreached, after an EOS
            finish_if_done(thread, eos_ids, cache, group)  # 5. an ended thread gives back its slots
        counts.add_pass(proposed, accepted)
    control_ids = {control.fork, control.child} | set(eos_ids)
    return AparGeneration([t for t in restore(root_paragraph) if t not in control_ids], stop_reason,
                          threads=len(group), counts=counts, tokens_sampled=chosen, max_cached_tokens=cache.peak,
                          attended_tokens=attended_tokens, tokens_fed=tokens_fed,
                          thread_tokens_per_pass=[t.chosen / t.passes for t in group if t.passes],
                          decode_seconds=meter.elapsed(), kv_cache_bytes=cache.memory_bytes())


def prefill(model, cache: SlotCache, prompt_ids: list[int], judge) -> Thread:
    """The prompt's pass, causal, into the first slots: the root thread, holding its first token."""
    slots = cache.allocate(len(prompt_ids))  # 0..P-1: the pool is fresh
    hidden = model.hidden_states(torch.tensor([prompt_ids], device=model.device),
                                 positions=torch.arange(len(prompt_ids), device=model.device), cache=cache,
                                 slots=torch.tensor(slots, device=model.device),
                                 mask=causal_mask(0, len(prompt_ids), model.device))
    logits = require_finite(model.logits(hidden[0, -1:]), model)  # [1, V]
    root = Thread(list(prompt_ids), slots, Paragraph())
    root.append(judge(Tree.chain(prompt_ids[-1], []), logits, root).tokens[0])
    return root


def proposal(thread: Thread, share: int, max_depth: int) -> Tree:
    """The tree a thread feeds: its pending token and, from its drafter, at most `share` guesses, none
    deeper than `max_depth` (the tokens still wanted, the context)."""
    if thread.drafter is None or share == 0 or max_depth <= 0:
        return Tree.chain(thread.tokens[-1], [])
    tree = thread.drafter.propose().truncated(max_depth)
    return tree.subtree(range(min(len(tree), share + 1)))  # parents come first: a prefix is a tree


def step(model, cache: SlotCache, live: list[Thread], trees: list[Tree]):
    """ONE forward pass feeding every live thread's tree (its pending token, then its guesses). A row
    sees its thread's slots and its own ancestors in the tree, at position (tokens the thread has fed)
    + depth. The pending token's slot joins its thread at once. Returns, per thread, the hidden states
    [N_i, D], logits [N_i, V] and slots of its tree's N_i nodes, and the slots all rows saw in all."""
    sizes = [len(tree) for tree in trees]
    slots = cache.allocate(sum(sizes))
    tree_slots = [slots[start:start + size] for start, size in zip(accumulate([0] + sizes), sizes)]
    mask = torch.zeros(len(slots), cache.length, dtype=torch.bool)  # [R, S]: R rows over all threads
    positions, row = [], 0
    for thread, tree, own in zip(live, trees, tree_slots):
        rows = mask[row:row + len(tree)]  # a view: writing it writes the mask
        rows[:, thread.slots] = True
        rows[:, own] = tree.ancestor_mask()  # [N_i, N_i]
        positions += [len(thread.slots) + depth for depth in tree.depths]
        row += len(tree)
        thread.slots.append(own[0])
    tokens = torch.tensor([[token for tree in trees for token in tree.tokens]], device=model.device)  # [1, R]
    hidden = model.hidden_states(tokens, positions=torch.tensor(positions, device=model.device), cache=cache,
                                 slots=torch.tensor(slots, device=model.device), mask=mask.to(model.device))[0]
    logits = model.logits(hidden)  # [R, V]
    return list(zip(hidden.split(sizes), logits.split(sizes), tree_slots)), int(mask.sum())


def advance(thread: Thread, verdict: Verdict, slots: list[int], room: int, control: ControlTokens,
            eos_ids: set[int], group: list[Thread], started) -> list[int]:
    """Take a thread's verdict token by token, at most `room` of them: fork when the token before was
    [Fork] (a guessed [Fork] forks where it stands), append, keep the slot of each accepted guess (it
    was fed there), stop at EOS. Returns the tokens the thread chose."""
    new_tokens = verdict.tokens[:room]
    for i, token in enumerate(new_tokens):
        if thread.tokens[-1] == control.fork:
            group.append(started(thread.fork(control.child)))
        thread.append(token)
        if i + 1 < len(verdict.path):  # an accepted guess, not the bonus token
            thread.slots.append(slots[verdict.path[i + 1]])
        if token in eos_ids:
            new_tokens = new_tokens[:i + 1]
            break
    thread.passes += 1
    thread.chosen += len(new_tokens)
    return new_tokens


def finish_if_done(thread: Thread, eos_ids: set[int], cache: SlotCache, group: list[Thread]) -> None:
    """A thread that wrote EOS ends (its EOS is fed only as an accepted guess) and gives back the slots
    that no live thread attends to: its own tokens since its last fork that has a live child
    (RELEASECACHE)."""
    if thread.tokens[-1] not in eos_ids:
        return
    thread.finished = True
    still_needed = {slot for other in group if not other.finished for slot in other.slots}
    cache.release([slot for slot in thread.slots if slot not in still_needed])


def verifier(control: ControlTokens, sampling: Sampling, generator, fork_bias: float = 0.0):
    """Each thread's tree is verified on its own (verify.py: greedy, or exact speculative sampling),
    over every token but [Child]: only the engine writes [Child] (its embedding is trained as an
    input, and tied to the LM head, so the model might otherwise pick it). A child thread may not
    write [Fork] either: the paragraph trees it was trained on are one level deep (appendix B's rules
    make each detail a leaf), and a small adapter that forks inside a detail cuts it into fragments
    (this project's rule; Algorithm 1 lets any thread fork).

    Where a thread may fork, `fork_bias` (in nats) is added to [Fork]'s logit: greedy then forks
    wherever [Fork] is within `fork_bias` of the likeliest token, and sampling multiplies its odds by
    exp(fork_bias / temperature). The paper sets how readily the model forks in training only (its
    unstructured negative examples, section 3.1); a small adapter learns where points start but
    sometimes ranks [Fork] just below the point's next word, and this is the decoding-time knob for
    that (this project's rule; FORK_BIAS is the measured default). Guesses are verified against
    the same biased logits, so a guesser changes no thread's text."""
    def judge(tree: Tree, logits: torch.Tensor, thread: Thread) -> Verdict:
        logits = logits.clone()
        logits[:, control.child] = float("-inf")
        if thread.writes_detail:
            logits[:, control.fork] = float("-inf")
        else:
            logits[:, control.fork] += fork_bias
        return verify(tree, logits, sampling, generator)
    return judge


# ---- statistics ---------------------------------------------------------------------------------

def statistics(gen: AparGeneration, prompt_length: int) -> dict:
    """Appendix D's measures for one answer, and the same for its flattened form: the restored answer
    decoded auto-regressively (every token cached until the end, every step attending to all of them)."""
    new = len(gen.token_ids)
    return {
        "new_tokens": new,
        "stop_reason": gen.stop_reason,
        "threads": gen.threads,
        "parallel": gen.threads > 1,
        "forward_passes": gen.counts.forward_passes,
        "tokens_per_pass": round(new / gen.counts.forward_passes, 4),
        "tokens_sampled": gen.tokens_sampled,
        "max_cached_tokens": gen.max_cached_tokens,
        "flattened_max_cached_tokens": prompt_length + new,
        "attended_tokens": round(gen.attended_tokens / max(gen.tokens_fed, 1), 2),
        "flattened_attended_tokens": round(prompt_length + (new + 1) / 2, 2),
        "decode_seconds": round(gen.decode_seconds, 4),
        "tokens_per_second": round(new / gen.decode_seconds, 3),
        "kv_cache_bytes": gen.kv_cache_bytes,
        "guesses_proposed": gen.counts.guesses_proposed,
        "guesses_accepted": gen.counts.guesses_accepted,
        "thread_tokens_per_pass": [round(tau, 3) for tau in gen.thread_tokens_per_pass],  # tau of each thread
    }


def summary_line(stats: dict) -> str:
    taus = stats["thread_tokens_per_pass"]
    guessed = (f"{stats['guesses_accepted']}/{stats['guesses_proposed']} guesses accepted, tau per thread "
               f"{min(taus):.2f}..{max(taus):.2f}, " if stats["guesses_proposed"] else "")
    return (f"[apar: {stats['new_tokens']} new tokens ({stats['stop_reason']}), {stats['threads']} threads, "
            f"{stats['forward_passes']} forward passes, {stats['tokens_per_pass']:.2f} tokens/pass, {guessed}"
            f"max cached {stats['max_cached_tokens']} tokens (flattened {stats['flattened_max_cached_tokens']}), "
            f"{stats['tokens_per_second']:.1f} tokens/s, {stats['decode_seconds']:.2f}s]")
