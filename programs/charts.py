"""Charts of measurements, and how every figure is saved: the speedup per method and category with
tau on the bars, plain decoding's tokens/s (ours, eager, llama.cpp's) and the step latency L(T)/L(1)
from a bench.py results file, and a calibration's tau(n)
and tau(n) L(1)/L(n) with the chosen size marked (decode.py --calibrate). Each is labelled with the
machine it was measured on. bench.py draws its charts with these, and visualize.py (which draws the
loop's own pictures) redraws them from a saved file.

The colours are the project's: the same kind of thing has the same colour in every figure.
"""

import re
import warnings
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no window: works on a machine without a display
warnings.filterwarnings("ignore", message="Glyph .* missing from font")  # a script the font lacks: drawn as boxes
import matplotlib.pyplot as plt  # noqa: E402

from programs.staging import staged_file  # noqa: E402

COLOURS = {"accepted": "#2ca02c", "rejected": "#d62728", "unreached": "#b0b0b0", "root": "#1f77b4",
           "bonus": "#ff9f1c", "soft": "#9467bd", "model": "#f0f0f0"}
FILLS = {"accepted": "#d8f0d8", "rejected": "#fadcdc", "unreached": "#f4f4f4", "root": "#dbe8f5",
         "bonus": "#ffe9c7", "soft": "#efe6f7"}


# ---- measurements: bench.py results and calibrations ----------------------------------------------------

def speedup_figure(tables: list[dict], machine: str):
    """Speedup over vanilla per category (x) and method (bars), tau written on each bar: in the decode
    phase where the run measured it (the prefill left out), else over the whole generation; a black line
    across a bar at its speedup modelled from L(n) (bench.py: the run's noise taken out). A peer's own
    vanilla (llama.cpp's) is its baseline, not a bar."""
    categories = [t["category"] for t in tables]
    methods = [row[0] for row in tables[0]["rows"] if not row[0].endswith("vanilla")]
    measure = "decode_speedup" if "decode_speedup" in tables[0]["columns"] else "speedup"
    inches = min(18.0, max(7.0, 1.0 + 0.5 * len(methods) * len(categories)))
    fig, ax = plt.subplots(figsize=(inches, 5.2))
    width = 0.8 / max(len(methods), 1)
    tau_size = 8 if (inches - 1) / (len(methods) * len(categories)) >= 0.3 else 5.5  # fit inside thin bars
    colours = plt.get_cmap("tab10" if len(methods) <= 10 else "tab20")
    for m, method in enumerate(methods):
        for c, t in enumerate(tables):
            row = next((r for r in t["rows"] if r[0] == method), None)
            if row is None:
                continue
            values = dict(zip(t["columns"], row))
            x = c - 0.4 + width * (m + 0.5)
            ax.bar(x, values[measure] or 0.0, width, color=colours(m), label=method if c == 0 else None,
                   gid=f"bar-{method}-{t['category']}")
            ax.text(x, 0.03, f"τ {values['tau']:.2f}", ha="center", va="bottom", fontsize=tau_size, rotation=90,
                    color="black")  # inside the bar, clear of the vanilla line
            if values.get("modelled_speedup") is not None and measure == "decode_speedup":
                ax.plot([x - width * 0.45, x + width * 0.45], [values["modelled_speedup"]] * 2, color="black", lw=1.5,
                        label="modelled from L(n)" if (m, c) == (0, 0) else None, gid=f"modelled-{method}-{t['category']}")
    ax.axhline(1.0, color="black", lw=1, ls="--")
    ax.text(-0.48, 1.01, "vanilla", va="bottom", ha="left", fontsize=8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("speedup over vanilla, decode phase (same run)" if measure == "decode_speedup"
                  else "speedup over vanilla (tokens/s, same run)")
    ax.set_ylim(0, max(ax.get_ylim()[1], 1.2) * 1.12)
    ax.legend(fontsize=8, ncol=min(len(methods), 6), loc="upper left", frameon=False)
    first = tables[0]
    mode = f"sampling at temperature {first['temperature']}" if first.get("temperature") else "greedy"
    peers = " (llama.cpp's over its own vanilla)" if any(m.startswith("llama.cpp") for m in methods) else ""
    ax.set_title(f"Speedup over vanilla{peers}, τ = tokens per forward pass: {first['dtype']}, {mode}, "
                 f"{first['prompts']} prompt(s) per category, up to {first['new_tokens']} new tokens\n{machine}",
                 fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def vanillas(table: dict) -> list[str]:
    """The rows of a methods table that decode plainly: ours, ours eager (a --fused or --compile run's
    model.py passes), a peer's own vanilla (llama.cpp's); not vanilla timed again."""
    return [row[0] for row in table["rows"] if row[0] == "vanilla" or row[0].startswith("vanilla, ")
            or row[0].endswith(" vanilla")]


def vanilla_figure(tables: list[dict], machine: str, passes: str):
    """Plain decoding's decode-phase tokens/s per category (x), one bar per way of decoding plainly in the
    run (ours as the run decoded, `passes` naming how: "fused", ...; ours eager; llama.cpp's), the number
    on each bar."""
    categories = [t["category"] for t in tables]
    names = vanillas(tables[0])
    labels = {"vanilla": f"ours ({passes})" if passes else "ours", "vanilla, eager": "ours, eager (model.py's passes)"}
    fig, ax = plt.subplots(figsize=(max(6.0, 1.5 * len(categories) + 2), 4.2))
    width = 0.8 / len(names)
    colours = plt.get_cmap("tab10")
    for n, name in enumerate(names):
        for c, t in enumerate(tables):
            values = dict(zip(t["columns"], next(r for r in t["rows"] if r[0] == name)))
            x = c - 0.4 + width * (n + 0.5)
            rate = values["decode_tokens_per_second"] or 0.0
            ax.bar(x, rate, width, color=colours(n), label=labels.get(name, name) if c == 0 else None,
                   gid=f"bar-{name}-{t['category']}")
            ax.text(x, rate, f"{rate:.1f}", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(categories)), categories)
    ax.set_ylabel("vanilla decoding, decode phase: tokens/s (same run)")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.15)
    ax.legend(fontsize=8, ncol=len(names), loc="upper left", frameon=False)
    first = tables[0]
    ax.set_title(f"Plain decoding's speed: {first['dtype']}, greedy, {first['prompts']} prompt(s) per category, up to "
                 f"{first['new_tokens']} new tokens\n{machine}", fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def latency_figure(tables: list[dict], machine: str):
    """L(T)/L(1) against T: what verifying T inputs in one pass costs next to one token."""
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for t in tables:
        sizes = [int(size) for column in t["columns"] for size in re.findall(r"^L\((\d+)\)$", column)]
        for row in t["rows"]:
            values = dict(zip(t["columns"], row))
            ratios = [values[f"L({n})"] / values["L(1)"] for n in sizes]
            cached = sorted({r[t["columns"].index("cached")] for r in t["rows"]})
            ax.plot(sizes, ratios, marker="o", label=f"{values['model']}, {values['cached']} cached ({t['dtype']})",
                    color=COLOURS["root"] if values["model"] == "ours" else COLOURS["bonus"],
                    ls=["-", "--", ":"][cached.index(values["cached"]) % 3])
    ax.set_xscale("log", base=2)
    ax.set_xticks(sizes, [str(n) for n in sizes])
    ax.axhline(1.0, color="black", lw=0.8)
    ax.set_xlabel("T: inputs in one forward pass")
    ax.set_ylabel("L(T) / L(1)")
    ax.legend(fontsize=8, frameon=False)
    ax.set_title(f"Step latency: one pass over T inputs, next to one\n{machine}", fontsize=9, loc="left")
    fig.tight_layout()
    return fig


def calibration_figure(machine: str, methods: dict[str, dict]):
    """tau(n) and tau(n) L(1)/L(n) per method, the chosen n starred, and L(n)/L(1)."""
    fig, (cost, gain) = plt.subplots(1, 2, figsize=(11, 4.3))
    for i, (method, saved) in enumerate(sorted(methods.items())):
        table = saved["table"]
        n = [e["rows"] for e in table]
        colour = plt.get_cmap("tab10")(i)
        cost.plot(n, [e["tau"] / e["predicted_speedup"] for e in table], marker=".", color=colour, label=method)
        gain.plot(n, [e["predicted_speedup"] for e in table], marker="o", color=colour, label=f"{method}: tau L(1)/L(n)")
        gain.plot(n, [e["tau"] for e in table], ls=":", color=colour, label=f"{method}: tau(n)")
        best = next(e for e in table if e["rows"] == saved["rows"])
        gain.scatter([best["rows"]], [best["predicted_speedup"]], marker="*", s=250, color=colour, zorder=3,
                     edgecolor="black", gid=f"chosen-{method}-{best['rows']}")
        gain.annotate(f"n = {best['rows']}", (best["rows"], best["predicted_speedup"]), textcoords="offset points",
                      xytext=(-10, -16), ha="right", fontsize=8)  # below left: clear of the title and the edge
    cost.set_xlabel("n: inputs per forward pass")
    cost.set_ylabel("L(n) / L(1)")
    cost.set_title("what a pass over n inputs costs", fontsize=9, loc="left")
    gain.set_xlabel("n: inputs per forward pass")
    gain.set_ylabel("tokens per pass, and per L(1) of time")
    gain.set_title("tau(n), and tau(n) L(1)/L(n): the predicted speedup (★ the size chosen)", fontsize=9, loc="left")
    for ax in (cost, gain):
        ax.legend(fontsize=7, frameon=False)
        ax.grid(color="#eeeeee")
    fig.suptitle(f"Calibration (decode.py --calibrate) on {machine}", fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def machine_label(machine: dict) -> str:
    """Where a bench.py run measured: the GPU or the CPU model, its cores and threads, torch."""
    where = machine.get("gpu") or f"{machine.get('cpu', '?')}, {machine.get('cores', '?')} cores"
    passes = passes_label(machine)
    graphs = f" ({passes})" if passes else ""
    return (f"{where} · {machine.get('device', '?')}{graphs} · {machine.get('threads', '?')} threads · "
            f"torch {machine.get('torch', '?')}")


def passes_label(machine: dict) -> str:
    """How a bench.py run ran our decoding passes, if not as model.py's reference ones: its --backend (or,
    in results from before that option, the flag it was given), or ""."""
    if machine.get("backend"):
        return "" if machine["backend"] == "reference" else machine["backend"]
    return next((label for key, label in [("cuda_graphs", "CUDA graphs"), ("compiled", "compiled"), ("fused", "fused")]
                 if machine.get(key)), "")


def bench_figures(results: dict) -> dict[str, object]:
    """The charts a bench.py results file holds data for, by name."""
    machine = machine_label(results.get("machine", {}))
    figures = {}
    for dtype in sorted({t["dtype"] for t in results["tables"] if t.get("kind") == "methods"}):
        tables = [t for t in results["tables"] if t.get("kind") == "methods" and t["dtype"] == dtype]
        figures[f"speedup-{dtype}"] = speedup_figure(tables, machine)
        if len(vanillas(tables[0])) > 1:
            figures[f"vanilla-{dtype}"] = vanilla_figure(tables, machine, passes_label(results.get("machine", {})))
    latency = [t for t in results["tables"] if t.get("kind") == "step_latency"]
    if latency:
        figures["step-latency"] = latency_figure(latency, machine)
    return figures


# ---- saving -----------------------------------------------------------------------------------------------

def save(fig, folder: Path, name: str, formats: list[str]) -> list[Path]:
    """The figure as folder/name.<format> for each format, each written whole before it is renamed."""
    folder.mkdir(parents=True, exist_ok=True)
    paths = []
    for fmt in formats:
        path = folder / f"{name}.{fmt}"
        with staged_file(path) as tmp:
            fig.savefig(tmp, format=fmt, dpi=150, bbox_inches="tight", metadata={"Date": None} if fmt == "svg" else None)
        paths.append(path)
    plt.close(fig)
    return paths
