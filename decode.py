"""The guess-and-verify decoding loop: every lossless method in this project is this loop with a
different drafter (drafters.py, medusa.py, ppd.py).

    python decode.py --method anpd --prompt "Write a haiku about the sea."   # the command line: cli.py

As in Leviathan et al. 2023 (Algorithm 1) and Stern et al. 2018 (section 3), the prefill pass over the
prompt yields the first new token, the *root*. Then, until an end-of-sequence token, --max-new-tokens
or the context limit:

    tree    = drafter.propose()                   # 1. propose: guessed continuations of the root (tree.py)
    start   = cache.length
    hidden  = model(tree's inputs,                # 2. score: ONE forward pass over every guess, each
                    positions = cache length + depth,  #  seeing the cache and its own ancestors
                    mask = cache + ancestors)
    verdict = verify(tree, logits)                # 3. verify: the accepted path + a bonus token, greedy
                                                  #    or exact speculative sampling (verify.py)
    cache.keep(start, verdict.path)               # 4. keep: K/V of the accepted nodes only, packed
    emitted = answer.emit(verdict)                # 5. emit: append, stopping exactly where vanilla would
    counts.add_pass(guesses proposed, kept, ...)  #    and count the pass
    drafter.after_pass(done)                      # 6. learn: n-grams and tries take the new tokens,
                                                  #    Medusa's heads read the last accepted node's hidden
                                                  #    state, cost-aware drafting its estimates

`done` (a `Pass`, drafters.py) is also what a watcher is shown after every pass (`on_pass`:
decode.py --show-tree, visualize.py).

Vanilla decoding is the drafter that guesses nothing: each pass scores the root alone. Draft-model
speculative decoding (Leviathan et al. 2023, Algorithm 1) is the drafter whose tree is a chain sampled
from a small model. Medusa's heads read the final hidden state of the last accepted node (Cai et al.
2024, section 2.1); PPD's soft tokens are extra inputs of the same pass, hung on the tree's nodes
(and on the prompt's last token in the prefill), whose own outputs are the next guesses (Chen et al.
2024, Figure 2); their K/V are dropped with the rejected guesses'.

APAR (Liu et al. 2024) is not a guesser: the fine-tuned model forks its own generation threads, so it
has its own engine (apar.py).
"""

import sys
import time
from collections import Counter
from contextlib import contextmanager
from dataclasses import dataclass, field

from errors import UserError  # (imported before torch: then Ctrl-C while torch loads is one line too)
import torch

from drafters import Drafter, Pass, Request
from kv_cache import KVCache
from sampling import Sampling, choose_token
from tree import Tree
from verify import TypicalAcceptance, verify


@dataclass
class Counts:
    """What a generation's forward passes did."""
    forward_passes: int = 0  # the prefill's included
    guesses_proposed: int = 0  # guessed tokens sent through the model
    guesses_accepted: int = 0  # of those, tokens that became output
    rejections: int = 0  # passes that ended at a rejected guess (the others ran out of guesses)

    def add_pass(self, proposed: int = 0, accepted: int = 0, rejected: bool = False) -> None:
        self.forward_passes += 1
        self.guesses_proposed += proposed
        self.guesses_accepted += accepted
        self.rejections += int(rejected)


@dataclass
class Generation:
    """What one prompt produced, and what it cost."""
    token_ids: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)  # per new token: an accepted guess?
    stop_reason: str = ""  # "eos", "max_new_tokens" or "context"
    counts: Counts = field(default_factory=Counts)  # forward passes (the prefill's included) and guesses
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # proposing guesses and updating the drafter
    forward_seconds: float = 0.0  # forward passes after the prefill, logits included
    decode_seconds: float = 0.0  # the whole generation, prefill included
    kv_cache_bytes: int = 0  # memory preallocated for keys and values


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
             drafter: Drafter | None = None, sampling: Sampling = Sampling(), generator=None,
             typical: TypicalAcceptance | None = None, on_tokens=None, on_pass=None) -> Generation:
    """Decode one prompt with `drafter`'s guesses (none: vanilla), greedily or by sampling (exactly,
    or with the lossy `typical` acceptance). `on_tokens(ids, guessed)` is called after every pass
    with its new tokens, of which the first `guessed` were accepted guesses; `on_pass(Pass)` after
    every pass but the prefill."""
    drafter = drafter or Drafter()
    room = room_for_new_tokens(model, prompt_ids, max_new_tokens)
    cache = KVCache.for_model(model, capacity=len(prompt_ids) + room + drafter.max_extra_inputs)
    meter, counts = Meter(model.device), Counts()
    answer = Answer(max_new_tokens, room, eos_ids, on_tokens)
    drafter.begin(Request(prompt_ids, sampling, generator, max_length=len(prompt_ids) + room, cache=cache))
    with meter.time("prefill"):
        done = prefill(model, cache, drafter.prefill_tree(prompt_ids), sampling, generator, answer)
    counts.add_pass()
    with meter.time("draft"):
        drafter.after_pass(done)
    while not answer.stop_reason:
        with meter.time("draft"):  # 1. propose (no deeper than the tokens still wanted)
            tree = drafter.propose().truncated(answer.tokens_left - 1)
        with meter.time("forward"):
            start = cache.length
            hidden = score_tree(model, cache, tree)  # 2. score: [N + S, D]
            logits = model.logits(hidden)  # [N + S, V]: ONE LM-head product for guesses and extra inputs
            verdict = verify(tree, logits, sampling, generator, typical)  # 3. verify
            cache.keep(start, verdict.path)  # 4. keep: rejected guesses' and extra inputs' K/V go
        done = Pass(tree, start, verdict.path, answer.emit(verdict.tokens, verdict.accepted_guesses),  # 5. emit
                    hidden, logits, verdict, seconds=meter.last["forward"])
        counts.add_pass(done.guesses_proposed, done.guesses_kept, done.rejected)
        with meter.time("draft"):
            drafter.after_pass(done)  # 6. learn
        if on_pass:  # someone watches the loop
            on_pass(done)
    return Generation(answer.token_ids, answer.from_draft, answer.stop_reason, counts,
                      prefill_seconds=meter.seconds["prefill"], draft_seconds=meter.seconds["draft"],
                      forward_seconds=meter.seconds["forward"], decode_seconds=meter.elapsed(),
                      kv_cache_bytes=cache.memory_bytes())


def room_for_new_tokens(model, prompt_ids: list[int], max_new_tokens: int) -> int:
    """How many new tokens this prompt may get: `max_new_tokens`, or fewer if the model's context
    (max_position_embeddings) is shorter. The decoding loops (here and apar.py) both ask it."""
    context = model.config.max_positions
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context} (shorten it)")
    return min(max_new_tokens, context - len(prompt_ids))


def require_finite(logits: torch.Tensor, model) -> torch.Tensor:
    """`logits`, refused if any is NaN or inf: damaged weights (or an overflow in a low precision)
    would otherwise decode to an empty or random answer with no error. The decoding loops check the
    prompt's logits, one device sync per prompt."""
    if not torch.isfinite(logits).all():
        where = f"the weights in {model.folder}" if model.folder else "its weights"
        raise UserError(f"the model computed NaN or inf logits: {where} are damaged (if it is the converted "
                        f"default model, delete that folder and run again to convert it anew) or overflow "
                        f"in {str(model.dtype).removeprefix('torch.')} (try --dtype float32)")
    return logits



def prefill(model, cache: KVCache, prompt: Tree, sampling: Sampling, generator, answer: "Answer") -> Pass:
    """The prompt's pass (`prompt`: the prompt as a chain, perhaps with extra inputs on its last token):
    its K/V into the cache, the extra inputs' dropped, and the first new token chosen from the last
    prompt token's logits and emitted.

    It runs as two forward passes: the prompt but its last token, a plain causal pass, then the last
    token with the extra inputs, a pass like every decoding pass (the root and what a method hangs on it).
    So the prompt's K/V are the same for every method, bit for bit: a matrix product over many rows
    rounds each row by how many rows are beside it (MKL's GEMM), and with PPD's soft tokens in the same
    product as the prompt its K/V parted from vanilla's by a rounding, once enough to change an answer (a
    long RAG prompt, bfloat16). It counts as one pass, the prefill."""
    last = len(prompt) - 1
    if prompt.extra and set(prompt.extra.node) != {last}:
        raise ValueError("a prompt carries extra inputs on its last token only")
    head = [score_tree(model, cache, Tree.chain(prompt.tokens[0], prompt.tokens[1:last]))] if last else []  # [P - 1, D]
    tail = Tree.chain(prompt.tokens[last], [])
    if prompt.extra:
        tail = tail.with_extra(prompt.extra.of_nodes([last]))
    hidden = torch.cat([*head, score_tree(model, cache, tail)])  # [P + S, D]
    logits = require_finite(model.logits(hidden[last:]), model)  # [1 + S, V]: the last prompt token's, then
    cache.truncate(len(prompt))  # the extra inputs'
    emitted = answer.emit([choose_token(logits[0], sampling, generator)], guesses=0)
    return Pass(prompt, 0, list(range(len(prompt))), emitted, hidden, logits, logits_start=last)


def score_tree(model, cache: KVCache, tree: Tree) -> torch.Tensor:
    """ONE forward pass over the tree's inputs (its nodes, then any extra inputs), their K/V written
    to the next slots of the cache: the final hidden states [N + S, D]."""
    start = cache.length
    slots = cache.claim(tree.input_count)
    # a lone input (plain decoding, or every guess cut) sees the whole cache: no mask to apply
    mask = None if tree.input_count == 1 else tree.input_mask(start, model.device)
    hidden = model.hidden_states(embeds=tree.input_embeddings(model.embed),
                                 positions=tree.input_positions(start, model.device), cache=cache, slots=slots,
                                 mask=mask)
    return hidden[0]


class Answer:
    """The new tokens, as the forward passes emit them: appended one by one, stopping exactly where
    vanilla decoding would, and streamed to `on_tokens(ids, guessed)`."""

    def __init__(self, max_new_tokens: int, room: int, eos_ids: set[int], on_tokens=None):
        self.max_new_tokens, self.room, self.eos_ids = max_new_tokens, room, eos_ids
        self.on_tokens = on_tokens
        self.token_ids: list[int] = []
        self.from_draft: list[bool] = []
        self.stop_reason = ""

    @property
    def tokens_left(self) -> int:
        return self.room - len(self.token_ids)

    def emit(self, tokens: list[int], guesses: int) -> list[int]:
        """Append a pass's new tokens, of which the first `guesses` are accepted guesses, until the
        stop rule says stop; returns the tokens kept."""
        kept = []
        for token in tokens:
            self.token_ids.append(token)
            self.from_draft.append(len(kept) < guesses)
            kept.append(token)
            self.stop_reason = stop_reason(self.token_ids, self.max_new_tokens, self.room, self.eos_ids)
            if self.stop_reason:
                break
        if self.on_tokens:
            self.on_tokens(kept, min(guesses, len(kept)))
        return kept


def stop_reason(token_ids: list[int], max_new_tokens: int, room: int, eos_ids: set[int]) -> str:
    """The stop rule: "" to go on, else why decoding stops after the last of `token_ids`."""
    if token_ids[-1] in eos_ids:
        return "eos"
    if len(token_ids) >= max_new_tokens:
        return "max_new_tokens"
    if len(token_ids) >= room:
        return "context"
    return ""


# ---- keeping time ---------------------------------------------------------------------------------

class Meter:
    """Seconds per phase of a generation, kept by `with meter.time(phase):` so that the loops (here and
    apar.py) read no clock; on a GPU the clock first waits for the queued work, so the seconds are the
    work's, not its launch's."""

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.seconds: Counter[str] = Counter()  # phase -> seconds spent in it
        self.last: dict[str, float] = {}  # phase -> seconds of its latest timed block
        self.started = self.now()

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.perf_counter()

    @contextmanager
    def time(self, phase: str):
        started = self.now()
        try:
            yield
        finally:
            self.last[phase] = self.now() - started
            self.seconds[phase] += self.last[phase]

    def elapsed(self) -> float:
        return self.now() - self.started


if __name__ == "__main__":  # `python decode.py ...` is the command line (cli.py); importing decode never runs this
    sys.modules["decode"] = sys.modules["__main__"]  # cli imports this file's module, not a second copy of it
    from programs.cli import main

    sys.exit(main())
