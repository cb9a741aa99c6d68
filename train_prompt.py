"""Train the small learned parts of the guessers by self-distillation, on this machine's CPU.

    python train_prompt.py data      # the model's own answers to ShareGPT prompts (cached)
    python train_prompt.py ppd       # PPD prompt-token embeddings  -> trained/ppd-<model>.*
    python train_prompt.py medusa    # Medusa heads' ResBlocks      -> trained/medusa-<model>.*
    python train_prompt.py apar      # APAR adapter + [Fork]/[Child] -> trained/apar-<model>.*

The base model stays frozen; only the new parameters learn, from the model's own text
(self_distill.py). Every run prints progress (loss, tokens/s, ETA), saves a resume point every few
steps (run the same command again to continue), and ends by measuring on held-out answers how often
the rank-r guess at distance d is right. Those accuracies are saved with the weights: decode.py builds
its sparse trees from them (tree.py) and bench.py prints them.

- PPD (Chen et al. 2024, section 3.3): prompt tokens are inserted at random places of an answer; the
  i-th one's averaged-EPT distribution Q_i learns the model's own distribution P_i for the token i
  places after the next, with the loss of equation 1: 1/N sum_i KL(P_i || Q_i) alpha^(i-1). Every
  insertion attends to the answer before it and to its own earlier prompt tokens (the ensemble mask),
  exactly as at decoding time, so one base pass over an answer serves many insertions.
- Medusa-1 (Cai et al. 2024, section 2.2.1): head k learns the token k+1 places ahead with
  L = sum_k lambda_k CE(p^(k)_t, y_{t+k+1}), lambda_k = 0.8^k (the base is frozen, so its final
  hidden states are computed once and cached beside the data).
- APAR (Liu et al. 2024, sections 2.2 and 3.1): the model's own answers to half list-style prompts,
  cut into paragraph trees (apar_data.py), are learned with the tree attention mask, the loss on
  every token but the prompt and [Child]. The paper fine-tunes all weights; on 2 CPU cores this trains
  a rank-8 LoRA update of every layer's attention projections plus the two control tokens' embedding
  rows (tied to the LM head), about 0.6M parameters, so it fits in well under an hour and ships as a
  few MB. APAR ends with held-out loss and how well [Fork] is placed instead of guess accuracies.
"""

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import artifacts
from apar import (ADAPTED_LINEARS, CHILD_TOKEN, FORK_TOKEN, ControlTokens, adapted_linears, require_tied_embeddings,
                  with_control_rows)
from apar_data import IGNORE, training_example
from drafters import TOP_RANKS, MedusaHeads, PromptTokens
from errors import UserError
from kv_cache import KVCache
from tree import Tree

VALIDATION_EVERY = 10  # every 10th answer is held out: accuracies and tree statistics come from these
DECAY = 0.8  # alpha of PPD's eq. 1 (the paper gives no value) and lambda of Medusa's loss (0.8^k)


# ---- data ---------------------------------------------------------------------------------------

def data_file(model, folder: Path, args) -> Path:
    from convert import cache_root

    kind = "apar" if args.command == "apar" else "answers"  # APAR asks other prompts, for longer answers
    name = f"{kind}-{args.records}-prompt{args.max_prompt_tokens}-new{args.max_new_tokens}.jsonl"
    return cache_root() / "distill" / f"{folder.name}-{artifacts.model_fingerprint(model)['weights_sha256']}" / name


def answers(model, tokenizer, folder, args) -> tuple[list[dict], list[dict]]:
    """(training, held-out) records {"prompt_ids", "answer_ids"}, generated once and cached."""
    from apar_data import apar_prompts
    from self_distill import generate_answers, training_prompts

    path = args.data = data_file(model, folder, args)
    print(f"self-distilled answers: {path}", file=sys.stderr)
    choose = apar_prompts if args.command == "apar" else training_prompts
    prompts = choose(args.records, tokenizer, args.max_prompt_tokens)
    records = generate_answers(model, tokenizer, path, prompts, max_new_tokens=args.max_new_tokens)
    held_out = [r for i, r in enumerate(records) if i % VALIDATION_EVERY == 0]
    training = [r for i, r in enumerate(records) if i % VALIDATION_EVERY != 0]
    return training, held_out


def sequence(record) -> list[int]:
    return record["prompt_ids"] + record["answer_ids"]


def answer_positions(record) -> range:
    """Positions t whose next token (t + 1) belongs to the answer."""
    start = len(record["prompt_ids"]) - 1
    return range(start, start + len(record["answer_ids"]))


# ---- the frozen base pass -----------------------------------------------------------------------

class FrozenPrefix:
    """A stand-in for KVCache when training: the keys and values of an answer's base pass, fixed,
    with each layer's new K/V concatenated after them (so autograd can see through)."""

    def __init__(self, keys, values):
        self.keys, self.values = keys, values  # [layers, 1, K, T, E]
        self.length = keys.shape[3]

    def reserve(self, count):
        pass

    def write(self, layer, k, v):
        return torch.cat([self.keys[layer], k], dim=2), torch.cat([self.values[layer], v], dim=2)


@torch.no_grad()
def base_pass(model, tokens: list[int]) -> tuple[torch.Tensor, FrozenPrefix]:
    """Final hidden states [T, D] of a token sequence and its K/V."""
    cache = KVCache.for_model(model, capacity=len(tokens))
    hidden = model.hidden_states(torch.tensor([tokens]), positions=torch.arange(len(tokens)), cache=cache)
    return hidden[0], FrozenPrefix(cache.keys, cache.values)


# ---- PPD ----------------------------------------------------------------------------------------

def insertion_layout(points: list[int], count: int, ensembles: int, prefix_length: int):
    """Rows for prompt tokens inserted after each of `points` (positions in the answer's sequence):
    the same layout as a tree whose nodes are those tokens, each carrying `count` prompt tokens, so
    training sees the very mask decoding uses (tree.Tree.ancestor_mask, the ensemble mask).
    Returns (positions [R], mask [R, prefix_length + R], distance of each row [R])."""
    rows_per_point = count * ensembles
    star = Tree([0] + [1] * len(points), [-1] + [0] * len(points), prompt_counts=[0] + [count] * len(points),
                ensembles=ensembles)
    own = star.ancestor_mask()[len(star):, len(star):]  # prompt rows among themselves
    slots = star.prompt_slots()
    point = torch.tensor(points).repeat_interleave(rows_per_point)  # [R]
    distance = torch.tensor([d for _, d, _ in slots])
    sees_prefix = torch.arange(prefix_length)[None] <= point[:, None]  # the answer up to the insertion
    return point + distance, torch.cat([sees_prefix, own], dim=1), distance


def inserted_logits(model, prompt_tokens: PromptTokens, prefix: FrozenPrefix, points: list[int]) -> torch.Tensor:
    """All m prompt tokens (n EPTs each) inserted after each of `points` of the sequence whose K/V
    `prefix` holds, in one pass: their EPT-averaged logits [I, m, V]."""
    m, n = prompt_tokens.count, prompt_tokens.ensembles
    positions, mask, _ = insertion_layout(points, m, n, prefix.length)
    embeds = prompt_tokens.embeddings.expand(len(points), m, n, -1).reshape(1, len(points) * m * n, -1)
    hidden = model.hidden_states(embeds=embeds, positions=positions, cache=prefix, mask=mask)[0]  # [I*m*n, D]
    return prompt_tokens.ensemble_average(model.logits(hidden)).view(len(points), m, -1)


def ppd_loss(model, prompt_tokens: PromptTokens, record, insertions: int, generator) -> torch.Tensor:
    """Eq. 1 on one answer: prompt tokens inserted after `insertions` random answer positions."""
    tokens = sequence(record)
    hidden, prefix = base_pass(model, tokens)
    m = prompt_tokens.count
    usable = [t for t in answer_positions(record) if t + m < len(tokens)]  # teachers exist for all m
    if not usable:
        return None
    pick = torch.randperm(len(usable), generator=generator)[:insertions].sort().values
    points = [usable[i] for i in pick]
    student_logits = inserted_logits(model, prompt_tokens, prefix, points)  # [I, m, V]
    with torch.no_grad():  # the teacher for prompt token i after t: the model's own distribution at t+i
        teacher_rows = torch.tensor(points)[:, None] + torch.arange(1, m + 1)[None]
        teacher = F.log_softmax(model.logits(hidden[teacher_rows]), dim=-1)  # [I, m, V]
    kl = F.kl_div(F.log_softmax(student_logits, dim=-1), teacher, log_target=True, reduction="none").sum(-1)
    return (kl.mean(0) * DECAY ** torch.arange(m)).mean()


@torch.no_grad()
def ppd_accuracy(model, prompt_tokens: PromptTokens, records, insertions: int) -> list[list[float]]:
    """accuracy[d][r]: how often the rank-r guess of prompt token d+1 is the answer's actual token
    d+1 places after the next one, at `insertions` evenly spread points per held-out answer."""
    m = prompt_tokens.count
    hits, total = torch.zeros(m, TOP_RANKS), 0
    for record in records:
        tokens = sequence(record)
        usable = [t for t in answer_positions(record) if t + m + 1 < len(tokens)]
        if not usable:
            continue
        points = usable[::max(1, len(usable) // insertions)]
        _, prefix = base_pass(model, tokens)
        guesses = inserted_logits(model, prompt_tokens, prefix, points).topk(TOP_RANKS).indices  # [I, m, R]
        actual = torch.tensor(tokens)[torch.tensor(points)[:, None] + torch.arange(2, m + 2)[None]]  # [I, m]
        hits += (guesses == actual[..., None]).sum(0)
        total += len(points)
    return (hits / max(total, 1)).tolist()


def initial_embeddings(model, count: int, ensembles: int, seed: int) -> torch.Tensor:
    """Prompt tokens start as embeddings of ordinary tokens (PPD section 5, "Training")."""
    ids = torch.randint(model.config.vocab_size, (count, ensembles), generator=torch.Generator().manual_seed(seed))
    return model.embed.weight[ids].detach().clone().float()


def train_ppd(model, tokenizer, training, held_out, args) -> tuple[dict, dict]:
    prompt_tokens = PromptTokens(initial_embeddings(model, args.prompt_tokens, args.ensembles, args.seed))
    optimizer = torch.optim.AdamW(prompt_tokens.parameters(), lr=args.lr, weight_decay=0.0)
    total_steps = args.epochs * len(training)

    def step_loss(step):
        epoch, index = divmod(step, len(training))
        order = torch.randperm(len(training), generator=torch.Generator().manual_seed(args.seed + epoch))
        record = training[order[index]]
        loss = ppd_loss(model, prompt_tokens, record, args.insertions,
                        torch.Generator().manual_seed(args.seed * 100003 + step))
        return loss, min(args.insertions, len(record["answer_ids"])) * args.prompt_tokens

    run_steps(prompt_tokens, optimizer, total_steps, step_loss, args)
    accuracy = ppd_accuracy(model, prompt_tokens, held_out, args.insertions)
    return {"embeddings": prompt_tokens.embeddings}, {"prompt_tokens": args.prompt_tokens,
                                                      "ensembles": args.ensembles, "accuracy": accuracy}


# ---- Medusa -------------------------------------------------------------------------------------

@torch.no_grad()
def answer_features(model, records) -> tuple[torch.Tensor, torch.Tensor]:
    """The frozen model's final hidden states at every answer position [M, D], and the sequence's
    tokens after each position [M, 8] (-1 past the end): head k's target is column k."""
    hidden, targets = [], []
    for i, record in enumerate(records):
        tokens = sequence(record)
        states, _ = base_pass(model, tokens)
        positions = answer_positions(record)
        hidden.append(states[positions.start:positions.stop])
        padded = torch.tensor(tokens + [-1] * 8)
        targets.append(torch.stack([padded[t + 1:t + 9] for t in positions]))
        print(f"\rbase model's hidden states: {i + 1}/{len(records)} answers", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return torch.cat(hidden), torch.cat(targets)


def medusa_loss(model, heads: MedusaHeads, hidden, targets) -> torch.Tensor:
    logits = heads(hidden, model.lm_head)  # [K, B, V]
    losses = [F.cross_entropy(logits[k], targets[:, k + 1], ignore_index=-1) for k in range(len(logits))]
    return sum(DECAY ** (k + 1) * loss for k, loss in enumerate(losses))


@torch.no_grad()
def medusa_accuracy(model, heads: MedusaHeads, hidden, targets) -> list[list[float]]:
    """accuracy[d][r]: how often head d+1's rank-r guess is the token d+2 places ahead."""
    hits, counts = torch.zeros(len(heads.blocks), TOP_RANKS), torch.zeros(len(heads.blocks), 1)
    for start in range(0, len(hidden), 512):
        guesses = heads(hidden[start:start + 512], model.lm_head).topk(TOP_RANKS).indices  # [K, B, R]
        for k in range(len(heads.blocks)):
            target = targets[start:start + 512, k + 1]
            hits[k] += (guesses[k] == target[:, None]).sum(0)
            counts[k] += (target >= 0).sum()
    return (hits / counts.clamp(min=1)).tolist()


def cached_answer_features(model, records, path: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """answer_features, computed once per data file and kept beside it (the base model is frozen)."""
    from safetensors.torch import load_file, save_file

    if path.is_file():
        saved = load_file(path)
        return saved["hidden"], saved["targets"]
    hidden, targets = answer_features(model, records)
    save_file({"hidden": hidden.contiguous(), "targets": targets.contiguous()}, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)
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
        rows = order[index * args.batch_tokens:(index + 1) * args.batch_tokens]
        return medusa_loss(model, heads, hidden[rows], targets[rows]), len(rows)

    run_steps(heads, optimizer, args.epochs * steps_per_epoch, step_loss, args)
    held_out_features = cached_answer_features(model, held_out, features.with_name(features.name + "-held-out.safetensors"))
    accuracy = medusa_accuracy(model, heads, *held_out_features)
    tensors = {name: p for name, p in heads.state_dict().items()}
    return tensors, {"heads": args.heads, "accuracy": accuracy}


# ---- APAR ---------------------------------------------------------------------------------------

class AparAdapter(nn.Module):
    """What APAR fine-tuning changes: a rank-r update W + up @ down of each adapted Linear (LoRA, Hu
    et al. 2021; `up` starts at zero, so training starts from the base model) and the [Fork] /
    [Child] embedding rows. Forward hooks add the updates, so the base weights stay untouched."""

    def __init__(self, model, control, rank: int, seed: int):
        super().__init__()
        generator = torch.Generator().manual_seed(seed)
        self.names = list(adapted_linears(model))
        self.down, self.up = nn.ParameterDict(), nn.ParameterDict()
        for name, linear in adapted_linears(model).items():
            out_features, in_features = linear.weight.shape
            key = name.replace(".", "_")  # a ParameterDict key cannot hold dots
            self.down[key] = nn.Parameter(torch.randn(rank, in_features, generator=generator) * in_features ** -0.5)
            self.up[key] = nn.Parameter(torch.zeros(out_features, rank))
        self.control = nn.Parameter(model.embed.weight[[control.fork, control.child]].detach().clone())

    def attach(self, model) -> list:
        """Hook the updates into the model's Linears; returns the handles (call .remove() on each)."""
        def hook(key):
            return lambda module, inputs, output: output + (inputs[0] @ self.down[key].T) @ self.up[key].T
        return [linear.register_forward_hook(hook(name.replace(".", "_")))
                for name, linear in adapted_linears(model).items()]

    def tensors(self) -> dict[str, torch.Tensor]:
        """As apar.apply_adapter reads them."""
        made = {"control_embeddings": self.control}
        for name in self.names:
            key = name.replace(".", "_")
            made |= {f"{name}.down": self.down[key], f"{name}.up": self.up[key]}
        return made


def apar_logits(model, adapter: AparAdapter, control, example) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [L, V] at the learned positions of a paragraph-tree example and their labels [L]: the
    whole tree in one pass, every token attending to its ancestors only (section 2.2, "Training
    attention")."""
    tree = example.tree
    weight = with_control_rows(model.embed.weight, control, adapter.control)  # input and output rows
    embeds = F.embedding(torch.tensor([tree.tokens]), weight)
    hidden = model.hidden_states(embeds=embeds, positions=torch.tensor(tree.depths), mask=tree.ancestor_mask())
    labels = torch.tensor(example.labels)
    learned = labels != IGNORE
    return F.linear(hidden[0, learned], weight), labels[learned]


def apar_examples(records, tokenizer, control) -> list:
    """Paragraph-tree examples, structured and unstructured mixed 1:1 (section 3.2): the first
    unstructured ones up to the number of structured ones."""
    examples = [training_example(r["prompt_ids"], r["answer_ids"], tokenizer, control) for r in records]
    structured = [e for e in examples if e.kind != "unstructured"]
    unstructured = [e for e in examples if e.kind == "unstructured"][:max(len(structured), 1)]
    return structured + unstructured


@torch.no_grad()
def apar_evaluation(model, adapter, control, examples) -> dict:
    """Held-out loss, and how well [Fork] is placed when the model reads the true tree: precision
    and recall of "argmax is [Fork]" against "the label is [Fork]"."""
    losses, hits, predicted, actual = [], 0, 0, 0
    for example in examples:
        logits, labels = apar_logits(model, adapter, control, example)
        losses.append(F.cross_entropy(logits, labels).item())
        says_fork, is_fork = logits.argmax(-1) == control.fork, labels == control.fork
        hits += int((says_fork & is_fork).sum())
        predicted += int(says_fork.sum())
        actual += int(is_fork.sum())
    return {"held_out_loss": round(sum(losses) / max(len(losses), 1), 4),
            "fork_precision": round(hits / max(predicted, 1), 3), "fork_recall": round(hits / max(actual, 1), 3)}


def train_apar(model, tokenizer, training, held_out, args) -> tuple[dict, dict]:
    require_tied_embeddings(model)
    control = ControlTokens.of(tokenizer)
    training, held_out = (apar_examples(r, tokenizer, control) for r in (training, held_out))
    kinds = {kind: sum(e.kind == kind for e in training) for kind in ("list", "paragraphs", "unstructured")}
    print(f"APAR examples: {kinds} for training, {len(held_out)} held out", file=sys.stderr)
    adapter = AparAdapter(model, control, args.rank, args.seed)
    optimizer = torch.optim.AdamW(adapter.parameters(), lr=args.lr, weight_decay=0.0)
    handles = adapter.attach(model)

    def step_loss(step):
        epoch, index = divmod(step, len(training))
        order = torch.randperm(len(training), generator=torch.Generator().manual_seed(args.seed + epoch))
        example = training[order[index]]
        return F.cross_entropy(*apar_logits(model, adapter, control, example)), len(example.tree)

    try:
        run_steps(adapter, optimizer, args.epochs * len(training), step_loss, args)
        evaluation = apar_evaluation(model, adapter, control, held_out)
    finally:
        for handle in handles:
            handle.remove()
    return adapter.tensors(), {"rank": args.rank, "adapted": list(ADAPTED_LINEARS), "examples": kinds,
                               "control_tokens": {"fork": FORK_TOKEN, "child": CHILD_TOKEN}, **evaluation}


# ---- the loop they share ------------------------------------------------------------------------

def run_steps(module, optimizer, total_steps: int, step_loss, args) -> None:
    """Optimise with a cosine learning rate from args.lr to 0 (PPD section 5), printing progress and
    saving a resume point every args.save_every steps (resumed when the same command runs again)."""
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: 0.5 * (1 + math.cos(math.pi * min(step, total_steps) / total_steps)))
    from convert import cache_root

    resume = cache_root() / "train" / f"{args.out.name}.resume.pt"
    step = 0
    if resume.is_file():
        state = torch.load(resume, weights_only=True)
        if state["settings"] == settings(args):
            module.load_state_dict(state["module"])
            optimizer.load_state_dict(state["optimizer"])
            schedule.load_state_dict(state["schedule"])
            step = state["step"]
            print(f"resuming from {resume} at step {step}/{total_steps}", file=sys.stderr)
    started, tokens, recent = time.perf_counter(), 0, []
    first = step
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
        print(f"\rstep {step}/{total_steps}  loss {sum(recent) / max(len(recent), 1):.4f}  "
              f"{tokens / elapsed:.0f} tokens/s  ETA {eta / 60:.1f} min   ", end="", file=sys.stderr, flush=True)
        if step % args.save_every == 0 or step == total_steps:
            resume.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"settings": settings(args), "step": step, "module": module.state_dict(),
                        "optimizer": optimizer.state_dict(), "schedule": schedule.state_dict()}, resume)
    print(file=sys.stderr)
    args.final_loss = sum(recent) / max(len(recent), 1)


def settings(args) -> dict:
    """The options that shape training: a resume point made with others is ignored."""
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k not in ("save_every", "final_loss", "data")}


# ---- command line -------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    from decode import OneLineErrorParser

    p = OneLineErrorParser(prog="train_prompt.py", description=__doc__.split("\n\n")[0],
                           formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="{data,ppd,medusa,apar}")
    data = argparse.ArgumentParser(add_help=False)
    data.add_argument("--model", type=Path, metavar="DIR", help="a Hugging Face Llama checkpoint folder "
                      "(default: the embedded SmolLM2-135M-Instruct)")
    data.add_argument("--records", type=int, default=480, help="ShareGPT prompts to answer (every "
                      f"{VALIDATION_EVERY}th is held out)")
    data.add_argument("--max-new-tokens", type=int, default=192, help="longest self-distilled answer")
    data.add_argument("--max-prompt-tokens", type=int, default=192, help="longer ShareGPT prompts are skipped")
    train = argparse.ArgumentParser(add_help=False, parents=[data])
    train.add_argument("--out", type=Path, help="where to write NAME.safetensors and NAME.json "
                       "(default: trained/<method>-<model folder>)")
    train.add_argument("--epochs", type=int, default=1, help="passes over the training answers")
    train.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    train.add_argument("--save-every", type=int, default=25, help="steps between resume points")
    commands.add_parser("data", parents=[data], help="generate the self-distilled answers only",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ppd = commands.add_parser("ppd", parents=[train], help="train PPD prompt-token embeddings",
                              formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    ppd.add_argument("--prompt-tokens", type=int, default=3, help="m: prompt tokens (distances 1..m)")
    ppd.add_argument("--ensembles", type=int, default=1, help="n: EPTs per prompt token")
    ppd.add_argument("--insertions", type=int, default=32, help="insertion points per answer per step")
    ppd.add_argument("--lr", type=float, default=0.01, help="peak learning rate (cosine to 0)")
    medusa = commands.add_parser("medusa", parents=[train], help="train Medusa heads",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    medusa.add_argument("--heads", type=int, default=3, help="K: heads (distances 1..K)")
    medusa.add_argument("--batch-tokens", type=int, default=256, help="answer positions per step")
    medusa.add_argument("--lr", type=float, default=1e-3, help="peak learning rate (cosine to 0)")
    medusa.set_defaults(epochs=4)  # an epoch is a few minutes once the hidden states are cached
    apar = commands.add_parser("apar", parents=[train], help="fine-tune for APAR: a low-rank adapter "
                               "and the [Fork]/[Child] embeddings (its own data: half list-style prompts)",
                               formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    apar.add_argument("--rank", type=int, default=8, help="rank of the low-rank (LoRA) updates")
    apar.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine to 0)")
    # answers must end (EOS) to become paragraph trees, so they may be longer; prompts shorter
    apar.set_defaults(epochs=2, records=112, max_new_tokens=448, max_prompt_tokens=128)
    return p


def check(args) -> None:
    positive = ["records", "max_new_tokens", "max_prompt_tokens", "epochs", "save_every", "prompt_tokens",
                "ensembles", "insertions", "heads", "batch_tokens", "rank"]
    for name in positive:
        if getattr(args, name, 1) < 1:
            raise UserError(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if getattr(args, "lr", 1) <= 0:
        raise UserError(f"--lr must be positive, got {args.lr}")
    if args.records < VALIDATION_EVERY:
        raise UserError(f"--records must be at least {VALIDATION_EVERY} (every {VALIDATION_EVERY}th is held out)")
    if getattr(args, "heads", 1) > 7 or getattr(args, "prompt_tokens", 1) > TOP_RANKS:
        raise UserError("at most 7 heads / 10 prompt tokens")


def outcome(made: dict) -> str:
    if "accuracy" not in made:  # APAR
        return (f"held-out loss {made['held_out_loss']}, [Fork] precision {made['fork_precision']} "
                f"recall {made['fork_recall']}")
    return "held-out top-1 accuracy by distance: " + ", ".join(
        f"@{d + 1} {row[0]:.3f}" for d, row in enumerate(made["accuracy"]))


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check(args)
        from convert import default_model_dir
        from decode import shipped_artifact
        from model import load_checkpoint
        from tokenizer import Tokenizer

        folder = args.model if args.model is not None else default_model_dir()
        model = load_checkpoint(folder, torch.float32)
        model.requires_grad_(False)
        tokenizer = Tokenizer(folder)
        training, held_out = answers(model, tokenizer, folder, args)
        if args.command == "data":
            return 0
        args.out = args.out or shipped_artifact(args.command, folder)
        started = time.perf_counter()
        train = {"ppd": train_ppd, "medusa": train_medusa, "apar": train_apar}[args.command]
        tensors, made = train(model, tokenizer, training, held_out, args)
        meta = {"kind": args.command, "model": artifacts.model_fingerprint(model), **made,
                "trainable_parameters": sum(t.numel() for t in tensors.values()),
                "training": {"command": "python train_prompt.py " + " ".join(argv or sys.argv[1:]),
                             "settings": settings(args), "training_answers": len(training),
                             "held_out_answers": len(held_out),
                             "training_tokens": sum(len(r["answer_ids"]) for r in training),
                             "final_loss": round(args.final_loss, 4),
                             "seconds": round(time.perf_counter() - started, 1)}}
        artifacts.save(args.out, tensors, meta)
        print(f"saved {args.out}.safetensors and .json; " + outcome(made), file=sys.stderr)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ninterrupted; run the same command again to resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
