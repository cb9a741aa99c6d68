"""How logits become the distribution p that decoding samples from: temperature, top-k, top-p.

This is the single definition of p. Vanilla sampling draws from it and every verifier judges drafts
against it, so the two can never disagree (a serving engine once shipped a bug where top-p was
applied on one side only, silently changing the output distribution).

Settings out of range raise ValueError (a program turns it into its one `error:` line).
"""

from dataclasses import dataclass

import torch


MIN_TEMPERATURE, MAX_TEMPERATURE = 0.01, 100.0


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0 means greedy: always the argmax
    top_k: int = 0  # 0 means no top-k cut
    top_p: float = 1.0  # 1 means no nucleus cut

    def __post_init__(self):
        # below 0.01 sampling is greedy in all but name, above 100 it is noise; inf and nan are nonsense
        if not (self.temperature == 0 or MIN_TEMPERATURE <= self.temperature <= MAX_TEMPERATURE):
            raise ValueError(f"temperature must be 0 (greedy) or in [{MIN_TEMPERATURE}, {MAX_TEMPERATURE}], "
                            f"got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top-k must be >= 0 (0 turns it off), got {self.top_k}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top-p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def target_probs(logits: torch.Tensor, sampling: Sampling) -> torch.Tensor:
    """p = softmax(logits / temperature), restricted to the top-k and then to the smallest set of
    tokens whose mass reaches top-p, renormalised. logits: [..., V] -> probabilities [..., V]
    (float32, or float64 for float64 logits)."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)) / sampling.temperature
    if sampling.top_k:
        kth_largest = logits.topk(min(sampling.top_k, logits.shape[-1])).values[..., -1:]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if sampling.top_p < 1:
        probs = nucleus(probs, sampling.top_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


NUCLEUS_CANDIDATES = 256  # tokens sorted first: topk(256) of a 49k vocabulary takes a tenth of a full sort


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """probs [..., V] with every token outside the nucleus zeroed: a token stays if the more likely
    tokens before it have not yet reached top_p (Holtzman et al. 2020, section 3.1). Only the
    NUCLEUS_CANDIDATES likeliest tokens are sorted when, in every row, they already reach top_p (the
    tokens after them are dropped either way); otherwise the whole vocabulary is."""
    values, order = probs.topk(min(NUCLEUS_CANDIDATES, probs.shape[-1]))  # most likely first
    if not (values.sum(-1) >= top_p).all():
        values, order = probs.sort(dim=-1, descending=True)
    mass_before = values.cumsum(-1) - values
    return torch.zeros_like(probs).scatter(-1, order, values * (mass_before < top_p))


def choose_token(logits: torch.Tensor, sampling: Sampling, generator=None) -> int:
    """The next token from one position's logits [V]: argmax when greedy, else a draw from p."""
    return choose_token_and_probs(logits, sampling, generator)[0]


def choose_token_and_probs(logits: torch.Tensor, sampling: Sampling,
                           generator=None) -> tuple[int, torch.Tensor | None]:
    """choose_token, and the distribution p [V] it drew from (None when greedy: the argmax). A draft
    model hands this p to the verifier as its q."""
    if sampling.greedy:
        return int(logits.argmax()), None
    probs = target_probs(logits, sampling)
    return int(torch.multinomial(probs, 1, generator=generator)), probs
