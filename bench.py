"""Speed baseline: vanilla decoding and the cost of one decoding step, ours next to transformers'.

    python bench.py                      # float32 and bfloat16, a few minutes on 2 CPU cores
    python bench.py --dtypes float32 --new-tokens 32

Two tables per dtype, each measured side by side in one run, interleaving the two implementations
so that machine noise hits both alike:
1. vanilla greedy decoding, tokens/s: our `decode.generate` vs transformers' `generate` on the same
   checkpoint and prompts, both producing exactly --new-tokens tokens (end-of-sequence ignored),
   alternating ours/theirs for --rounds rounds and reporting each one's median;
2. step latency L(T): one forward pass feeding T new tokens on top of 256 or 1024 cached tokens,
   logits included, the median of --reps runs. L(T)/L(1) near 1 means verifying T drafted tokens
   costs about as much as generating one, the premise of every speculative method.
"""

import argparse
import statistics
import sys
import time

import torch

from convert import default_model_dir
from decode import DTYPES, generate
from kv_cache import KVCache
from model import load_checkpoint
from tokenizer import Tokenizer

PROMPTS = ["Explain in a few sentences why the sky is blue.",
           "Write a Python function that checks whether a string is a palindrome.",
           "Summarise the plot of Romeo and Juliet."]
STEP_SIZES = [1, 2, 4, 8, 16, 32, 64]
CACHED = [256, 1024]


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
    return statistics.median(timed(step) for _ in range(reps))


def theirs_step_latency(hf_model, cached, T, reps) -> float:
    from transformers import DynamicCache

    cache = DynamicCache()
    hf_model(torch.randint(0, 1000, (1, cached)), past_key_values=cache, use_cache=True)
    new = torch.randint(0, 1000, (1, T))

    def step():
        hf_model(new, past_key_values=cache, use_cache=True)
        cache.crop(-T)  # transformers 5: a negative count removes that many tokens
    return statistics.median(timed(step) for _ in range(reps))


def table(header: list[str], rows: list[list]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def bench_dtype(name, args, tokenizer):
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
    for prompt in PROMPTS:
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
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"],
                   help="dtypes to measure")
    p.add_argument("--new-tokens", type=int, default=64, help="tokens generated per prompt")
    p.add_argument("--rounds", type=int, default=3, help="interleaved generation rounds per prompt (median)")
    p.add_argument("--reps", type=int, default=5, help="repetitions per latency measurement (median)")
    p.add_argument("--skip-transformers", action="store_true", help="measure our model only")
    args = p.parse_args(argv)
    if min(args.new_tokens, args.reps, args.rounds) < 1:
        p.error("--new-tokens, --rounds and --reps must be at least 1")
    print(f"# bench.py: torch {torch.__version__}, {torch.get_num_threads()} threads, "
          f"default model {default_model_dir().name}")
    tokenizer = Tokenizer(default_model_dir())
    with torch.inference_mode():
        for name in args.dtypes:
            bench_dtype(name, args, tokenizer)


if __name__ == "__main__":
    main()
