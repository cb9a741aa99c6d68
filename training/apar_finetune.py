"""APAR's fine-tuning (Liu et al. 2024, sections 2.2 and 3.1, appendix B): the data rules that cut
answers into paragraph trees, the adapter that makes the base model fork, and the loss.

Read in this order: `structure` (the text rules), `training_example` (one sequence with a tree
attention mask and a label per token), `AparAdapter` and `apar_logits` (the loss's forward pass),
apar.apply_adapter (merged at load time; decoding is apar.py's engine). `python train_prompt.py apar`
runs the training (train_prompt.py).

The paper fine-tunes all weights; this trains a rank-16 LoRA update of every layer's attention
projections plus the two control tokens' embedding rows (tied to the LM head), about 1.3M
parameters, which ships as a few MB. Rank and learning rate were chosen among four settings by
held-out [Fork] precision and recall (train_prompt.py apar records its settings with the weights).

The data rules. An answer that loops (`repetitive`) is left out of training, except for the list
it wrote before its loop began (`before_the_loop`; it trains as an answer cut off there, this
project's addition: the small model loops in about half its answers, often after several good
points). Any other answer is read, in this order, as
1. an *ordered list*: at least 3 points "N. root: detail" (or bullets "- "), each detail at least 10
   characters; a point with no colon has its first three words as root (this project's addition:
   the small model writes many such lists). The root ("2. Watering:") is written by the parent
   thread, the detail by a child. The whitespace between points belongs to the next root, so a
   child ends with EOS right after its last word and RESTORE gives the answer back byte for byte.
2. *paragraphs*: the answer split at blank lines; a paragraph of two or more sentences has its first
   sentence as root and the rest as detail. Paragraphs of one sentence are not split.
3. *unstructured*: code blocks, math, URLs, or neither of the above. Such an answer stays one
   paragraph node with no fork, a negative example that teaches the model when not to fork.

Paragraph tree (section 2.2): a node's *first child* is its detail, its *next sibling* is the next
root. As threads (Algorithm 1), the parent writes root_1 [Fork] root_2 [Fork] ... then whatever text
follows the list and EOS; the child forked after root_i writes [Child] detail_i EOS. Every token sees
only its ancestors: detail_i sees the prompt and root_1..root_i, root_(i+1) sees root_1..root_i but
no detail. [Child] is an input but never a target ("attended to but not taken loss"), so the model
learns to *write* details when the engine injects it, and never to emit it.

Training source (`train_prompt.py apar --answers`): --records ShareGPT first turns, every list-style
one first (apar_prompts; self_distill.py's 13-word rule keeps the benchmark's prompts out), answered by
- `model`: the default model's own answers, one greedy and one sampled each (the small model's greedy
  answers loop more often than not; what PPD and Medusa learn from);
- `sharegpt`: the reply ShareGPT recorded for the prompt, the paper's data (section 3.1);
- `mix`: both.
A cheaper round adds to a trained adapter instead of starting afresh: `--from-adapter` continues it,
`--list-prompts-only` answers only the list-style prompts (the same ones held out), and
`--min-points` trains only on trees with that many points (the history of docs/results.md, "Round five": such
rounds forked less often than the shipped adapter).
The shipped adapter learned from the model's answers to 3000 prompts (5400 answers, two epochs). A
round of one epoch on 600 prompts, either source, forks on fewer held-out list prompts than it
(the history of docs/results.md, "A round that fits this CPU"): ShareGPT's replies give longer answers with more
threads, the model's own read more like the base model.

Cost of a round on a 2-core CPU (measured; the history of docs/results.md has the commands):
- the model's own answers: 25 minutes for the 959 list-style prompts of the 3000, greedy and sampled,
  384 tokens, 32 rows (`--list-prompts-only --answer-batch 32`: 300-319 tokens/s); about 47 minutes
  for 600 prompts with static batches (greedy 19, sampled 28: every batch ran until its longest
  answer ended, and 70% of greedy answers loop to the 384-token limit). Now a row takes the next
  prompt as soon as its answer ends (self_distill.answer_stream) and an answer stops once it loops
  (train_prompt.apar_answer_stop): 64 prompts at 512 tokens, greedy, 211 s before, 160 s with the
  rows refilled, 124 s stopped at the loop too, the same answers; ShareGPT's replies: seconds (they
  are read, not generated);
- training: a packed sequence's attention mask is dense, so attention grows with the square of its
  length; 512 tokens per step train 2.9x more tokens per second than 2048 (212 vs 73). Examples are
  160-490 tokens (prompt, threads and control tokens, 10th-90th percentile), so 512 packs one or two.
  An epoch of 536 examples (186k tokens) takes about 17 minutes in float32. With the products in
  bfloat16 (`--precision`, where the CPU has AVX512-BF16 or AMX) the same steps run 1.7-2.3x faster,
  and a round of 1968 examples on ShareGPT's replies ends with float32's held-out loss and [Fork]
  precision and recall (the history of docs/results.md, "Cheaper rounds").
- not done: the frozen base pass cannot be computed once and reused while every layer is adapted
  (layer 0's attention changes the first hidden states); adapting only the upper layers would allow
  it, untested here.
"""

import itertools
import re
from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from methods.apar import ADAPTED_LINEARS, adapted_linears, with_control_rows
from training.self_distill import held_out_prompts, training_prompts, usable_prompts
from tree import Tree

LIST_STYLE = re.compile(r"\b(list|tips|ways|steps|ideas|examples|benefits|advantages|disadvantages|reasons|"
                        r"outline|features|strategies|suggest\w*|top \d+)\b", re.I)


def looks_list_style(prompt: str) -> bool:
    """A request whose answer is likely a list of points (the prompts half the data is drawn from)."""
    return bool(LIST_STYLE.search(prompt))


def apar_prompts(count: int, tokenizer, max_prompt_tokens: int) -> list[str]:
    """Every usable list-style ShareGPT prompt (about 960 of its 11k first turns pass the rules of
    self_distill.usable_prompts), up to `count`, then other prompts to make `count`: those bring the
    code, math and prose answers that become negative examples, and many list answers too (the model
    often answers a plain question with a numbered list)."""
    lists = list(itertools.islice(usable_prompts(tokenizer, max_prompt_tokens, looks_list_style), count))
    others = training_prompts(count - len(lists), tokenizer, max_prompt_tokens, lambda p: not looks_list_style(p))
    return lists + others


def held_out_list_prompts(tokenizer, settings: list[tuple[int, int]]) -> list[str]:
    """The list-style prompts whose answers no adapter trained with any of these (records,
    max_prompt_tokens) settings saw: held out by one of them (self_distill.held_out_prompts, in
    their order) and trained on by none. Adapters trained on different prompt sets (600 prompts and
    3000, say) are so compared on the prompts none of them learned from."""
    trained, held_out = set(), []
    for records, max_prompt_tokens in settings:
        prompts = apar_prompts(records, tokenizer, max_prompt_tokens)
        kept_out = held_out_prompts(tokenizer, prompts)
        trained |= set(prompts) - set(kept_out)
        held_out += [p for p in kept_out if looks_list_style(p) and p not in held_out]
    return [p for p in held_out if p not in trained]


# ---- structure: the text rules of appendix B ----------------------------------------------------

POINT = re.compile(r"^(?:\d+\.|[-*•])[ \t]+(?=\S)", re.M)  # a point starts a line: "2. " or "- "
COLON_ROOT = re.compile(r"[^\n]{1,100}?:(?:\*\*)?(?=\s)")  # "Watering:" or "**Watering:**", in its first line
FIRST_WORDS = re.compile(r"(?:\S+[^\S\n]+){0,2}\S+")  # else its first three words (fewer on a short line)
UNSTRUCTURED = re.compile(r"```|https?://|www\.|\$|\\\(|\\\[|\d\s*[+*/^=×÷]\s*\d|\d\s+-\s+\d")  # code, URLs, math
# (but not "2013-2014" or "20-40-year-old")
FIRST_SENTENCE = re.compile(r"(?s)(.{10,}?[.!?])(?=\s+\S)")  # at least 10 characters, then more text
MIN_POINTS, MIN_POINT_CHARS = 3, 10
STRUCTURED = ("list", "paragraphs")  # the kinds of Structure that fork: the paragraph trees training teaches


@dataclass
class Point:
    root: str  # the parent thread writes it, then [Fork]; it starts with the separator after the last point
    detail: str  # the thread forked there writes it, then EOS; it ends without whitespace


@dataclass
class Structure:
    kind: str  # "list", "paragraphs", "unstructured", or "repetitive" (not used for training)
    points: list[Point]
    tail: str  # what the parent thread writes after its last [Fork] (everything, if unstructured)

    def text(self) -> str:
        """The answer again: roots and details in order, then the tail (what RESTORE yields)."""
        return "".join(p.root + p.detail for p in self.points) + self.tail


def structure(answer: str, loops_allowed: bool = False) -> Structure:
    """Read an answer as an ordered list, else as paragraphs, else as unstructured (appendix B).
    An answer that repeats itself is set apart: it would teach the model to loop. With
    `loops_allowed` it is read like any other (bench.py asks whether vanilla's answer has points)."""
    if repetitive(answer) and not loops_allowed:
        return Structure("repetitive", [], answer)
    if UNSTRUCTURED.search(answer):
        return Structure("unstructured", [], answer)
    return ordered_list(answer) or paragraphs(answer) or Structure("unstructured", [], answer)


def repetitive(answer: str) -> bool:
    """Two in five or more of its lines (list markers aside) repeat an earlier line, or some 8 words
    come 6 times: the small model's loops (most of its greedy answers that hit the length limit),
    which the data must not teach."""
    lines = [line_key(line) for line in answer.splitlines() if line.strip()]
    if len(lines) >= 4 and len(set(lines)) <= 0.6 * len(lines):
        return True
    counts = Counter(gram for _, gram in word_grams(answer))
    return bool(counts) and max(counts.values()) >= 6


def before_the_loop(answer: str) -> str:
    """What a looping answer wrote before it began to repeat itself: everything up to the first line
    that repeats an earlier one (list markers aside), or that holds a second time some 8 words the
    answer repeats 3 times or more (twice is often just a phrase the model likes). So it is not
    `repetitive`: no line comes twice, and no 8 words more than twice."""
    end, seen, offset = len(answer), set(), 0
    for line in answer.splitlines(keepends=True):
        key = line_key(line)
        if key and key in seen:
            end = offset
            break
        seen.add(key)
        offset += len(line)
    grams = list(word_grams(answer))
    looping = {gram for gram, count in Counter(gram for _, gram in grams).items() if count >= 3}
    met = set()
    for start, gram in grams:
        if gram in looping and gram in met:
            end = min(end, answer.rfind("\n", 0, start) + 1)  # the start of that line
            break
        met.add(gram)
    return answer[:end]


def line_key(line: str) -> str:
    """A line as the loop tests compare it: without its list marker, spaces or case."""
    return POINT.sub("", line).strip().lower()


def word_grams(answer: str, n: int = 8):
    """(offset of the first word, the n words lowered) for every run of n words in the answer."""
    words = list(re.finditer(r"\w+", answer))
    for i in range(len(words) - n + 1):
        yield words[i].start(), tuple(w.group().lower() for w in words[i:i + n])


def cut_points(answer: str, spans: list[tuple[int, int, int]]) -> tuple[list[Point], str]:
    """Points from (start, root end, end) spans of `answer`: text before a span joins its root, and
    the whitespace that ends a point moves to the start of the next root (or the tail), so that a
    child thread ends its detail with EOS right after the last word, and the separator between
    points is written by the parent, which has seen every earlier root and its separator."""
    points, pending = [], ""
    for start, root_end, end in spans:
        detail = answer[root_end:end].rstrip()
        points.append(Point(pending + answer[start:root_end], detail))
        pending = answer[root_end + len(detail):end]
    return points, pending


def ordered_list(answer: str) -> Structure | None:
    """At least 3 points (numbered, or bullets "- "), each detail at least 10 characters. A point's
    root runs to the colon of "root: detail" in its first line (appendix B's regular expression),
    else over its first three words; it runs to the next point, the last one to the next blank line,
    after which comes the tail. Text before the first point belongs to the first root."""
    starts = [m.start() for m in POINT.finditer(answer)]
    if len(starts) < MIN_POINTS:
        return None
    last_end = answer.find("\n\n", starts[-1])
    ends = starts[1:] + [len(answer) if last_end == -1 else last_end + 2]
    spans, previous = [], 0
    for start, end in zip(starts, ends):
        body = POINT.match(answer, start).end()
        root = COLON_ROOT.match(answer, body, end) or FIRST_WORDS.match(answer, body, end)
        if root is None or len(answer[root.end():end].strip()) < MIN_POINT_CHARS:
            return None
        spans.append((previous, root.end(), end))
        previous = end
    points, tail = cut_points(answer, spans)
    return Structure("list", points, tail + answer[ends[-1]:])


def paragraphs(answer: str) -> Structure | None:
    """Paragraphs (split at blank lines) of two or more sentences become root = first sentence,
    detail = the rest; a one-sentence paragraph is not split and joins the next root (or the tail).
    Needs at least two split paragraphs, so that two threads can run at once."""
    spans, start, offset = [], 0, 0
    for piece in re.split(r"(?<=\n\n)", answer):  # each paragraph keeps its trailing blank line
        first = FIRST_SENTENCE.match(piece)
        if first is not None:
            spans.append((start, offset + first.end(), offset + len(piece)))
            start = offset + len(piece)
        offset += len(piece)
    if len(spans) < 2:
        return None
    points, tail = cut_points(answer, spans)
    return Structure("paragraphs", points, tail + answer[start:])


# ---- layout: one sequence, a tree attention mask, and what each token must predict --------------

IGNORE = -100  # no loss at this token (F.cross_entropy's ignore_index)


@dataclass
class TrainingExample:
    tree: Tree  # prompt, then the threads' tokens; parents[i]: the token before i in its thread
    labels: list[int]  # labels[i]: the token the model must write after node i, or IGNORE
    kind: str  # the structure's kind
    points: int  # forks in the tree (an answer cut off has lost its last point)


class ThreadLayout:
    """Builds the flattened tree: each thread is a chain hung under the token it forked from, and
    each token's label is the next token of its own thread."""

    def __init__(self):
        self.tokens, self.parents, self.labels = [], [], []

    def chain(self, after: int, ids: list[int], learn_first: bool = True) -> int:
        """Hang `ids` as a chain under node `after` (-1: none); returns the chain's last node.
        learn_first=False: the first token is injected, not written by the model ([Child])."""
        for index, token in enumerate(ids):
            if after >= 0 and (index > 0 or learn_first):
                self.labels[after] = token
            self.tokens.append(token)
            self.parents.append(after)
            self.labels.append(IGNORE)
            after = len(self.tokens) - 1
        return after

    def end(self, node: int, eos: int) -> None:
        """The thread ends after `node`: the model must write EOS there."""
        self.labels[node] = eos


def training_example(prompt_ids: list[int], answer_ids: list[int], tokenizer, control) -> TrainingExample:
    """An answer as a paragraph tree ready for training. An answer cut off by the length limit (no
    EOS) loses its last point, which may be unfinished, and its parent thread's end gets no label:
    what would have come next is unknown. An answer that loops is cut off where its loop begins,
    if what comes before is a list; else it stays "repetitive" and is not used."""
    cut = not answer_ids or answer_ids[-1] not in tokenizer.eos_ids
    eos = next(iter(sorted(tokenizer.eos_ids))) if cut else answer_ids[-1]
    text = tokenizer.decode(answer_ids if cut else answer_ids[:-1])
    shape = structure(text)
    if shape.kind == "repetitive" and (before := structure(before_the_loop(text))).kind == "list":
        shape, cut = before, True  # the list it wrote before looping, as if the answer were cut off there
    if cut and shape.points:
        shape.points, shape.tail = shape.points[:-1], ""
    layout = ThreadLayout()
    node = layout.chain(-1, prompt_ids)
    layout.labels[:] = [IGNORE] * len(layout.labels)  # the prompt is given, not learned
    for point in shape.points:
        node = layout.chain(node, tokenizer.encode(point.root) + [control.fork])
        child = layout.chain(node, [control.child] + tokenizer.encode(point.detail), learn_first=False)
        layout.end(child, eos)
    if shape.tail:
        node = layout.chain(node, tokenizer.encode(shape.tail))
    if not cut:
        layout.end(node, eos)
    return TrainingExample(Tree(layout.tokens, layout.parents), layout.labels, shape.kind, len(shape.points))


# ---- the adapter: base weights + a low-rank update, merged at load time -----------------------

# ---- training: the loss on a paragraph tree ------------------------------------------------------

class AparAdapter(nn.Module):
    """What APAR fine-tuning changes: a rank-r update W + up @ down of each adapted Linear (LoRA, Hu
    et al. 2021; `up` starts at zero, so training starts from the base model) and the [Fork] /
    [Child] embedding rows. Forward hooks add the updates, so the base weights stay untouched."""

    def __init__(self, model, control, rank: int, seed: int, adapted=ADAPTED_LINEARS):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        linears = adapted_linears(model, adapted)  # name -> the Linear it updates
        self.names = list(linears)
        self.down, self.up = nn.ParameterDict(), nn.ParameterDict()
        for name, linear in linears.items():
            out_features, in_features = linear.weight.shape
            key = name.replace(".", "_")  # a ParameterDict key cannot hold dots
            self.down[key] = nn.Parameter(torch.randn(rank, in_features, generator=generator) * in_features ** -0.5)
            self.up[key] = nn.Parameter(torch.zeros(out_features, rank))
        self.control = nn.Parameter(model.embed.weight[[control.fork, control.child]].detach().clone())

    def attach(self, model) -> list:
        """Hook the updates into the model's Linears; returns the handles (call .remove() on each)."""
        def hook(key):
            return lambda module, inputs, output: output + (inputs[0] @ self.down[key].T) @ self.up[key].T
        modules = dict(model.named_modules())
        return [modules[name].register_forward_hook(hook(name.replace(".", "_"))) for name in self.names]

    def start_from(self, tensors: dict[str, torch.Tensor]) -> None:
        """Continue from a trained adapter's tensors (as `tensors` gives them) instead of the start
        above; its rank must be this one's."""
        with torch.no_grad():
            self.control.copy_(tensors["control_embeddings"])
            for name in self.names:
                key = name.replace(".", "_")
                self.down[key].copy_(tensors[f"{name}.down"])
                self.up[key].copy_(tensors[f"{name}.up"])

    def tensors(self) -> dict[str, torch.Tensor]:
        """As apply_adapter reads them."""
        made = {"control_embeddings": self.control}
        for name in self.names:
            key = name.replace(".", "_")
            made |= {f"{name}.down": self.down[key], f"{name}.up": self.up[key]}
        return made


def apar_logits(model, adapter: AparAdapter, control, examples: list) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [L, V] at the learned positions of paragraph-tree examples and their labels [L]: each
    whole tree in one pass, every token attending to its ancestors only (section 2.2, "Training
    attention"). Several examples are packed into one sequence with a block-diagonal mask (a tree
    never sees another), so a step feeds the accelerator more than one answer."""
    device = model.embed.weight.device
    tokens = torch.tensor([[t for e in examples for t in e.tree.tokens]], device=device)
    positions = torch.tensor([d for e in examples for d in e.tree.depths], device=device)
    mask = torch.block_diag(*(e.tree.ancestor_mask().to(torch.uint8) for e in examples)).bool().to(device)
    weight = with_control_rows(model.embed.weight, control, adapter.control)  # input and output rows
    hidden = model.hidden_states(embeds=F.embedding(tokens, weight), positions=positions, mask=mask)
    labels = torch.tensor([label for e in examples for label in e.labels], device=device)
    learned = labels != IGNORE
    return F.linear(hidden[0, learned], weight), labels[learned]


def packs(examples: list, max_tokens: int) -> list[list]:
    """Consecutive examples grouped so that each group holds at most `max_tokens` tokens (an example
    longer than that goes alone)."""
    groups, size = [], max_tokens
    for example in examples:
        if size + len(example.tree) > max_tokens:
            groups.append([])
            size = 0
        groups[-1].append(example)
        size += len(example.tree)
    return groups


def apar_examples(records, tokenizer, control, unstructured_share: float = 1.0, min_points: int = 0) -> list:
    """Paragraph-tree examples: every structured one (lists, paragraphs) with at least `min_points`
    points, then unstructured ones up to `unstructured_share` times as many (section 3.2 samples the
    two 1:1). Repetitive answers are left out (but for a list before the loop, see
    training_example): they would teach the model to loop."""
    examples = [training_example(r["prompt_ids"], r["answer_ids"], tokenizer, control) for r in records]
    structured = [e for e in examples if e.kind in STRUCTURED and e.points >= min_points]
    unstructured = [e for e in examples if e.kind == "unstructured"]
    return structured + unstructured[:max(round(unstructured_share * len(structured)), 1)]


@torch.no_grad()
def apar_evaluation(model, adapter, control, examples, max_tokens: int = 4096) -> dict:
    """Held-out loss, and how well [Fork] is placed when the model reads the true tree: precision
    and recall of "argmax is [Fork]" against "the label is [Fork]"."""
    loss, count, hits, predicted, actual = 0.0, 0, 0, 0, 0
    for group in packs(examples, max_tokens):
        logits, labels = apar_logits(model, adapter, control, group)
        loss += F.cross_entropy(logits, labels, reduction="sum").item()
        count += len(labels)
        says_fork, is_fork = logits.argmax(-1) == control.fork, labels == control.fork
        hits += int((says_fork & is_fork).sum())
        predicted += int(says_fork.sum())
        actual += int(is_fork.sum())
    return {"held_out_loss": round(loss / max(count, 1), 4),
            "fork_precision": round(hits / max(predicted, 1), 3), "fork_recall": round(hits / max(actual, 1), 3)}
