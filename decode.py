"""The guess-and-verify decoding loop: every lossless method in this project is this loop with a
different drafter (drafters.py, medusa.py, ppd.py).

    python decode.py --method anpd --prompt "Write a haiku about the sea."   # the command line: cli.py

As in Leviathan et al. 2023 (Algorithm 1) and Stern et al. 2018 (section 3), the prefill pass over the
prompt yields the first new token, the *root*. Then, until an end-of-sequence token, --max-new-tokens
or the context limit:

    tree    = drafter.propose()                   # 1. propose: guessed continuations of the root (tree.py)
    hidden  = model(tree.tokens,                  # 2. score: ONE forward pass over every guess, each
                    positions = cache length + depth,  #  seeing the cache and its own ancestors
                    mask = cache + ancestors)
    verdict = verify(tree, logits)                # 3. verify: the accepted path + a bonus token, greedy
                                                  #    or exact speculative sampling (verify.py)
    cache.keep(verdict.path)                      # 4. keep: K/V of the accepted nodes only, packed
    new_tokens = emit(verdict)                    # 5. emit: append, stopping exactly where vanilla would
    drafter.verified(tree, verdict)               # 6. learn: cost-aware drafting calibrates its estimates
    drafter.observe(last accepted node's hidden state and soft tokens' logits)   #  observe: Medusa, PPD
    drafter.extend(new_tokens)                    #    extend: n-gram tables and tries learn the tokens

A watcher (`on_pass`: decode.py --show-tree, visualize.py) is shown every pass as it happened (`Pass`).

Vanilla decoding is the drafter that guesses nothing: each pass scores the root alone. Draft-model
speculative decoding (Leviathan et al. 2023, Algorithm 1) is the drafter whose tree is a chain sampled
from a small model. Medusa's heads read the final hidden state of the last accepted node (Cai et al.
2024, section 2.1); PPD's soft tokens are extra inputs of the same pass, appended to the tree's nodes
(and to the prompt's last token in the prefill), whose own outputs are the next guesses (Chen et al.
2024, Figure 2); their K/V are dropped with the rejected guesses'.

APAR (Liu et al. 2024) is not a guesser: the fine-tuned model forks its own generation threads, so it
has its own engine (apar.py).
"""

import sys
from dataclasses import dataclass, field

import errors  # noqa: F401 (imported before torch, so that Ctrl-C while torch loads is one line too)
import torch

from drafters import Drafter, Request
from kv_cache import KVCache
from meter import Meter
from model import require_finite, room_for_new_tokens
from sampling import Sampling, choose_token
from tree import Tree
from verify import TypicalAcceptance, Verdict, verify


@dataclass
class Generation:
    """What one prompt produced, and what it cost."""
    token_ids: list[int] = field(default_factory=list)
    from_draft: list[bool] = field(default_factory=list)  # per new token: an accepted guess?
    stop_reason: str = ""  # "eos", "max_new_tokens" or "context"
    forward_passes: int = 0  # including the prefill pass, which yields the first token
    draft_tokens_proposed: int = 0  # guessed tree nodes sent through the model
    draft_tokens_accepted: int = 0  # of those, tokens that became output
    draft_rejections: int = 0  # passes that ended at a rejected guess (the others ran out of guesses)
    prefill_seconds: float = 0.0
    draft_seconds: float = 0.0  # proposing guesses and updating the drafter
    forward_seconds: float = 0.0  # forward passes after the prefill, logits included
    decode_seconds: float = 0.0  # the whole generation, prefill included
    kv_cache_bytes: int = 0  # memory preallocated for keys and values


@dataclass
class Pass:
    """One forward pass of the loop after the prefill, as a watcher sees it."""
    tree: Tree  # the candidate tree it scored
    cache_length: int  # tokens cached before it: node i sat at position cache_length + depth(i)
    choices: list[int]  # per node, the model's most likely next token there (its greedy choice)
    verdict: Verdict  # what the verifier accepted, and the bonus token
    emitted: list[int]  # the tokens the pass added to the answer: the verdict's, cut by the stop rule

    @property
    def bonus_emitted(self) -> bool:
        """Whether the bonus token reached the answer (the stop rule can end it among the guesses)."""
        return len(self.emitted) > self.verdict.accepted_guesses


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
             drafter: Drafter | None = None, sampling: Sampling = Sampling(), generator=None,
             typical: TypicalAcceptance | None = None, on_tokens=None, on_pass=None) -> Generation:
    """Decode one prompt with `drafter`'s guesses (none: vanilla), greedily or by sampling (exactly,
    or with the lossy `typical` acceptance). `on_tokens(ids, guessed)` is called after every pass
    with its new tokens, of which the first `guessed` were accepted guesses; `on_pass(Pass)` after
    every pass but the prefill."""
    drafter = drafter or Drafter()
    room = room_for_new_tokens(model, prompt_ids, max_new_tokens)
    cache = KVCache.for_model(model, capacity=len(prompt_ids) + room + drafter.max_draft_tokens)
    meter = Meter(model.device)
    answer = Answer(max_new_tokens, room, eos_ids, meter, on_tokens)
    drafter.begin(Request(prompt_ids, sampling, generator, max_length=len(prompt_ids) + room))
    try:
        with meter.time("prefill"):
            hidden, logits = prefill(model, cache, prompt_ids, drafter)  # [1 + S, D], [1 + S, V]
        new_tokens = answer.emit(Verdict([0], [choose_token(logits[0], sampling, generator)]))
        with meter.time("draft"):
            drafter.observe(hidden[0], logits[1:])  # the last prompt token and its soft tokens
            drafter.extend(new_tokens)
        while not answer.stop_reason:
            with meter.time("draft"):  # 1. propose (no deeper than the tokens still wanted)
                tree = drafter.propose().truncated(answer.tokens_left - 1)
            with meter.time("forward"):
                tree_start = cache.length
                hidden = score_tree(model, cache, tree)  # 2. score: [N + S, D]
                logits = model.logits(hidden)  # [N + S, V]: ONE LM-head product for guesses and soft tokens
                verdict = verify(tree, logits[:len(tree)], sampling, generator, typical)  # 3. verify
                cache.keep(tree_start, verdict.path)  # 4. keep: rejected guesses' and soft tokens' K/V go
            new_tokens = answer.emit(verdict)  # 5. emit
            if on_pass:  # someone watches the loop
                on_pass(Pass(tree, tree_start, logits[:len(tree)].argmax(-1).tolist(), verdict, new_tokens))
            with meter.time("draft"):  # 6. learn / observe / extend
                drafter.verified(tree, verdict)
                last = verdict.path[-1]
                drafter.observe(hidden[last], logits[tree.soft_rows(last)])
                drafter.extend(new_tokens)
    finally:
        drafter.end()
    return Generation(answer.token_ids, answer.from_draft, answer.stop_reason,
                      forward_passes=meter.counts["forward_passes"],
                      draft_tokens_proposed=meter.counts["draft_tokens_proposed"],
                      draft_tokens_accepted=meter.counts["draft_tokens_accepted"],
                      draft_rejections=meter.counts["draft_rejections"],
                      prefill_seconds=meter.seconds["prefill"], draft_seconds=meter.seconds["draft"],
                      forward_seconds=meter.seconds["forward"], decode_seconds=meter.elapsed(),
                      kv_cache_bytes=cache.memory_bytes())


def prefill(model, cache: KVCache, prompt_ids: list[int], drafter: Drafter) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompt's pass: its K/V into the cache. Returns the final hidden states [1 + S, D] and logits
    [1 + S, V] of its last token (the first new token is chosen from them) and of the S soft tokens
    the drafter hangs on it (PPD: so that the first proposal already has guesses)."""
    tree = drafter.prompt_tree(prompt_ids)
    if tree is None:  # the plain causal pass
        positions = torch.arange(len(prompt_ids), device=model.device)
        hidden = model.hidden_states(torch.tensor([prompt_ids], device=model.device), positions=positions,
                                     cache=cache)[0]
    else:
        hidden = score_tree(model, cache, tree)
        cache.truncate(len(prompt_ids))  # soft tokens' K/V are never kept
    last = hidden[len(prompt_ids) - 1:]  # the last prompt token's, then its soft tokens'
    return last, require_finite(model.logits(last), model)


def score_tree(model, cache: KVCache, tree: Tree) -> torch.Tensor:
    """One forward pass over every node of the tree, then its soft tokens (inputs `tree.soft_inputs`
    [S, D]), appended to the cache: the final hidden states [N + S, D]."""
    tokens = torch.tensor([tree.tokens], device=model.device)  # [1, N]
    inputs = {"tokens": tokens}
    if tree.soft_inputs is not None:
        inputs = {"embeds": torch.cat([model.embed(tokens), tree.soft_inputs[None].to(model.dtype)], dim=1)}
    hidden = model.hidden_states(**inputs, positions=tree.positions(cache.length, model.device),
                                 cache=cache, mask=tree.attention_mask(cache.length, model.device))
    return hidden[0]


class Answer:
    """The new tokens, as the forward passes emit them: appended one by one, stopping exactly where
    vanilla decoding would, streamed to `on_tokens(ids, guessed)`, and each pass counted on the meter."""

    def __init__(self, max_new_tokens: int, room: int, eos_ids: set[int], meter: Meter, on_tokens=None):
        self.max_new_tokens, self.room, self.eos_ids = max_new_tokens, room, eos_ids
        self.meter, self.on_tokens = meter, on_tokens
        self.token_ids: list[int] = []
        self.from_draft: list[bool] = []
        self.stop_reason = ""

    @property
    def tokens_left(self) -> int:
        return self.room - len(self.token_ids)

    def emit(self, verdict: Verdict) -> list[int]:
        """Append a pass's new tokens until the stop rule says stop; returns the tokens kept."""
        kept = []
        for token in verdict.tokens:
            self.token_ids.append(token)
            self.from_draft.append(len(kept) < verdict.accepted_guesses)
            kept.append(token)
            self.stop_reason = stop_reason(self.token_ids, self.max_new_tokens, self.room, self.eos_ids)
            if self.stop_reason:
                break
        kept_guesses = min(verdict.accepted_guesses, len(kept))
        self.meter.count(forward_passes=1, draft_tokens_proposed=verdict.proposed,
                         draft_tokens_accepted=kept_guesses, draft_rejections=int(verdict.rejected))
        if self.on_tokens:
            self.on_tokens(kept, kept_guesses)
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


if __name__ == "__main__":  # `python decode.py ...` is the command line (cli.py); importing decode never runs this
    from cli import main

    sys.exit(main())
