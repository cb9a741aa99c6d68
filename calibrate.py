"""Hardware-aware tree size (PPD section 4.2, "Hardware-awareness", generalised to every tree method).

A guess-and-verify step over n inputs yields tau(n) tokens and costs L(n), one forward pass over n
inputs. tau(n) depends on the method and the text, not on the machine; L(n) depends on the machine
and dtype only. The best size maximises tau(n) / L(n) (PPD's Speedup(n)):

- L(n) is measured here: one forward pass over n new inputs after 256 cached tokens, the median of 3
  interleaved rounds of the median of 5;
- tau(n) for Medusa and PPD is predicted from the held-out accuracies saved with their trained
  weights (1 + the expected accepted length of the best sparse tree of n inputs, tree.py);
- tau(n) for ANPD and Lookahead, whose guesses come from the text itself, is measured by decoding a
  few fixed prompts (below) with a guess budget of n - 1.

`python decode.py --method M --calibrate` prints the table and saves the best n for this machine
(CPU model and cores, or GPU name), device, dtype and model in the cache; decode.py then uses it
when no size is given.

Cost-aware drafting (cost_aware.py) needs L(n) itself, per step: `machine_latency` measures it once
per machine, device, dtype and model (a few seconds) and keeps it in the cache too.
"""

import json
import os
import platform
import statistics
import sys
import time

import torch

from artifacts import model_fingerprint, written_atomically
from convert import cache_root
from cost_aware import Latency
from decode import generate, score_tree
from errors import TooFewRows
from kv_cache import KVCache
from tree import Tree
from verify import verify_greedy

ROWS = [2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32]
LATENCY_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]  # where machine_latency measures L(n) (then extrapolates)
CACHED = 256
PROMPTS = [  # for measuring ANPD's and Lookahead's tau(n): chat, code, summary, arithmetic
    "What are three good habits for staying healthy while working from home?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new budget. After a "
    "long debate, the council approved more money for parks and libraries, and less for road repairs.",
    "Tom has 12 apples. He gives 5 to Anna and buys 8 more. How many apples does he have? Explain.",
]
NEW_TOKENS = 64


def forward_latency(model, rows: int, cached: int = CACHED, reps: int = 5) -> float:
    """Seconds for one forward pass over `rows` new inputs after `cached` tokens, logits included."""
    return step_latency(model, prefilled_cache(model, cached, rows), rows, reps)


def prefilled_cache(model, cached: int, room: int) -> KVCache:
    """A KV cache holding `cached` random tokens, with room for `room` more."""
    cache = KVCache.for_model(model, capacity=cached + room)
    with torch.inference_mode():
        model(torch.randint(0, model.config.vocab_size, (1, cached), device=model.device),
              positions=torch.arange(cached, device=model.device), cache=cache, slots=cache.claim(cached))
    return cache


def step_latency(model, cache: KVCache, rows: int, reps: int, whole_step: bool = False) -> float:
    """The median seconds of `reps` passes over `rows` new inputs after what `cache` holds (left as it
    was). `whole_step`: a pass of decode.generate's loop, not only the model's: a chain of `rows`
    guesses, its mask and positions, the forward pass and logits, greedy verification, and keeping
    the accepted path's K/V (what cost-aware drafting pays per pass)."""
    cached = cache.length
    tokens = torch.randint(0, model.config.vocab_size, (rows,)).tolist()
    tree = Tree.chain(tokens[0], tokens[1:])
    new = torch.tensor([tokens], device=model.device)
    positions = torch.arange(cached, cached + rows, device=model.device)

    def step():
        started = time.perf_counter()
        if whole_step:
            logits = model.logits(score_tree(model, cache, tree))
            cache.keep(cached, verify_greedy(tree, logits).path)
        else:
            model(new, positions=positions, cache=cache, slots=cache.claim(rows))
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
        cache.truncate(cached)
        return time.perf_counter() - started
    with torch.inference_mode():
        step()  # warm-up: the first pass at a new size allocates and picks kernels
        return statistics.median(step() for _ in range(reps))


def machine_key(model) -> str:
    if model.device.type == "cuda":
        where = torch.cuda.get_device_name(model.device)
    else:
        where = f"{cpu_name()} x{os.cpu_count()}"
    dtype = str(model.dtype).removeprefix("torch.")
    return f"{where} | {model.device.type} | {dtype} | model {model_fingerprint(model)['weights_sha256']}"


def cpu_name() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_file():
    return cache_root() / "calibration.json"


def saved_rows(model, method: str) -> int | None:
    """The tree size --calibrate chose for `method` on this machine, dtype and model (None: never)."""
    try:
        rows = read_calibrations()[machine_key(model)][method]["rows"]
    except (KeyError, TypeError):
        return None
    return rows if isinstance(rows, int) and not isinstance(rows, bool) and max(ROWS) >= rows >= 2 else None


def read_calibrations() -> dict:
    """Every saved calibration; {} when there is none or the file is damaged (calibrating again fixes it)."""
    return read_saved(calibration_file())


def read_saved(path) -> dict:
    """A JSON object saved in the cache; {} when there is none or the file is damaged."""
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return saved if isinstance(saved, dict) else {}


def write_saved(path, saved: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with written_atomically(path) as tmp:
        tmp.write_text(json.dumps(saved, indent=2) + "\n", encoding="utf-8")


def calibrated_rows(model, method: str, default: int) -> int:
    """What --calibrate chose for `method` on this machine (said on stderr), else `default`."""
    calibrated = saved_rows(model, method)
    if calibrated is None:
        return default
    print(f"{method}: {calibrated} inputs per pass, as --calibrate chose for this machine", file=sys.stderr)
    return calibrated


def latency_file():
    return cache_root() / "latency.json"


def machine_latency(model) -> Latency:
    """L(n) on this machine, device, dtype and model, for cost-aware drafting (a whole pass of the
    loop, step_latency): as measured by an earlier run, else measured now (progress on stderr) and
    saved."""
    key, saved = machine_key(model), read_saved(latency_file())
    try:
        return Latency({int(n): ms / 1000 for n, ms in saved[key].items()})
    except (KeyError, TypeError, ValueError, AttributeError):
        pass  # never measured here, or a damaged entry: measure again
    print("cost-aware drafting: measuring this machine's forward-pass latency L(n), once (some seconds)",
          file=sys.stderr)
    latency = Latency(latencies(model, LATENCY_SIZES, reps=3, whole_step=True))
    saved[key] = {n: round(seconds * 1000, 3) for n, seconds in latency.as_dict().items()}
    write_saved(latency_file(), saved)
    return latency


def save_rows(model, method: str, rows: int, table: list[dict]) -> None:
    path = calibration_file()
    saved = read_calibrations()
    if not isinstance(saved.get(machine_key(model)), dict):
        saved[machine_key(model)] = {}
    saved[machine_key(model)][method] = {"rows": rows, "table": table}
    write_saved(path, saved)


def tokens_per_pass(model, tokenizer, make_drafter, rows: int, raw: bool = False) -> float | None:
    """tau(rows): predicted by the drafter when it can (Medusa, PPD), else measured over PROMPTS;
    None when the method's smallest tree needs more rows."""
    try:
        drafter = make_drafter(rows)
    except TooFewRows:
        return None
    if drafter.predicted_tokens_per_pass is not None:
        return drafter.predicted_tokens_per_pass
    return measured_tau(model, tokenizer, drafter, raw)


def measured_tau(model, tokenizer, drafter, raw: bool = False) -> float:
    """Tokens per forward pass (prefill excluded) over PROMPTS, decoded with `drafter`."""
    tokens = passes = 0
    room = min(NEW_TOKENS, model.config.max_positions // 2)  # a short context: half prompt, half answer
    with torch.inference_mode():
        for prompt in PROMPTS:
            gen = generate(model, tokenizer.prompt_ids(prompt, raw=raw)[-room:], max_new_tokens=room,
                           eos_ids=tokenizer.eos_ids, drafter=drafter)
            tokens, passes = tokens + len(gen.token_ids) - 1, passes + gen.counts.forward_passes - 1
    return tokens / max(passes, 1)


def latencies(model, sizes: list[int], rounds: int = 3, reps: int = 5, whole_step: bool = False) -> dict[int, float]:
    """L(n) for each size: the median over `rounds` interleaved rounds (so a burst of load on a shared
    machine hits every size alike) of step_latency's median of `reps`."""
    runs = {n: [] for n in sizes}
    cache = prefilled_cache(model, CACHED, max(sizes))
    for round_number in range(rounds):
        for n in sizes:
            runs[n].append(step_latency(model, cache, n, reps, whole_step))
        print(f"\rmeasuring L(n): round {round_number + 1}/{rounds}", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    return {n: statistics.median(r) for n, r in runs.items()}


def calibrate(model, method: str, tau_of_rows) -> tuple[int, list[dict]]:
    """Measure L(n) for every n in ROWS (and L(1)), ask tau(n), pick the best tau(n) / L(n); print
    the table as it goes."""
    print(f"calibrating {method} on {machine_key(model)}", file=sys.stderr)
    latency_of = latencies(model, [1] + ROWS)
    one = latency_of[1]
    print(f"L(1) = {one * 1000:.1f} ms", file=sys.stderr)
    print("| n (inputs per pass) | L(n) ms | L(n)/L(1) | tau(n) | tau(n) L(1)/L(n) |\n|---|---|---|---|---|")
    table = []
    for rows in ROWS:
        latency, tau = latency_of[rows], tau_of_rows(rows)
        if tau is None:
            continue
        entry = {"rows": rows, "latency_ms": round(latency * 1000, 2), "tau": round(tau, 3),
                 "predicted_speedup": round(tau * one / latency, 3)}
        table.append(entry)
        print(f"| {rows} | {entry['latency_ms']:.1f} | {latency / one:.2f} | {tau:.2f} | "
              f"{entry['predicted_speedup']:.2f}x |", flush=True)
    best = max(table, key=lambda e: e["predicted_speedup"])
    return best["rows"], table
