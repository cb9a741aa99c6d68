"""Hardware-aware tree size (PPD section 4.2, "Hardware-awareness", generalised to every tree method).

A guess-and-verify step over n inputs yields tau(n) tokens and costs L(n), one forward pass over n
inputs. tau(n) depends on the method and the text, not on the machine; L(n) depends on the machine
and dtype only. The best size maximises tau(n) / L(n) (PPD's Speedup(n)):

- L(n) is measured here (`latencies`): one forward pass over n new inputs after 256 cached
  tokens, a low quantile of 3 rounds of 5 passes, the sizes interleaved pass by pass;
- tau(n) for Medusa and PPD is predicted from the held-out accuracies saved with their trained
  weights (1 + the expected accepted length of the best sparse tree of n inputs, tree.py);
- tau(n) for ANPD and Lookahead, whose guesses come from the text itself, is measured by decoding a
  few fixed prompts (below) with a guess budget of n - 1.

`python decode.py --method M --calibrate` prints the table and saves the best n for this machine
(CPU model and cores, or GPU name), device, dtype and model in the cache; decode.py then uses it
when no size is given.

Cost-aware drafting (cost_aware.py) needs L(n) itself, per step: `machine_latency` measures it once
per machine, device, dtype and model and saves it in the cache's latency.json; each run corrects it
from its own passes (latency.OnlineLatency) and `save_measured` writes what it measured well back
(latency.py tells the whole story).
"""

import os
import platform
import statistics
import sys
import time

import torch

from methods.artifacts import model_fingerprint
from programs.convert import cache_root
from decode import generate, score_tree
from errors import TooFewRows
from kv_cache import KVCache
from methods.latency import Latency, OnlineLatency
from programs.progress import Progress
from programs.staging import locked, read_saved, write_saved
from tree import Tree
from verify import verify_greedy

ROWS = [2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32]
LATENCY_SIZES = [1, 2, 3, 4, 6, 8, 12, 16, 24, 32]  # where L(n) is measured once (then extrapolated)
CACHED = 256  # tokens in the cache while L(n) is measured
ROUNDS, PASSES_PER_ROUND = 3, 5
LOW_QUANTILE = 0.2  # of a size's passes: load only adds time, so the low end is the machine's own
# A first measurement is saved unless the machine was busy: other programs (or the hypervisor) took more
# than OTHERS_BUSY of its CPU time while it ran (measured: docs/constants.md); where that cannot be read
# (no /proc/stat) or the passes run on a GPU, unless two rounds' medians of a size differ by more than
# ROUNDS_AGREE (bursts on an idle VM alone move them 1.1-1.7x).
OTHERS_BUSY = 0.10
ROUNDS_AGREE = 1.25
FAR_OFF = 1.5  # a saved entry this far (either way) from a size this run measured well is replaced
PROMPTS = [  # for measuring ANPD's and Lookahead's tau(n): chat, code, summary, arithmetic
    "What are three good habits for staying healthy while working from home?",
    "Write a Python function that returns the n-th Fibonacci number, with a docstring.",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new budget. After a "
    "long debate, the council approved more money for parks and libraries, and less for road repairs.",
    "Tom has 12 apples. He gives 5 to Anna and buys 8 more. How many apples does he have? Explain.",
]
NEW_TOKENS = 64


# ---- L(n) --------------------------------------------------------------------------------

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


def timed_pass(model, cache: KVCache, rows: int, whole_step: bool = False) -> float:
    """Seconds of one pass over `rows` new inputs after what `cache` holds (left as it was).
    `whole_step`: a pass of decode.generate's loop, not only the model's: a chain of `rows` guesses,
    its mask and positions, the forward pass and logits, greedy verification, and keeping the accepted
    path's K/V (what cost-aware drafting pays per pass)."""
    cached = cache.length
    tokens = torch.randint(0, model.config.vocab_size, (rows,)).tolist()
    started = time.perf_counter()
    with torch.inference_mode():
        if whole_step:
            tree = Tree.chain(tokens[0], tokens[1:])
            logits = model.logits(score_tree(model, cache, tree))
            cache.keep(cached, verify_greedy(tree, logits).path)
        else:
            model(torch.tensor([tokens], device=model.device), cache=cache, slots=cache.claim(rows),
                  positions=torch.arange(cached, cached + rows, device=model.device))
        if model.device.type == "cuda":
            torch.cuda.synchronize(model.device)
    cache.truncate(cached)
    return time.perf_counter() - started


def step_latency(model, cache: KVCache, rows: int, reps: int, whole_step: bool = False) -> float:
    """The median seconds of `reps` passes over `rows` new inputs (timed_pass), after a warm-up pass
    (the first pass at a new size allocates and picks kernels)."""
    timed_pass(model, cache, rows, whole_step)
    return statistics.median(timed_pass(model, cache, rows, whole_step) for _ in range(reps))


def warmed_cache(model, sizes: list[int], whole_step: bool = False) -> KVCache:
    """A prefilled cache after one untimed pass at each size: the first pass at a new size allocates and
    picks kernels (and, with --compile, compiles: about a minute a size, the first time)."""
    cache = prefilled_cache(model, CACHED, max(sizes))
    for n in sizes:
        timed_pass(model, cache, n, whole_step)
    return cache


def latency_rounds(model, cache: KVCache, sizes: list[int], rounds: int = ROUNDS, reps: int = PASSES_PER_ROUND,
                   whole_step: bool = False) -> dict[int, list[list[float]]]:
    """For each size, `rounds` lists of `reps` timed passes on a `warmed_cache`, the sizes interleaved
    pass by pass (so a burst of load hits every size alike); progress on stderr."""
    passes = {n: [[] for _ in range(rounds)] for n in sizes}
    progress = Progress("measuring L(n)")
    for round_number in range(rounds):
        for _ in range(reps):
            for n in sizes:
                passes[n][round_number].append(timed_pass(model, cache, n, whole_step))
        progress.update(f"round {round_number + 1}/{rounds}")
    progress.done(f"{rounds} rounds of {reps} passes per size")
    return passes


def latencies(model, sizes: list[int], rounds: int = ROUNDS, reps: int = PASSES_PER_ROUND,
              whole_step: bool = False) -> dict[int, float]:
    """L(n) for each size: the LOW_QUANTILE of its passes over interleaved rounds (latency_rounds)."""
    return low_quantiles(latency_rounds(model, warmed_cache(model, sizes, whole_step), sizes, rounds, reps, whole_step))


def low_quantiles(passes: dict[int, list[list[float]]]) -> dict[int, float]:
    """Per size, the LOW_QUANTILE of its passes, all rounds together."""
    pooled = {n: sorted(sum(runs, [])) for n, runs in passes.items()}
    return {n: values[int(LOW_QUANTILE * (len(values) - 1))] for n, values in pooled.items()}


def rounds_disagreement(passes: dict[int, list[list[float]]]) -> float:
    """The largest ratio, over sizes, between two rounds' medians of that size (1: they agree)."""
    return max(max(map(statistics.median, runs)) / min(map(statistics.median, runs)) for runs in passes.values())


def cpu_ticks() -> tuple[float, float, float] | None:
    """(CPU time of all the machine's CPUs, the part of it not idle, this process's own), in clock ticks
    since boot; None where the machine's is not readable (/proc/stat: Linux only). This process's own
    includes its children that ended and were waited for: a program it ran in between its passes, not
    beside them (bench.py's llama.cpp peer: counted as another program's, it made a quiet machine look
    32% busy)."""
    try:
        with open("/proc/stat") as stat:  # cpu  user nice system idle iowait irq softirq steal ...
            fields = [int(field) for field in stat.readline().split()[1:9]]
    except (OSError, ValueError):
        return None
    own = os.times()
    own_seconds = own.user + own.system + own.children_user + own.children_system
    return sum(fields), sum(fields) - fields[3] - fields[4], own_seconds * os.sysconf("SC_CLK_TCK")


def share_of_others(before, after) -> float | None:
    """The share of the machine's CPU time that went to other programs (and the hypervisor's steal)
    between two cpu_ticks() readings; None if either is None."""
    if before is None or after is None:
        return None
    total, busy, own = (a - b for a, b in zip(after, before))
    return max(0.0, busy - own) / total if total > 0 else 0.0


def others_busy(others: float | None) -> bool:
    """Whether other processes took more than OTHERS_BUSY of the CPUs (share_of_others; unknown: no)."""
    return others is not None and others > OTHERS_BUSY


def why_busy(passes: dict[int, list[list[float]]], others: float | None, device_type: str) -> str | None:
    """Why a first measurement of L(n) must not be saved (None: it may): others' share of the CPUs
    while it ran; on a GPU, or where that share is unknown, rounds that disagree."""
    if others_busy(others):
        return f"other programs took {others:.0%} of the CPUs while it measured"
    if others is None or device_type != "cpu":
        disagreement = rounds_disagreement(passes)
        if disagreement > ROUNDS_AGREE:
            return f"rounds differ by up to {disagreement:.2f}x"
    return None


# ---- this machine's table ---------------------------------------------------------------------------

def machine_key(model) -> str:
    where = torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else f"{cpu_name()} x{os.cpu_count()}"
    if hasattr(model, "LABEL"):  # a backend's passes (backends/) cost what model.py's do not
        where += f" {model.LABEL}"
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


def latency_file():
    return cache_root() / "latency.json"


THIS_RUN: dict[str, OnlineLatency] = {}  # machine key -> this process's estimate, shared by its generations


def machine_latency(model) -> OnlineLatency:
    """L(n) on this machine, device, dtype and model, as this process knows it: one OnlineLatency per
    machine key, whose prior is the saved table (measured now if there is none) and which refreshes
    that table as it goes. The latest model asked for is the one whose passes it is shown: a backend that
    compiles or records a pass says so (`prepared_last_pass`), and that pass is no measurement."""
    key = machine_key(model)
    if key not in THIS_RUN:
        THIS_RUN[key] = OnlineLatency(saved_or_measured(model, key), save=refresher(key))
    THIS_RUN[key].untimed = lambda: getattr(model, "prepared_last_pass", False)
    return THIS_RUN[key]


def refresher(key: str):
    """The OnlineLatency's save for `key`: save_or_say, but only after passes timed on an otherwise idle
    machine. Where other processes took more than OTHERS_BUSY of the CPUs since the last refresh, the
    passes timed the load too: this run still decides by them, but they would make the next run's
    start, and the bench's modelled column, wrong, so they are not saved (said once). (torch.compile's
    worker processes count as others: a refresh over a compilation is skipped too, and the next one
    saves.)"""
    last = {"ticks": cpu_ticks(), "said": False}

    def save(online: OnlineLatency) -> None:
        before, last["ticks"] = last["ticks"], cpu_ticks()
        others = share_of_others(before, last["ticks"])
        if others_busy(others):
            if not last["said"]:
                print(f"cost-aware drafting: other processes (other programs, or compiling) took {others:.0%} of the "
                      f"CPUs during this run's last passes; their L(n) is not saved to {latency_file()}", file=sys.stderr)
                last["said"] = True
            return
        save_or_say(key, online)
    return save


def save_or_say(key: str, online: OnlineLatency) -> None:
    """save_measured, mid-generation: a cache it cannot write is said once, and the run goes on."""
    try:
        save_measured(key, online)
    except OSError as err:
        online.save = None  # (no more tries)
        print(f"cost-aware drafting: cannot save L(n) in {latency_file()} ({err.strerror or err}); this run "
              "goes on with its own", file=sys.stderr)


def saved_table(saved: dict, key: str) -> dict[int, dict] | None:
    """{n: {"ms": .., "passes": ..}} saved for `key`, or None when there is none or it is damaged
    (an entry of an older version, a bare number of ms, counts as backed by no passes)."""
    try:
        table = {int(n): entry if isinstance(entry, dict) else {"ms": entry, "passes": 0}
                 for n, entry in saved[key].items()}
        Latency(table_seconds(table))  # positive seconds at sizes >= 1
        return table
    except (KeyError, TypeError, ValueError, AttributeError):
        return None


def table_seconds(table: dict[int, dict]) -> dict[int, float]:
    return {n: float(entry["ms"]) / 1000 for n, entry in table.items()}


def saved_or_measured(model, key: str) -> Latency:
    """The saved table for `key`; else L(n) measured now (progress on stderr), saved unless the
    machine was busy (why_busy). Concurrent first runs take turns: the others find the first one's table. A cache
    this run may not write (read-only, full) leaves the measurement this run's own."""
    path = latency_file()
    try:
        with locked(path):
            return read_or_measure(model, key, save=True)
    except OSError as err:
        print(f"cost-aware drafting: cannot write {path} ({err.strerror or err}); L(n) is this run's own",
              file=sys.stderr)
        return read_or_measure(model, key, save=False)


def read_or_measure(model, key: str, save: bool) -> Latency:
    path = latency_file()
    table = saved_table(read_saved(path), key)
    if table is not None:
        return Latency(table_seconds(table))
    print("cost-aware drafting: measuring this machine's L(n), the cost of a pass over n inputs, once "
          "(some seconds)", file=sys.stderr)
    cache = warmed_cache(model, LATENCY_SIZES, whole_step=True)  # before the CPUs' clock: a warm-up that
    before = cpu_ticks()  # compiles may run worker processes, no sign of a busy machine
    passes = latency_rounds(model, cache, LATENCY_SIZES, whole_step=True)
    measured = low_quantiles(passes)
    busy = why_busy(passes, share_of_others(before, cpu_ticks()), model.device.type)
    if busy:
        print(f"cost-aware drafting: the machine was busy ({busy}), so this L(n) is not saved; this run "
              "corrects it from its own passes", file=sys.stderr)
    elif save:
        saved = read_saved(path)
        saved[key] = {n: {"ms": round(seconds * 1000, 3), "passes": ROUNDS * PASSES_PER_ROUND}
                      for n, seconds in measured.items()}
        write_saved(path, saved)
    return Latency(measured)


def save_measured(key: str, online: OnlineLatency) -> None:
    """Refresh the saved table with the sizes `online` measured well: each entry moves to the mean of
    its saved and new passes; where one is FAR_OFF, the run's whole curve replaces the table (said
    once). Passes already saved are not counted twice."""
    well = online.well_measured()
    if not well:
        return
    path = latency_file()
    with locked(path):
        saved = read_saved(path)
        table = saved_table(saved, key) or {}
        new = {n: online.seen[n] - online.saved_passes.get(n, 0) for n in well}
        far = [n for n in well if n in table and not 1 / FAR_OFF <= well[n] * 1000 / table[n]["ms"] <= FAR_OFF]
        replaced = bool(far) or not table
        if replaced:
            if far and not online.said_far_off:
                n = far[0]
                print(f"cost-aware drafting: the saved L({n}) for this machine ({table[n]['ms']:.1f} ms) is far off "
                      f"what this run measures ({well[n] * 1000:.1f} ms over {len(online.recent[n])} passes): "
                      f"replaced with this run's L(n) in {path}", file=sys.stderr)
                online.said_far_off = True
            table = {n: {"ms": round(online(n) * 1000, 3), "passes": online.seen.get(n, 0)} for n in online.curve.sizes}
        else:
            for n, seconds in well.items():
                if new[n] <= 0:
                    continue
                old = table.get(n, {"ms": 0.0, "passes": 0})
                passes = old["passes"] + new[n]
                table[n] = {"ms": round((old["ms"] * old["passes"] + seconds * 1000 * new[n]) / passes, 3),
                            "passes": passes}
        saved[key] = {n: table[n] for n in sorted(table)}
        write_saved(path, saved)
        online.saved_passes.update(online.seen if replaced else {n: online.seen[n] for n in well})  # (now counted)


# ---- the tree size ---------------------------------------------------------------------------------

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


def calibrated_rows(model, method: str, default: int) -> int:
    """What --calibrate chose for `method` on this machine (said on stderr), else `default`."""
    calibrated = saved_rows(model, method)
    if calibrated is None:
        return default
    print(f"{method}: {calibrated} inputs per pass, as --calibrate chose for this machine", file=sys.stderr)
    return calibrated


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
