"""How good APAR's answers are next to the base model's: the quality columns of `python bench.py apar`.

APAR's output is the fine-tuned model's, not the base model's (apar.py), so fewer forward passes mean
little unless the answer is still as long, as complete and as fluent. Liu et al. 2024 judge quality
with GPT-4 on Vicuna Bench and MT-Bench (section 3.2, Table 3); offline, with no judge, we measure:

- length: the restored answer's tokens (a thread that ends early saves passes by writing less);
- completeness: for a prompt that asks for a number of points ("five tips", "top 10 ..."), whether
  the answer has at least that many (`requested_points`, `delivered_points`);
- fluency: the base model's perplexity of the answer after the prompt (`answer_nll`): restored text
  that glues points, loops or loses the thread reads as unlikely to the model it came from;
- loops: the data rules' test for degenerate repetition (apar_finetune.repetitive).
"""

import math
import re

import torch

NUMBER_WORDS = {"two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7, "eight": 8, "nine": 9,
                "ten": 10, "eleven": 11, "twelve": 12, "fifteen": 15, "twenty": 20}
LIST_NOUNS = (r"(?:tips|ways|steps|ideas|examples|benefits|reasons|points|things|questions|names|facts|items|"
              r"strategies|suggestions|advantages|disadvantages|features|methods|rules|topics|options|factors|"
              r"causes|tools|books|places|habits|activities|techniques|skills|mistakes|words|titles|slogans)")
# "five tips", "3 simple ways", "top 10 places to visit": a count, up to three words, a list noun
REQUEST = re.compile(rf"\b(\d{{1,2}}|{'|'.join(NUMBER_WORDS)})\s+(?:[\w'-]+\s+){{0,3}}?{LIST_NOUNS}\b", re.I)
NUMBERED = re.compile(r"^\d+\.[ \t]+(?=\S)", re.M)  # "3. " starting a line, not indented
BULLETED = re.compile(r"^[-*•][ \t]+(?=\S)", re.M)


def requested_points(prompt: str) -> int | None:
    """How many points the prompt asks for (2 to 20), or None when it names no count of list items."""
    match = REQUEST.search(prompt)
    if match is None:
        return None
    count = match.group(1).lower()
    count = int(count) if count.isdigit() else NUMBER_WORDS[count]
    return count if 2 <= count <= 20 else None


def delivered_points(answer: str) -> int:
    """The answer's top-level points: its numbered lines, or its bulleted lines when nothing is numbered
    (bullets under numbered points are details, not points). Indented lines are never points."""
    return len(NUMBERED.findall(answer)) or len(BULLETED.findall(answer))


@torch.inference_mode()
def answer_nll(model, prompt_ids: list[int], answer_ids: list[int]) -> list[float]:
    """The base model's negative log-likelihood of each answer token after the prompt: one forward
    pass over prompt + answer, the logits at position t scoring token t + 1."""
    if not answer_ids:
        return []
    tokens = torch.tensor([prompt_ids + answer_ids], device=model.device)
    logits, _ = model(tokens, positions=torch.arange(tokens.shape[1], device=model.device))
    scores = logits[0, len(prompt_ids) - 1:-1]  # [answer, V]
    predicted = torch.log_softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
    return (-predicted.gather(-1, tokens[0, len(prompt_ids):, None])[:, 0]).tolist()


def perplexity(nll: list[float]) -> float | None:
    """exp(mean negative log-likelihood) over every token of every answer (None: no tokens)."""
    return math.exp(sum(nll) / len(nll)) if nll else None
