"""Train the small learned parts of the guessers by self-distillation, on this machine's CPU.

    python train_prompt.py data      # the model's own answers to ShareGPT prompts (cached)
    python train_prompt.py ppd       # PPD soft-token embeddings    -> trained/ppd-<model>.*
    python train_prompt.py medusa    # Medusa heads' ResBlocks      -> trained/medusa-<model>.*
    python train_prompt.py eagle     # an EAGLE draft head          -> trained/eagle-<model>.*
    python train_prompt.py apar      # APAR adapter + [Fork]/[Child] -> trained/apar-<model>.*

The base model stays frozen; only the new parameters learn, from the model's own text
(self_distill.py). Every run prints progress (loss, tokens/s, ETA), saves a resume point every few
steps (run the same command again to continue), and ends by measuring on held-out answers how often
the rank-r guess at distance d is right. Those accuracies are saved with the weights: decoding builds
its sparse trees from them (tree.py, ppd.py) and bench.py prints them.

This file holds the data split, the training loop the three share (`run_steps`: cosine learning
rate, progress, resume) and the subcommands; each method's loss lives with the method:
- PPD (Chen et al. 2024, section 3.3): ppd.ppd_loss, equation 1 on soft tokens inserted at random
  places of an answer, with the decoding mask;
- Medusa-1 (Cai et al. 2024, section 2.2.1): medusa.medusa_loss, on the frozen base model's hidden
  states, computed once and cached beside the data;
- EAGLE (Li et al. 2024, section 3.2; EAGLE-3's training-time test): eagle.eagle_loss on the frozen
  model's features of ShareGPT's recorded replies (or the model's own answers), computed once and cached;
- APAR (Liu et al. 2024, sections 2.2 and 3.1): apar_finetune.apar_logits, the paragraph tree in one
  pass with the tree attention mask; a rank-16 LoRA adapter (on each layer's attention projections,
  or the ones --adapt names) plus the two control tokens' rows. APAR
  ends with held-out loss and how well [Fork] is placed instead of guess accuracies.
"""

import argparse
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import errors  # noqa: F401 (imported before torch, so that Ctrl-C while torch loads is one line too)
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from methods import artifacts
from methods.apar import (ADAPTABLE_LINEARS, ADAPTED_LINEARS, CHILD_TOKEN, FORK_TOKEN, ControlTokens, adapted_in,
                  require_tied_embeddings)
from training.apar_finetune import (MIN_POINT_CHARS, STRUCTURED, AparAdapter, apar_evaluation, apar_examples, apar_logits,
                           apar_prompts, looks_list_style, packs, repetitive, structure, training_example)
from calibrate import cpu_name
from programs.convert import cache_root, default_model_dir
from drafters import TOP_RANKS
from errors import DefaultsHelpFormatter, OneLineErrorParser, UserError, integer, number, run_program, writable
from methods.eagle import DRAFT_VOCAB, EagleHead, draft_vocabulary, eagle_accuracy, eagle_loss
from methods.medusa import MedusaHeads, medusa_accuracy, medusa_loss
from methods.registry import refuse_idle
from checkpoint import load_checkpoint, parse_device
from methods.ppd import SoftTokens, guess_hits, initial_embeddings, ppd_loss
from programs.progress import Progress
from sampling import Sampling
from training.self_distill import (VALIDATION_EVERY, answer_positions, answer_stream, base_pass, generate_answers,
                          held_out_prompts, read_records, recorded_answers, sequence, sharegpt_answers, split_records,
                          training_prompts, write_records)
from programs.staging import staged_file
from tokenizer import Tokenizer, check_fits

MAX_HEADS = 7
MAX_STEPS_MEASURED = 4  # EAGLE's held-out accuracy per draft step, 1..4
SAMPLED = Sampling(temperature=0.7, top_p=0.9)  # APAR's extra self-distilled answers
LEARNING_RATE = number(1e-8, 10.0)  # nan, inf, 0 or a negative rate would train nothing, silently


# ---- data ---------------------------------------------------------------------------------------

def data_file(model, folder: Path, args, prompts: str = "") -> Path:
    """Where the model's answers to `prompts` ("": all of them, "-list-prompts" or "-other-prompts")
    are cached, per model and settings."""
    # APAR asks other prompts, for longer answers, and stops an answer once it loops (apar_answer_stop)
    kind = "apar-stopped-at-loops" if args.command == "apar" else "answers"
    name = f"{kind}{prompts}-{args.records}-prompt{args.max_prompt_tokens}-new{args.max_new_tokens}.jsonl"
    return cache_root() / "distill" / f"{folder.name}-{artifacts.model_fingerprint(model)['weights_sha256']}" / name


def answers(model, tokenizer, folder, args) -> tuple[list[dict], list[dict]]:
    """(training, held-out) records {"prompt_ids", "answer_ids"}. The model's own answers (generated
    once and cached): the greedy answer to every prompt and, for APAR, --sampled-answers more drawn at
    SAMPLED (the small model's greedy answers loop more often than not; drawn ones far less). For
    APAR, --answers also offers ShareGPT's recorded replies to the same prompts, both,
    structured_list_answers or sharegpt_points_answers. A prompt's answers are all held out or all trained on."""
    list_prompts_only = getattr(args, "list_prompts_only", False)
    args.data = data_file(model, folder, args, "-list-prompts" if list_prompts_only else "")
    source = getattr(args, "answers", "model")
    choose = apar_prompts if args.command == "apar" else training_prompts
    prompts = choose(args.records, tokenizer, args.max_prompt_tokens)
    held_out = held_out_prompts(tokenizer, prompts)  # the whole set's, also when only its list prompts are answered
    if list_prompts_only:
        prompts, _ = by_style(prompts)
    if source == "structured-lists":
        files = structured_list_answers(model, tokenizer, folder, prompts, args)
    elif source == "sharegpt-points":
        files = sharegpt_points_answers(model, tokenizer, folder, prompts, args)
    else:
        files = model_answers(model, tokenizer, args.data, prompts, args) if source in ("model", "mix") else []
        if source in ("sharegpt", "mix"):
            files.append(sharegpt_replies(tokenizer, prompts, args))
    splits = [split_records(records, tokenizer, held_out) for records in files]
    return [r for training, _ in splits for r in training], [r for _, held in splits for r in held]


def model_answers(model, tokenizer, path: Path, prompts: list[str], args) -> list[list[dict]]:
    """The model's greedy answers to `prompts`, and for APAR --sampled-answers sampled ones: one list
    of records per file, each made once and cached at `path` (the sampled ones beside it)."""
    print(f"self-distilled answers: {path}", file=sys.stderr)
    stop = apar_answer_stop(tokenizer) if args.command == "apar" else None
    files = [generate_answers(model, tokenizer, path, prompts, max_new_tokens=args.max_new_tokens,
                              batch_size=args.answer_batch, stop=stop)]
    for copy in range(getattr(args, "sampled_answers", 0)):
        files.append(generate_answers(model, tokenizer, path.with_name(f"{path.stem}-sampled{copy}.jsonl"),
                                      prompts, max_new_tokens=args.max_new_tokens, batch_size=args.answer_batch,
                                      sampling=SAMPLED, seed=1_000_003 * copy, stop=stop))
    return files


def sharegpt_replies(tokenizer, prompts: list[str], args) -> list[dict]:
    replies = [r for r in recorded_answers(tokenizer, prompts, args.max_new_tokens) if r is not None]
    print(f"ShareGPT's recorded replies to {len(replies)} of the {len(prompts)} prompts", file=sys.stderr)
    return replies


def by_style(prompts: list[str]) -> tuple[list[str], list[str]]:
    """(the list-style prompts, the others), each in order: APAR's --answers that treat them apart."""
    style = [looks_list_style(p) for p in prompts]
    return [p for p, s in zip(prompts, style) if s], [p for p, s in zip(prompts, style) if not s]


def answers_to_others(model, tokenizer, folder: Path, others: list[str], args) -> list[list[dict]]:
    """The model's own answers to the prompts that are not list-style (model_answers, cached apart)."""
    return model_answers(model, tokenizer, data_file(model, folder, args, "-other-prompts"), others, args)


def structured_list_answers(model, tokenizer, folder: Path, prompts: list[str], args) -> list[list[dict]]:
    """--answers structured-lists (APAR): on a list-style prompt only answers with structure, the
    model's own and ShareGPT's recorded reply; on every other prompt the model's own answers, whatever
    their form. Why: an unstructured answer to a list-style prompt is a negative example that teaches
    "no list here" (a round on list prompts only forked on 50% of held-out lists with those negatives,
    62% without), and the small model writes no list for most list-style prompts, where the recorded
    replies do. The negatives then come from code, math and prose prompts, in the model's own words."""
    control = ControlTokens.of(tokenizer)
    lists, others = by_style(prompts)

    def structured(records):
        return [r for r in records
                if training_example(r["prompt_ids"], r["answer_ids"], tokenizer, control).kind in STRUCTURED]

    list_answers = model_answers(model, tokenizer, data_file(model, folder, args, "-list-prompts"), lists, args)
    list_answers.append(sharegpt_replies(tokenizer, lists, args))
    return ([structured(records) for records in list_answers]
            + answers_to_others(model, tokenizer, folder, others, args))


# The longest detail (written up to its line's end) and closing text the model may write into a
# recorded reply's points; a detail that runs longer has lost its line's end and drops the reply.
DETAIL_TOKENS, TAIL_TOKENS = 128, 128


def sharegpt_points_answers(model, tokenizer, folder: Path, prompts: list[str], args) -> list[list[dict]]:
    """--answers sharegpt-points (APAR): on a list-style prompt ShareGPT's recorded reply, if it has
    structure, with every point's detail written anew by the model (in_the_models_words); on every
    other prompt the model's own answers, as with structured-lists. Why: ShareGPT's replies teach lists
    where the model writes none (round two forked on 56-66% of held-out lists) but in another's words
    (1.37-1.46x vanilla's perplexity), the model's own answers the reverse; a reply kept whole or the
    model's kept whole, per prompt, gave neither both (the history of docs/results.md, rounds two and six). Here a
    point's root is ShareGPT's and what the child thread writes, most of an answer, the model's."""
    lists, others = by_style(prompts)
    path = data_file(model, folder, args, "-sharegpt-points")
    if not (rewritten := read_records(path)):
        rewritten = in_the_models_words(model, tokenizer, lists, args)
        write_records(path, rewritten)
    print(f"ShareGPT's points in the model's words: {len(rewritten)} replies ({path})", file=sys.stderr)
    return [rewritten] + answers_to_others(model, tokenizer, folder, others, args)


def in_the_models_words(model, tokenizer, prompts: list[str], args) -> list[dict]:
    """Records {"prompt_ids", "answer_ids"} of ShareGPT's structured replies to `prompts` (lists and
    paragraph trees by apar_finetune.structure), each root as recorded and each detail the model's
    greedy continuation of the answer so far and that root, up to the end of its line; after the last
    point, if the reply had closing text, the model writes its own. Point k of every reply is written
    in one batch (self_distill.answer_stream). A reply is dropped if a detail runs past DETAIL_TOKENS
    or is shorter than a point's detail may be; it ends early where the model ends it (EOS after a
    detail) or where it reaches --max-new-tokens (then cut there, as recorded replies are)."""
    eos = min(tokenizer.eos_ids)
    line_ends = {i for i in range(len(tokenizer.vocabulary())) if "\n" in tokenizer.decode([i])}
    replies, drafts = sharegpt_answers(prompts), []
    for prompt in prompts:
        shape = structure(replies.get(prompt, ""))
        if shape.kind in STRUCTURED:
            drafts.append(Draft(tokenizer.prompt_ids(prompt, raw=False), [p.root for p in shape.points],
                                bool(shape.tail.strip())))
    for k in range(max((len(d.roots) for d in drafts), default=0)):
        asking = [d for d in drafts if d.writing and k < len(d.roots)]
        if not asking:  # the replies with more points ended or were dropped before this one
            break
        texts = [d.text + d.roots[k] for d in asking]
        details = continuations(model, [d.prompt_ids + tokenizer.encode(t) for d, t in zip(asking, texts)],
                                DETAIL_TOKENS, tokenizer.eos_ids | line_ends, args)
        for draft, text, ids in zip(asking, texts, details):
            detail = tokenizer.decode(ids).split("\n")[0].rstrip()
            if len(ids) == DETAIL_TOKENS and ids[-1] not in line_ends or len(detail.strip()) < MIN_POINT_CHARS:
                draft.writing = draft.kept = False
                continue
            draft.text = text + detail
            draft.ended = ids[-1] in tokenizer.eos_ids
            draft.writing = not draft.ended and len(tokenizer.encode(draft.text)) < args.max_new_tokens
            draft.written = k + 1
        print(f"ShareGPT's points in the model's words: point {k + 1}, {len(asking)} replies", file=sys.stderr)
    closing = [d for d in drafts if d.kept and d.written == len(d.roots) and d.closing and not d.ended]
    tails = continuations(model, [d.prompt_ids + tokenizer.encode(d.text + "\n\n") for d in closing],
                          TAIL_TOKENS, tokenizer.eos_ids, args, stop=apar_answer_stop(tokenizer))
    for draft, ids in zip(closing, tails):
        if ids and ids[-1] in tokenizer.eos_ids:  # else no closing text: the answer ends after its last point
            draft.text += "\n\n" + tokenizer.decode(ids).rstrip()
    return [{"prompt_ids": d.prompt_ids, "answer_ids": (tokenizer.encode(d.text) + [eos])[:args.max_new_tokens]}
            for d in drafts if d.kept]


@dataclass
class Draft:
    """A recorded reply being rewritten: its roots, and the answer so far (roots and the model's details)."""
    prompt_ids: list[int]
    roots: list[str]
    closing: bool  # whether the recorded reply had text after its last point
    text: str = ""
    written: int = 0  # points written
    writing: bool = True
    ended: bool = False  # the model wrote EOS after a detail
    kept: bool = True


def continuations(model, contexts: list[list[int]], max_new_tokens: int, ends: set[int], args, stop=None):
    """The model's greedy continuation of each context (token ids), up to a token of `ends` or
    max_new_tokens, in the contexts' order."""
    if not contexts:
        return []
    found = dict(answer_stream(model, contexts, max_new_tokens, ends, rows=args.answer_batch, stop=stop))
    return [found[i] for i in range(len(contexts))]


def apar_answer_stop(tokenizer):
    """APAR's data rules train on no part of a looping answer after its loop begins (before_the_loop),
    so its answer is stopped once it is `repetitive`. On the answers to 600 list-style prompts at 384
    tokens that saves 37% of the greedy answers' tokens and 15% of the sampled ones', and the list
    kept before the loop is the same in 396 of the 396 greedy answers that loop, 197 of 201 sampled."""
    return lambda answer_ids: repetitive(tokenizer.decode(answer_ids))


# ---- PPD ----------------------------------------------------------------------------------------

def train_ppd(model, tokenizer, training, held_out, args) -> tuple[dict, dict]:
    soft_tokens = SoftTokens(initial_embeddings(model, args.soft_tokens, args.ensembles, args.seed))
    optimizer = torch.optim.AdamW(soft_tokens.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = args.epochs * len(training)

    def step_loss(step):
        epoch, index = divmod(step, len(training))
        order = torch.randperm(len(training), generator=torch.Generator().manual_seed(args.seed + epoch))
        record = training[order[index]]
        loss = ppd_record_loss(model, soft_tokens, record, args.insertions,
                               torch.Generator().manual_seed(args.seed * 100003 + step))
        return loss, min(args.insertions, len(record["answer_ids"])) * args.soft_tokens

    run_steps(soft_tokens, optimizer, total_steps, step_loss, args)
    accuracy = ppd_accuracy(model, soft_tokens, held_out, args.insertions)
    return {"embeddings": soft_tokens.embeddings}, {"soft_tokens": args.soft_tokens,
                                                    "ensembles": args.ensembles, "accuracy": accuracy}


def ppd_record_loss(model, soft_tokens: SoftTokens, record, insertions: int, generator) -> torch.Tensor | None:
    """ppd.ppd_loss on one answer, soft tokens inserted after `insertions` random answer positions
    that have teachers for all m (None when the answer is too short for any)."""
    tokens = sequence(record)
    usable = [t for t in answer_positions(record) if t + soft_tokens.count < len(tokens)]
    if not usable:
        return None
    pick = torch.randperm(len(usable), generator=generator)[:insertions].sort().values
    hidden, prefix = base_pass(model, tokens)
    return ppd_loss(model, soft_tokens, hidden, prefix, [usable[i] for i in pick])


@torch.no_grad()
def ppd_accuracy(model, soft_tokens: SoftTokens, records, insertions: int) -> list[list[float]]:
    """accuracy[d][r]: how often the rank-r guess of soft token d+1 is the answer's actual token
    d+1 places after the next one, at `insertions` evenly spread points per held-out answer."""
    hits, total = torch.zeros(soft_tokens.count, TOP_RANKS), 0
    for record in records:
        tokens = sequence(record)
        usable = [t for t in answer_positions(record) if t + soft_tokens.count + 1 < len(tokens)]
        if not usable:
            continue
        points = usable[::max(1, len(usable) // insertions)]
        _, prefix = base_pass(model, tokens)
        hits += guess_hits(model, soft_tokens, prefix, tokens, points)
        total += len(points)
    return (hits / max(total, 1)).tolist()


# ---- Medusa -------------------------------------------------------------------------------------

@torch.no_grad()
def answer_features(model, records) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model's final hidden states at every answer position [M, D], and the sequence's
    tokens after each position [M, 8] (-1 past the end): head k's target is column k. Progress on
    stderr."""
    hidden, targets = [], []
    progress = Progress("base model's hidden states")
    for i, record in enumerate(records):
        tokens = sequence(record)
        states, _ = base_pass(model, tokens)
        positions = answer_positions(record)
        hidden.append(states[positions.start:positions.stop])
        padded = torch.tensor(tokens + [-1] * 8)
        targets.append(torch.stack([padded[t + 1:t + 9] for t in positions]))
        progress.update(f"{i + 1}/{len(records)} answers")
    progress.done(f"{len(records)} answers")
    return torch.cat(hidden), torch.cat(targets)


def cached_answer_features(model, records, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """answer_features, computed once per data file and kept beside it (the base model is frozen)."""
    if path.is_file():
        saved = load_file(path)
        return saved["hidden"], saved["targets"]
    hidden, targets = answer_features(model, records)
    with staged_file(path) as tmp:
        save_file({"hidden": hidden.contiguous(), "targets": targets.contiguous()}, tmp)
    return hidden, targets


def train_medusa(model, tokenizer, training, held_out, args) -> tuple[dict, dict]:
    features = args.data.parent / f"{args.data.stem}-features"
    hidden, targets = cached_answer_features(model, training, features.with_name(features.name + "-training.safetensors"))
    heads = MedusaHeads(model.config.hidden_size, args.heads)
    optimizer = torch.optim.AdamW(heads.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(hidden) / args.batch_tokens)

    def step_loss(step):
        epoch, index = divmod(step, steps_per_epoch)
        order = torch.randperm(len(hidden), generator=torch.Generator().manual_seed(args.seed + epoch))
        batch = order[index * args.batch_tokens:(index + 1) * args.batch_tokens]
        return medusa_loss(model, heads, hidden[batch], targets[batch]), len(batch)

    run_steps(heads, optimizer, args.epochs * steps_per_epoch, step_loss, args)
    held_out_features = cached_answer_features(model, held_out, features.with_name(features.name + "-held-out.safetensors"))
    accuracy = medusa_accuracy(model, heads, *held_out_features)
    tensors = {name: p for name, p in heads.state_dict().items()}
    return tensors, {"heads": args.heads, "accuracy": accuracy}


# ---- EAGLE --------------------------------------------------------------------------------------

FEATURE_CHUNK = 100  # records per file of cached features: an interrupted computation keeps its finished files


@torch.no_grad()
def sequence_features(model, records) -> dict[str, torch.Tensor]:
    """The frozen model's features (final hidden states) at every position of each record's prompt and
    answer, one pass each, stored in bfloat16 (half the bytes; the head trains in float32) with where
    each sequence starts, its tokens and where its answer starts."""
    features, tokens, starts, answer_starts = [], [], [0], []
    for record in records:
        ids = sequence(record)
        states, _ = base_pass(model, ids)
        features.append(states.to(torch.bfloat16))
        tokens += ids
        starts.append(starts[-1] + len(ids))
        answer_starts.append(len(record["prompt_ids"]))
    return {"features": torch.cat(features), "tokens": torch.tensor(tokens), "starts": torch.tensor(starts),
            "answer_starts": torch.tensor(answer_starts)}


def cached_sequence_features(model, records, path: Path) -> list[tuple[torch.Tensor, torch.Tensor, int]]:
    """sequence_features, computed once per data file and kept beside it (the model is frozen) in files
    of FEATURE_CHUNK records (path-0.safetensors, ...), so that a stopped run resumes at its last file; as
    (features [T, D] float32, tokens [T], answer start) per record. Progress on stderr."""
    sequences = []
    progress = Progress("base model's features")
    for first in range(0, len(records), FEATURE_CHUNK):
        part = path.with_name(f"{path.stem}-{first // FEATURE_CHUNK}{path.suffix}")
        if part.is_file():
            saved = load_file(part)
        else:
            saved = sequence_features(model, records[first:first + FEATURE_CHUNK])
            part.parent.mkdir(parents=True, exist_ok=True)
            with staged_file(part) as tmp:
                save_file(saved, tmp)
        starts = saved["starts"].tolist()
        sequences += [(saved["features"][a:b].float(), saved["tokens"][a:b], int(answer))
                      for a, b, answer in zip(starts, starts[1:], saved["answer_starts"].tolist())]
        progress.update(f"{len(sequences)}/{len(records)} sequences")
    progress.done(f"{len(records)} sequences, {sum(len(tokens) for _, tokens, _ in sequences)} tokens")
    return sequences


def train_eagle(model, tokenizer, training, held_out, args) -> tuple[dict, dict]:
    name = f"{args.data.stem}-eagle-{args.answers}"
    sequences = cached_sequence_features(model, training, args.data.with_name(name + "-training.safetensors"))
    draft_ids = draft_vocabulary([r["answer_ids"] for r in training], model.config.vocab_size, args.draft_vocab)
    torch.manual_seed(args.seed)
    head = EagleHead(model.config, draft_ids).use_lm_head(model.lm_head)
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    steps_per_epoch = math.ceil(len(sequences) / args.batch_records)

    def step_loss(step):
        epoch, index = divmod(step, steps_per_epoch)
        order = torch.randperm(len(sequences), generator=torch.Generator().manual_seed(args.seed + epoch))
        batch = order[index * args.batch_records:(index + 1) * args.batch_records].tolist()
        generator = torch.Generator().manual_seed(args.seed + step)
        loss = sum(eagle_loss(model, head, *sequences[i], steps=args.steps, generator=generator) for i in batch)
        return loss / len(batch), sum(len(sequences[i][1]) for i in batch)

    run_steps(head, optimizer, args.epochs * steps_per_epoch, step_loss, args)
    held_out_sequences = cached_sequence_features(model, held_out, args.data.with_name(name + "-held-out.safetensors"))
    accuracy = eagle_accuracy(model, head.eval(), held_out_sequences, MAX_STEPS_MEASURED, TOP_RANKS)
    tensors = {k: v for k, v in head.state_dict().items()}
    return tensors, {"draft_vocab": len(draft_ids), "steps": args.steps, "answers": args.answers,
                     "accuracy": accuracy}


# ---- APAR ---------------------------------------------------------------------------------------

def train_apar(model, tokenizer, training, held_out, args) -> tuple[dict, dict]:
    require_tied_embeddings(model)
    adapted = [name for name in ADAPTABLE_LINEARS if name in args.adapt]  # (in one order, each once)
    control = ControlTokens.of(tokenizer)
    training, held_out = (apar_examples(r, tokenizer, control, args.unstructured_share, args.min_points)
                          for r in (training, held_out))
    kinds = {kind: sum(e.kind == kind for e in training) for kind in ("list", "paragraphs", "unstructured")}
    deciles = length_deciles(training)
    print(f"APAR examples: {kinds} for training, {len(held_out)} held out; tokens per example (prompt, "
          f"threads and control tokens), deciles: {deciles}", file=sys.stderr)
    order = torch.randperm(len(training), generator=torch.Generator().manual_seed(args.seed)).tolist()
    steps = packs([training[i] for i in order], args.batch_tokens)  # each step: examples packed in one sequence
    adapter = AparAdapter(model, control, args.rank, args.seed, adapted).to(model.device)
    tensors, started_from = args.earlier_adapter or (None, None)
    if tensors is not None:
        adapter.start_from(tensors)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=0.0)
    handles = adapter.attach(model)

    args.precision = precision = matmul_precision(args.precision, model.device)  # recorded as resolved
    print(f"training's matrix products in {precision}", file=sys.stderr)

    def step_loss(step):
        epoch, index = divmod(step, len(steps))
        group = steps[torch.randperm(len(steps), generator=torch.Generator().manual_seed(args.seed + epoch))[index]]
        return apar_loss(model, adapter, control, group, precision), sum(len(e.tree) for e in group)

    try:
        run_steps(adapter, optimizer, args.epochs * len(steps), step_loss, args)
        evaluation = apar_evaluation(model, adapter, control, held_out, args.batch_tokens)
    finally:
        for handle in handles:
            handle.remove()
    return adapter.tensors(), {"rank": args.rank, "adapted": adapted, "examples": kinds,
                               "tokens_per_example_deciles": deciles,
                               "control_tokens": {"fork": FORK_TOKEN, "child": CHILD_TOKEN}, **evaluation,
                               **({"started_from": started_from} if started_from else {})}


def earlier_adapter(model, args) -> tuple[dict, dict]:
    """--from-adapter: its tensors, and what the new adapter's JSON records of it (where it was and how
    it was trained). It must have held out the prompts this round holds out (the same --records and
    --max-prompt-tokens), or a prompt one of the two learned from could be measured as held out."""
    tensors, meta = artifacts.load(args.from_adapter, "apar", model)
    settings = meta.get("training", {}).get("settings", {})
    for option in ("records", "max_prompt_tokens"):
        if settings.get(option) != getattr(args, option):
            flag = "--" + option.replace("_", "-")
            raise UserError(f"--from-adapter {args.from_adapter} was trained with {flag} {settings.get(option)}, "
                            f"this round has {getattr(args, option)}: give it the same, so that both hold out "
                            f"the same prompts")
    found = next(t.shape[0] for name, t in tensors.items() if name.endswith(".down"))
    if found != args.rank:
        raise UserError(f"--from-adapter {args.from_adapter} has rank {found}; give --rank {found}")
    adapted = adapted_in(tensors)
    if set(adapted) != set(args.adapt):
        raise UserError(f"--from-adapter {args.from_adapter} adapts {' '.join(adapted)}; give --adapt {' '.join(adapted)}")
    return tensors, {"adapter": str(args.from_adapter), "training": {k: v for k, v in meta["training"].items()
                                                                      if k != "runs"}}


def apar_loss(model, adapter, control, examples, precision: str = "float32") -> torch.Tensor:
    """The cross-entropy of a packed step. In bfloat16 the forward pass's matrix products run in
    bfloat16 (autocast: the weights, the adapter and the optimizer stay float32): 1.7-2.3x the tokens
    per second of float32 on a 2-core CPU with AVX512-BF16 (apar_finetune.py, "Cost of a round")."""
    with torch.autocast(model.device.type, dtype=torch.bfloat16, enabled=precision == "bfloat16"):
        logits, labels = apar_logits(model, adapter, control, examples)
    return F.cross_entropy(logits.float(), labels)


def matmul_precision(asked: str, device: torch.device) -> str:
    """--precision auto: bfloat16 where the device multiplies it natively (a CPU with AVX512-BF16 or
    AMX, a GPU that supports it), float32 elsewhere (emulated bfloat16 is slower than float32)."""
    if asked != "auto":
        return asked
    native = torch.cuda.is_bf16_supported() if device.type == "cuda" else (torch.backends.mkldnn.is_available()
                                                                        and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return "bfloat16" if native else "float32"


def length_deciles(examples) -> list[int]:
    """The 10th, 20th, ..., 90th percentile of the examples' lengths, what --batch-tokens packs."""
    lengths = sorted(len(e.tree) for e in examples)
    return [lengths[len(lengths) * k // 10] for k in range(1, 10)] if lengths else []


# ---- the loop they share ------------------------------------------------------------------------

def run_steps(module, optimizer, total_steps: int, step_loss, args) -> None:
    """Optimise with a cosine learning rate from args.lr to 0 (PPD section 5), printing progress and
    saving a resume point every args.save_every steps (resumed when the same command runs again).
    Sets args.runs: each run's steps, seconds and machine (a round may be split across runs, on a CPU
    and a GPU), counted up to its last resume point, so the steps it lost are not counted."""
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
    resume = cache_root() / "train" / f"{args.out.name}.resume.pt"
    step, earlier_runs = 0, []
    state = read_resume_point(resume)
    if state is not None:
        if state["settings"] == settings(args):
            module.load_state_dict(state["module"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            step, earlier_runs = state["step"], state["runs"]
            print(f"resuming from {resume} at step {step}/{total_steps}", file=sys.stderr)
    started, tokens, recent = time.perf_counter(), 0, []
    first, machine = step, this_machine(next(module.parameters()).device)
    args.runs = earlier_runs
    progress = Progress("training")
    while step < total_steps:
        loss, step_tokens = step_loss(step)
        if loss is not None:
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            recent = (recent + [loss.item()])[-20:]
        schedule.step()
        step, tokens = step + 1, tokens + step_tokens
        elapsed = time.perf_counter() - started
        eta = elapsed / (step - first) * (total_steps - step)
        progress.update(f"step {step}/{total_steps}  loss {sum(recent) / max(len(recent), 1):.4f}  "
                        f"{tokens / elapsed:.0f} tokens/s  ETA {eta / 60:.1f} min")
        if step % args.save_every == 0 or step == total_steps:
            args.runs = earlier_runs + [{"steps": [first, step], "seconds": round(elapsed, 1), "machine": machine}]
            resume.parent.mkdir(parents=True, exist_ok=True)
            with staged_file(resume) as tmp:
                torch.save({"settings": settings(args), "step": step, "runs": args.runs, "module": module.state_dict(),
                            "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}, tmp)
    progress.done(f"{total_steps} steps  loss {sum(recent) / max(len(recent), 1):.4f}")
    args.final_loss = sum(recent) / max(len(recent), 1)


def read_resume_point(path: Path) -> dict | None:
    """A saved resume point, or None: there is none, or it cannot be read (then training starts over)."""
    if not path.is_file():
        return None
    try:
        state = torch.load(path, weights_only=True, map_location="cpu")  # (load_state_dict moves it to the device)
    except Exception as err:  # torch.load raises many kinds on a damaged file; starting over is always safe
        print(f"ignoring the unreadable resume point {path} ({type(err).__name__}); starting over", file=sys.stderr)
        return None
    if "runs" not in state:  # made before runs were recorded: resuming would leave its time out of the record
        print(f"ignoring the resume point {path} of an older version; starting over", file=sys.stderr)
        return None
    return state


def this_machine(device: torch.device) -> str:
    """Where a run trained, for the trained part's record."""
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else f"{cpu_name()}, {os.cpu_count()} cores"
    return f"{where}, torch {torch.__version__}"


def settings(args) -> dict:
    """The options that shape training: a resume point made with others is ignored. The device is not
    one of them: a round started on a GPU may end on a CPU, and the other way round."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in ("save_every", "final_loss", "runs", "data", "answer_batch", "command_parser", "device",
                         "earlier_adapter")}


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="train_prompt.py", description=__doc__.split("\n\n")[0],
                           formatter_class=DefaultsHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="{data,ppd,medusa,eagle,apar}")

    def command(name, summary, training=True, records=480, max_new_tokens=192, max_prompt_tokens=192, epochs=1):
        """A subcommand with the options all share, at this subcommand's defaults (each gets its own
        options: argparse's set_defaults on a subcommand would change a shared parent's for all)."""
        sub = commands.add_parser(name, help=summary, formatter_class=DefaultsHelpFormatter)
        sub.set_defaults(command_parser=sub)  # its own defaults, for refuse_idle
        sub.add_argument("--model", type=Path, metavar="DIR", help="a Hugging Face Llama checkpoint folder "
                         "(default: the embedded SmolLM2-135M-Instruct)")
        sub.add_argument("--records", type=integer(VALIDATION_EVERY, 100_000), default=records,
                         help=f"ShareGPT prompts to answer, {VALIDATION_EVERY}..100000 (every {VALIDATION_EVERY}th "
                              "is held out)")
        sub.add_argument("--max-new-tokens", type=integer(1, 4096), default=max_new_tokens,
                         help="longest self-distilled answer, 1..4096 tokens")
        sub.add_argument("--max-prompt-tokens", type=integer(1, 4096), default=max_prompt_tokens,
                         help="longer ShareGPT prompts are skipped (1..4096)")
        sub.add_argument("--answer-batch", type=integer(1, 1024), default=16,
                         help="prompts answered at once while making the data, 1..1024")
        if training:
            sub.add_argument("--out", type=Path, help="where to write NAME.safetensors and NAME.json "
                             "(default: trained/<method>-<model folder>)")
            sub.add_argument("--epochs", type=integer(1, 1000), default=epochs,
                             help="passes over the training answers, 1..1000")
            sub.add_argument("--seed", type=integer(0, 2**63 - 1), default=0, help="initialisation and data order")
            sub.add_argument("--save-every", type=integer(1, 1_000_000), default=25, help="steps between resume points")
        return sub

    command("data", "generate the self-distilled answers only", training=False)
    ppd = command("ppd", "train PPD's soft-token embeddings (the paper's prompt tokens)")
    ppd.add_argument("--soft-tokens", type=integer(1, TOP_RANKS), default=3,
                     help=f"m: soft tokens (distances 1..m), 1..{TOP_RANKS}")
    ppd.add_argument("--ensembles", type=integer(1, 16), default=1, help="n: EPTs per soft token, 1..16")
    ppd.add_argument("--insertions", type=integer(1, 1024), default=32,
                     help="insertion points per answer per step, 1..1024")
    ppd.add_argument("--lr", type=LEARNING_RATE, default=0.01, help="peak learning rate (cosine to 0)")
    # an epoch is a few minutes once the hidden states are cached
    medusa = command("medusa", "train Medusa heads", epochs=4)
    medusa.add_argument("--heads", type=integer(1, MAX_HEADS), default=3,
                        help=f"K: heads (distances 1..K), 1..{MAX_HEADS}")
    medusa.add_argument("--batch-tokens", type=integer(1, 65536), default=256,
                        help="answer positions per step, 1..65536")
    medusa.add_argument("--lr", type=LEARNING_RATE, default=1e-3, help="peak learning rate (cosine to 0)")
    eagle = command("eagle", "train an EAGLE draft head (its features from one pass of the model over each "
                    "answer)", records=4000, epochs=5)
    eagle.add_argument("--answers", choices=["sharegpt", "model"], default="sharegpt",
                       help="what the head learns from: ShareGPT's recorded replies run through the model once "
                            "(EAGLE's data), or the model's own greedy answers (self-distillation; generated once)")
    eagle.add_argument("--steps", type=integer(1, 8), default=2,
                       help="draft steps unrolled per position while training (EAGLE-3's training-time test; "
                            "1: EAGLE's teacher-forced training)")
    eagle.add_argument("--draft-vocab", type=integer(1, 1_000_000), default=DRAFT_VOCAB,
                       help="tokens the head drafts among: the most frequent in the training answers")
    eagle.add_argument("--batch-records", type=integer(1, 4096), default=4, help="sequences per step")
    eagle.add_argument("--lr", type=LEARNING_RATE, default=1e-3, help="peak learning rate (cosine to 0)")
    # the shipped adapter's round (answers must end with EOS to become paragraph trees, so they may be
    # longer; prompts shorter); a cheaper round on a 2-core CPU: apar_finetune.py, "Cost of a round"
    apar = command("apar", "fine-tune for APAR: a low-rank adapter and the [Fork]/[Child] embeddings (its own "
                   "prompts: list-style ones first, then others)", records=3000, max_new_tokens=512,
                   max_prompt_tokens=192, epochs=2)
    apar.add_argument("--answers", choices=["model", "sharegpt", "mix", "structured-lists", "sharegpt-points"],
                      default="model",
                      help="what the adapter learns to write: the model's own answers (greedy and sampled), "
                           "ShareGPT's recorded replies to the same prompts (the paper's data), both, "
                           "structured-lists: on list-style prompts only structured answers (the model's and "
                           "ShareGPT's), on the others the model's own answers, or sharegpt-points: on list-style "
                           "prompts ShareGPT's structured replies with every point's detail written by the model, "
                           "on the others the model's own answers")
    apar.add_argument("--list-prompts-only", action="store_true",
                      help="answer only the list-style prompts among the --records ones (the same held out as "
                           "with all of them): a cheaper round that adds list data")
    apar.add_argument("--sampled-answers", type=integer(0, 8), default=1,
                      help=f"model's answers per prompt drawn at temperature {SAMPLED.temperature}, top-p "
                           f"{SAMPLED.top_p}, beside the greedy one, 0..8 (--answers model, mix, structured-lists; "
                           "sharegpt-points: on the prompts not list-style)")
    apar.add_argument("--min-points", type=integer(0, 100), default=0,
                      help="train on a list or paragraph tree only if it has at least this many points (an "
                           "answer cut off loses its last), 0..100; 0: all")
    apar.add_argument("--from-adapter", type=Path, metavar="PATH",
                      help="continue training this adapter (PATH.safetensors and PATH.json, made with the same "
                           "--records, --max-prompt-tokens and --rank) instead of starting afresh")
    apar.add_argument("--rank", type=integer(1, 256), default=16, help="rank of the low-rank (LoRA) updates, 1..256")
    apar.add_argument("--adapt", nargs="+", choices=ADAPTABLE_LINEARS, default=list(ADAPTED_LINEARS), metavar="LINEAR",
                      help="each layer's projections that get a low-rank update: "
                           f"{', '.join(ADAPTABLE_LINEARS)} (default: {' '.join(ADAPTED_LINEARS)})")
    apar.add_argument("--lr", type=LEARNING_RATE, default=1e-3, help="peak learning rate (cosine to 0)")
    apar.add_argument("--unstructured-share", type=number(0.0, 100.0), default=1.0,
                      help="negative (unstructured) examples per structured one; the paper mixes 1:1")
    apar.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where the model answers and trains")
    apar.add_argument("--precision", choices=["auto", "float32", "bfloat16"], default="auto",
                      help="the training pass's matrix products (weights and adapter stay float32); auto: "
                           "bfloat16 where the device multiplies it natively, float32 elsewhere")
    # a packed sequence's mask is dense, so attention grows with its square: on a 2-core CPU 512 tokens
    # per step train 2.9x more tokens per second than 2048 (apar_finetune.py, "Cost of a round"); the
    # shipped adapter was trained with 2048 on a GPU
    apar.add_argument("--batch-tokens", type=integer(64, 65536), default=2048,
                      help="tokens per step: whole examples packed into one sequence (512 is 2.9x faster on a CPU)")
    return p


def outcome(made: dict) -> str:
    if "accuracy" not in made:  # APAR
        return (f"held-out loss {made['held_out_loss']}, [Fork] precision {made['fork_precision']} "
                f"recall {made['fork_recall']}")
    return "held-out top-1 accuracy by distance: " + ", ".join(
        f"@{d + 1} {row[0]:.3f}" for d, row in enumerate(made["accuracy"]))


def main(argv=None) -> int:
    return run_program(lambda: train_command(argv), interrupted="run the same command again to resume")


def train_command(argv) -> None:
    args = build_parser().parse_args(argv)
    if args.command == "apar":  # the model's answers are not made for --answers sharegpt
        refuse_idle(args, args.command_parser, [(dest, lambda args: args.answers != "sharegpt",
                                                 "--answers model, mix, structured-lists and sharegpt-points")
                                                for dest in ("sampled_answers", "answer_batch")])
    if args.command == "ppd" and args.ensembles * args.soft_tokens > 64:
        raise UserError("--soft-tokens x --ensembles must be at most 64 (inputs per node)")
    folder = args.model if args.model is not None else default_model_dir()
    if args.command != "data":
        args.out = writable(args.out or artifacts.shipped_artifact(args.command, folder), "--out")
    model = load_checkpoint(folder, torch.float32, parse_device(getattr(args, "device", "cpu")))
    model.requires_grad_(False)
    tokenizer = Tokenizer(folder)
    check_fits(tokenizer, model.config.vocab_size, folder)
    if args.command == "apar":  # loaded (or refused) before the answers are made, not after
        args.earlier_adapter = earlier_adapter(model, args) if args.from_adapter is not None else None
    training, held_out = answers(model, tokenizer, folder, args)
    if args.command == "data":
        return
    train = {"ppd": train_ppd, "medusa": train_medusa, "eagle": train_eagle, "apar": train_apar}[args.command]
    tensors, made = train(model, tokenizer, training, held_out, args)
    meta = {"kind": args.command, "model": artifacts.model_fingerprint(model), **made,
            "trainable_parameters": sum(t.numel() for t in tensors.values() if t.is_floating_point()),
            "training": {"command": "python train_prompt.py " + " ".join(argv or sys.argv[1:]),
                         "settings": settings(args), "training_answers": len(training),
                         "held_out_answers": len(held_out),
                         "training_tokens": sum(len(r["answer_ids"]) for r in training),
                         "final_loss": round(args.final_loss, 4), "steps": args.runs[-1]["steps"][1],
                         "seconds": round(sum(run["seconds"] for run in args.runs), 1), "runs": args.runs}}
    artifacts.save(args.out, tensors, meta)
    print(f"saved {args.out}.safetensors and .json; " + outcome(made), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
