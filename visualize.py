"""Pictures of guess-and-verify decoding, drawn from real runs (matplotlib).

    python visualize.py step --method ppd --prompt "Explain what a hash table is."
    python visualize.py answer --methods anpd lookahead --prompt "Summarize in two sentences: ..."
    python visualize.py cost --method auto --prompt "Summarize in two sentences: ..."
    python visualize.py threads --apar-guesses anpd --prompt "Give me five tips for learning a new language."
    python visualize.py bench bench-methods.json     # the charts of a bench.py run (also bench.py --plot)
    python visualize.py calibration                  # tau(n) / L(n) as decode.py --calibrate measured it

`step` decodes the prompt greedily, records every forward pass (decode.Pass) and draws one of them:
- TREE: the candidate tree the pass scored, x = depth, the accepted path in green with the bonus token
  after it, rejected guesses in red with the model's own choice beside them, unreached ones grey, and
  (PPD) the soft tokens each node carries as dashed boxes;
- MASK: the attention mask of the pass over [the tail of the cache + the pass's inputs], tokens on
  both axes: every input sees the whole cache, then its own ancestors (tree.py);
- POSITIONS: the RoPE position each input row is given, in the order the rows are laid out:
  cache length + depth, so siblings share a position and a soft token sits where its guess would.
`answer` decodes the prompt with each method (and vanilla) and draws each answer's tokens coloured by
who chose them: an accepted guess (green) or the model itself (the bonus token of a pass, or vanilla),
with a bar under the tokens of each pass.
`cost` decodes the prompt with a method's cost-aware drafter (cost_aware.py) and draws, per pass, the
guesses it was offered, those it sent and those accepted, next to how many it expected to be accepted,
and below, how its acceptance estimates for the most frequent kinds of guess moved as the answer went.
`threads` decodes the prompt with APAR (and with --apar-guesses, APAR with a drafter per thread) and
draws a row per generation thread and a cell per forward pass it took tokens in: where threads fork,
how many step together in one pass, where they end, and where a thread accepted guesses.
`bench` and `calibration` draw measurements: speedup per method and category with tau on the bars,
L(T)/L(1) against T, tau(n) and tau(n) L(1)/L(n) with the chosen size marked; each is labelled with the
machine it was measured on.

Every figure is saved as PNG and SVG (--formats). In the SVG each node, token and cell carries an id
saying what it shows (e.g. `node-3-accepted`), which the tests read back.
"""

import argparse
import functools
import json
import sys
from collections import Counter
from dataclasses import astuple, dataclass, replace
from pathlib import Path

import errors  # noqa: F401 (imported before torch, so that Ctrl-C while torch loads is one line too)
import torch
from matplotlib.colors import ListedColormap
from matplotlib.patches import Patch, Rectangle
from matplotlib.ticker import MaxNLocator

from calibrate import calibration_file
from programs.charts import COLOURS, FILLS, bench_figures, calibration_figure, plt, save
from methods.cost_aware import CostAware
from decode import Generation, Pass, generate
from errors import DefaultsHelpFormatter, OneLineErrorParser, UserError, integer, run_program
from methods.registry import METHODS, add_method_options, add_model_options, build_drafter, load, refuse_idle_options
from programs.prompts import Prompt, checked, prompt_ids
from programs.show_tree import visible

GUESSING_METHODS = [name for name, method in METHODS.items() if method.guesses and method.drafter]
CHAR = 0.083  # inches per character of 10-point DejaVu Sans Mono (0.6 em)
CONFIDENCE = plt.get_cmap("Blues")  # a guess's chance, 0 (white) to 1 (dark blue)


def label(text: str, width: int = 14) -> str:
    """A token's text for a figure: spaces as ␣, newlines as ↵, cut to `width` characters; ∅ for a
    token with no text (matplotlib would draw nothing at all)."""
    shown = visible(text, space="␣") or "∅"
    return shown if len(shown) <= width else shown[:width - 1] + "…"


# ---- one pass: the tree, its mask, its positions ----------------------------------------------------

def tree_rows(tree, extra: dict) -> dict:
    """The row of each item (from the top): leaves one row apart in depth-first order, a parent level
    with the middle of its children. Items are the nodes and, under a node, `extra[node]`: the bonus
    token and soft tokens drawn as its last children."""
    rows, next_row = {}, [0]

    def place(item):
        children = (tree.children[item] + extra.get(item, [])) if isinstance(item, int) else []
        if not children:
            rows[item] = next_row[0]
            next_row[0] += 1
        else:
            for child in children:
                place(child)
            rows[item] = (rows[children[0]] + rows[children[-1]]) / 2
    place(0)
    return rows


def tree_figure(step: Pass, text_of, title: str):
    """The candidate tree of one pass, the accepted path and bonus token highlighted. Where the guesser
    gave each guess a chance (p: EAGLE's draft confidence, Medusa's measured accuracy, ...), a guess is
    filled by that chance and outlined by what the verdict made of it, so that confidence can be read
    against acceptance; otherwise it is filled by the verdict."""
    tree, verdict = step.tree, step.verdict
    outcomes = step.outcomes()
    chances = {node: max(prior for _, prior in tree.evidence[node]) for node in range(1, len(tree)) if tree.evidence[node]}
    by_chance = len(chances) == len(tree) - 1 > 0
    labels = [label(text_of([token])) for token in tree.tokens]
    extra = {node: [("soft", node)] for node in range(len(tree)) if tree.extra_rows(node)}
    if step.bonus_emitted:
        extra[verdict.path[-1]] = [("bonus",)] + extra.get(verdict.path[-1], [])
    rows = tree_rows(tree, extra)
    column = CHAR * max(len(text) for text in [*labels, "2 soft tokens"]) + 0.8  # inches between depths
    row, top = (0.75 if chances else 0.5), 0.75  # inches between rows (room for the chance above a guess); for the title
    depth = max([tree.depths[node] + 1 for node in extra] + tree.depths)
    height = top + row * (max(rows.values()) + 1) + (1.5 if by_chance else 0.9)  # and room for the legend
    width = max(column * (depth + 1) + 0.6, 7.5)
    fig = plt.figure(figsize=(width, height))
    ax = fig.add_axes((0, 0, 1, 1))
    ax.set_xlim(-0.3, width - 0.3)
    ax.set_ylim(height, 0)
    ax.axis("off")

    def at(item):
        depth = tree.depths[item] if isinstance(item, int) else tree.depths[item[-1] if item[0] == "soft" else verdict.path[-1]] + 1
        return depth * column, top + row * (rows[item] + 0.5)

    def edge(parent, item, **style):
        (x0, y0), (x1, y1) = at(parent), at(item)
        ax.plot([x0, x1 - 0.4, x1 - 0.4, x1], [y0, y0, y1, y1], **({"zorder": 1} | style))

    def box(item, text, kind, **style):
        x, y = at(item)
        fill, ink = FILLS[kind], "#777777" if kind == "unreached" else "black"
        if by_chance and item in chances:
            fill, ink = CONFIDENCE(chances[item]), "white" if chances[item] > 0.55 else "black"
        elif by_chance:  # the root and the bonus token are not guesses: white, so that blue means a chance
            fill = "white"
        ax.text(x, y, text, family="monospace", fontsize=10, va="center", ha="left", zorder=2,
                color=ink, gid=style.pop("gid"), bbox=dict(boxstyle="round,pad=0.3", fc=fill, ec=COLOURS[kind], **style))

    for node in range(1, len(tree)):
        on_path = outcomes[node] == "accepted"
        edge(tree.parents[node], node, color=COLOURS["accepted"] if on_path else "#999999", lw=3 if on_path else 1,
             zorder=1.5 if on_path else 1, gid=f"edge-{tree.parents[node]}-{node}")  # the path over the rest
    for node in range(len(tree)):
        kind = "root" if node == 0 else outcomes[node]
        box(node, labels[node], kind, lw=(3 if by_chance else 2) if kind in ("accepted", "rejected") else 1,
            gid=f"node-{node}-{kind}")
        if node in chances:  # the guesser's own chance for it, above it (cost-aware's prior)
            x, y = at(node)
            ax.text(x + 0.05, y - 0.3, f"p {chances[node]:.2f}", fontsize=7, color="#555555", va="center",
                    family="monospace")
        if kind == "rejected":  # what the model chose instead, under the refused guess
            x, y = at(node)
            ax.text(x + 0.05, y + (0.3 if chances else 0.245), f"model: {label(text_of([step.choices[tree.parents[node]]]), 10)}",
                    fontsize=7, color=COLOURS["rejected"], va="center", family="monospace")
        if tree.extra_rows(node):
            count, copies = soft_tokens_on(tree, node)
            copies = f" ×{copies}" if copies > 1 else ""
            edge(node, ("soft", node), color=COLOURS["soft"], lw=1, ls=":")
            box(("soft", node), f"{count} soft token{'s' if count > 1 else ''}{copies}", "soft", ls="--",
                gid=f"soft-{node}")
    if step.bonus_emitted:
        edge(verdict.path[-1], ("bonus",), color=COLOURS["bonus"], lw=2.5, ls="--")
        box(("bonus",), label(text_of([verdict.tokens[-1]])), "bonus", lw=2, gid="bonus")
    legend = [Patch(fc="white" if by_chance else FILLS[k], ec=COLOURS[k],
                    lw=2 if by_chance and k != "unreached" else 1, label=text) for k, text in [
        ("root", "root: the last chosen token"), ("accepted", "accepted guess"),
        ("rejected", "rejected (the model's choice under it)"), ("unreached", "unreached"),
        ("bonus", "bonus: the model's choice after the path")]]
    if by_chance:  # the fill's scale, beside the legend
        scale = fig.add_axes((0.15 / width, 0.9 / height, 2.5 / width, 0.12 / height))
        scale.imshow([[i / 100 for i in range(101)]], cmap=CONFIDENCE, aspect="auto", extent=(0, 1, 0, 1), vmin=0, vmax=1)
        scale.set_yticks([])
        scale.set_xticks([0, 0.5, 1])
        scale.tick_params(labelsize=7)
        scale.set_title("fill: the guesser's chance p", fontsize=8)
    if tree.extra:
        legend.append(Patch(fc=FILLS["soft"], ec=COLOURS["soft"], ls="--", label="soft tokens: the next guesses"))
    ax.legend(handles=legend, loc="lower left", bbox_to_anchor=(0.0, 0.0), ncol=3, fontsize=8, frameon=False)
    ax.text(0, 0.35, title, fontsize=11, va="center")
    return fig


def soft_tokens_on(tree, node: int) -> tuple[int, int]:
    """(soft tokens, copies of each) of the extra inputs hung on `node` (PPD's, by their distances)."""
    offsets = [tree.extra.offset[row - len(tree)] for row in tree.extra_rows(node)]
    count = len(set(offsets))
    return count, len(offsets) // max(count, 1)


def input_labels(step: Pass, text_of) -> list[str]:
    """One label per input row of the pass: "i token" for node i, "soft +d" for node i's soft tokens
    ("#c": copy c, when there are several)."""
    tree = step.tree
    labels = [f"{node} {label(text_of([token]), 10)}" for node, token in enumerate(tree.tokens)]
    seen = Counter()
    for node, distance in zip(*(tree.extra.node, tree.extra.offset) if tree.extra else ((), ())):
        seen[node, distance] += 1
        copies = soft_tokens_on(tree, node)[1]
        labels.append(f"{node} soft +{distance}" + (f" #{seen[node, distance]}" if copies > 1 else ""))
    return labels


def mask_figure(step: Pass, cached_ids: list[int], text_of, tail: int, title: str):
    """The attention mask of the pass over [the last `tail` cached tokens + its inputs] as a heat map."""
    tree = step.tree
    mask = tree.input_mask(step.cache_length)  # [R, cache + R]
    shown_cache = min(tail, step.cache_length)
    mask = mask[:, step.cache_length - shown_cache:]
    rows = mask.shape[0]
    kinds = torch.zeros(mask.shape, dtype=torch.long)  # 0 not seen, 1 a cached token, 2 an ancestor (or itself)
    kinds[:, :shown_cache] = mask[:, :shown_cache].long()
    kinds[:, shown_cache:] = 2 * mask[:, shown_cache:].long()
    inputs = input_labels(step, text_of)
    cache_labels = [f"{label(text_of([t]), 10)} {step.cache_length - shown_cache + i}"
                    for i, t in enumerate(cached_ids[-shown_cache:] if shown_cache else [])]
    cell = 0.3
    fig, ax = plt.subplots(figsize=(cell * mask.shape[1] + 2.8, cell * rows + 2.6))
    ax.imshow(kinds.numpy(), cmap=ListedColormap(["white", "#c6dbef", "#2171b5"]), vmin=0, vmax=2,
              aspect="equal", interpolation="nearest")
    ax.set_xticks(range(mask.shape[1]), cache_labels + inputs, rotation=90, family="monospace", fontsize=8)
    ax.set_yticks(range(rows), inputs, family="monospace", fontsize=8)
    outcomes = step.outcomes() + ["soft"] * (rows - len(tree))
    for tick, outcome in zip(ax.get_yticklabels(), outcomes):
        tick.set_color({"accepted": COLOURS["accepted"], "rejected": COLOURS["rejected"],
                        "unreached": "#888888", "soft": COLOURS["soft"]}[outcome])  # as in the legend
        tick.set_gid(f"row-{outcome}")
    ax.set_xticks([x - 0.5 for x in range(mask.shape[1] + 1)], minor=True)
    ax.set_yticks([y - 0.5 for y in range(rows + 1)], minor=True)
    ax.grid(which="minor", color="#dddddd", lw=0.5)
    ax.tick_params(which="minor", length=0)
    if shown_cache:
        ax.axvline(shown_cache - 0.5, color="black", lw=1.5)
    ax.set_xlabel(f"keys: the last {shown_cache} of {step.cache_length} cached tokens (with their positions), "
                  "then this pass's inputs", fontsize=9)
    ax.set_ylabel("queries: this pass's inputs", fontsize=9)
    label_colours = {"accepted guess": COLOURS["accepted"], "rejected guess": COLOURS["rejected"],
                     "unreached guess": "#888888", "soft token": COLOURS["soft"]}
    legend = ax.legend(handles=[Patch(fc="#c6dbef", label="sees a cached token"),
                                Patch(fc="#2171b5", label="sees itself or an ancestor"),
                                Patch(fc="white", ec="#999999", label="hidden"),
                                *[Patch(fc="none", ec="none", label=f"{text} (row label)") for text in label_colours]],
                       loc="upper left", bbox_to_anchor=(1.01, 1), fontsize=8, frameon=False)
    for text, colour in zip(legend.get_texts()[3:], label_colours.values()):
        text.set_color(colour)
    ax.set_title(title, fontsize=10, loc="left")
    return fig


def positions_figure(step: Pass, text_of, title: str):
    """The RoPE position of each input row, rows in the order they are laid out in the pass."""
    tree = step.tree
    positions = tree.input_positions(step.cache_length).tolist()
    inputs = input_labels(step, text_of)
    outcomes = step.outcomes() + ["soft"] * (len(positions) - len(tree))
    fig, ax = plt.subplots(figsize=(max(6.0, 1.1 * (max(positions) - step.cache_length + 3) + 2.5),
                                    0.3 * len(positions) + 1.8))
    for row, parent in enumerate(tree.parents):
        if parent >= 0:
            on_path = outcomes[row] == "accepted"
            ax.plot([positions[parent], positions[row]], [parent, row], zorder=1, lw=2 if on_path else 1,
                    color=COLOURS["accepted"] if on_path else "#bbbbbb")
    for row, node in enumerate(tree.extra.node if tree.extra else (), start=len(tree)):
        ax.plot([positions[node], positions[row]], [node, row], color=COLOURS["soft"], lw=0.8, ls=":", zorder=1)
    for row, (position, outcome) in enumerate(zip(positions, outcomes)):
        kind = "root" if row == 0 else outcome
        ax.scatter([position], [row], s=60, zorder=2, color=COLOURS[kind], marker="D" if kind == "soft" else "o",
                   gid=f"position-{row}-{position}")
    ax.set_yticks(range(len(inputs)), inputs, family="monospace", fontsize=8)
    ax.set_ylim(len(inputs) - 0.5, -0.5)
    ax.set_xticks(range(step.cache_length, max(positions) + 1))
    ax.set_xlim(step.cache_length - 0.7, max(positions) + 0.7)
    ax.set_xlabel(f"position (the cache holds positions 0..{step.cache_length - 1}: position = "
                  f"{step.cache_length} + depth; a soft token: its node's + distance)", fontsize=9)
    ax.set_ylabel("input row, in the pass's layout", fontsize=9)
    ax.grid(axis="x", color="#eeeeee")
    ax.set_title(title, fontsize=10, loc="left")
    return fig


def chosen_pass(passes: list[Pass], number: int | None) -> int:
    """--pass, else the pass that accepted the most guesses (the first of them)."""
    if not passes:
        raise UserError("the answer ended at the prefill: there is no pass to draw (ask for more tokens)")
    if number is not None:
        if number > len(passes):
            raise UserError(f"--pass {number}: the answer took only {len(passes)} passes after the prefill")
        return number
    return max(range(len(passes)), key=lambda i: (passes[i].verdict.accepted_guesses, -i)) + 1


# ---- answers coloured by source -----------------------------------------------------------------------

def pass_spans(from_draft: list[bool]) -> list[tuple[int, int]]:
    """[start, end) of each pass's tokens: its accepted guesses, then the model's own (bonus) token."""
    spans, start = [], 0
    for i, guessed in enumerate(from_draft):
        if not guessed:
            spans.append((start, i + 1))
            start = i + 1
    if start < len(from_draft):  # the stop rule ended the answer among accepted guesses
        spans.append((start, len(from_draft)))
    return spans


def draw_cost(args) -> list[Path]:
    model, tokenizer, ids = loaded(args, [args.method])
    drafter = build_drafter(METHODS[args.method], args, model, tokenizer)
    if not isinstance(drafter, CostAware):
        raise UserError("--fixed-size sends the whole tree every pass: there is no cut to draw; leave it out")
    cuts, accepted, estimates, priors = [], [], [], {}

    def watch(step: Pass):
        cuts.append(drafter.last_cut)
        accepted.append(step.verdict.accepted_guesses)
        priors.update({key: prior for evidence in step.tree.evidence for key, prior in evidence})
        estimates.append({key: (drafter.costs.estimates.probability(key, prior), drafter.costs.estimates.judged[key])
                          for key, prior in priors.items()})
    with torch.inference_mode():
        gen = generate(model, ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids, drafter=drafter,
                       on_pass=watch)
    title = (f"{args.method}, cost-aware: {len(gen.token_ids)} tokens in {gen.counts.forward_passes} forward passes, "
             f"{sum(accepted)} accepted guesses of {sum(c.sent for c in cuts)} sent "
             f"({sum(c.candidates for c in cuts)} offered)\nprompt: {visible(short(args.prompt))}")
    return save(cost_figure(cuts, accepted, estimates, title), args.out, f"cost-{args.method}", args.formats)


def answer_figure(answers: dict[str, Generation], text_of, title: str, columns: int = 84):
    """Each method's answer, token by token: accepted guesses green, the model's own choices plain, a
    bar under each pass's tokens."""
    layouts = {}
    for name, gen in answers.items():  # (column, line, text) per token, wrapped at `columns` characters
        cells, column, line = [], 0, 0
        for token in gen.token_ids:
            text = visible(text_of([token]), space=" ") or "∅"  # a token with no text still takes a pass's place
            if column + len(text) > columns:
                column, line = 0, line + 1
            cells.append((column, line, text))
            column += len(text)
            if text.endswith("↵"):
                column, line = 0, line + 1
        layouts[name] = cells
    line_height = 0.3
    heights = [max((c[1] for c in cells), default=0) + 2.6 for cells in layouts.values()]
    fig, axes = plt.subplots(len(answers), 1, figsize=(CHAR * columns + 0.8, line_height * sum(heights) + 0.8),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, gen) in zip(axes[:, 0], answers.items()):
        cells = layouts[name]
        lines = max((c[1] for c in cells), default=0) + 1
        ax.set_xlim(-0.2, CHAR * columns + 0.2)
        ax.set_ylim(line_height * (lines + 0.3), -line_height * 0.6)
        ax.axis("off")
        for (column, line, text), guessed, i in zip(cells, gen.from_draft, range(len(cells))):
            if guessed:  # the highlight first, under the text, exactly as wide as the token
                ax.add_patch(Rectangle((CHAR * column, line * line_height - 0.12), CHAR * len(text), 0.24,
                                       fc=FILLS["accepted"], ec="none", zorder=1))
            ax.text(CHAR * column, line * line_height, text, family="monospace", fontsize=10, va="center",
                    zorder=2, gid=f"token-{i}-{'guess' if guessed else 'model'}")
        for number, (start, end) in enumerate(pass_spans(gen.from_draft)):
            for line in sorted({cells[i][1] for i in range(start, end)}):
                on_line = [cells[i] for i in range(start, end) if cells[i][1] == line]
                x0, x1 = CHAR * on_line[0][0], CHAR * (on_line[-1][0] + len(on_line[-1][2]))
                ax.plot([x0 + 0.01, x1 - 0.01], [line * line_height + 0.14] * 2, lw=2, solid_capstyle="butt",
                        color="#555555" if number % 2 else "#aaaaaa")
        guesses = sum(gen.from_draft)
        ax.set_title(f"{name}: {len(gen.token_ids)} tokens in {gen.counts.forward_passes} forward passes "
                     f"({len(gen.token_ids) / gen.counts.forward_passes:.2f} per pass), {guesses} of them accepted "
                     "guesses (green); a bar under each pass's tokens", fontsize=9, loc="left")
    fig.suptitle(title, fontsize=11, x=0.01, ha="left")
    fig.tight_layout()
    return fig


def cost_figure(cuts: list, accepted: list[int], estimates: list[dict], title: str, keys_shown: int = 5):
    """Per pass: guesses offered (outline), sent (red) and accepted (green, over the red), and the
    accepted guesses expected of those sent (dots); below, the estimate of the `keys_shown` most
    judged kinds of guess before each pass."""
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(13, 6.4), sharex=True, gridspec_kw={"height_ratios": [3, 2]})
    passes = range(1, len(cuts) + 1)
    for i, cut, hits in zip(passes, cuts, accepted):
        top.bar(i, cut.candidates, 0.8, fc="none", ec=COLOURS["unreached"], gid=f"pass-{i}-offered")
        top.bar(i, cut.sent, 0.8, color=FILLS["rejected"], ec=COLOURS["rejected"], lw=0.5, gid=f"pass-{i}-sent")
        top.bar(i, hits, 0.8, color=COLOURS["accepted"], gid=f"pass-{i}-accepted")
    top.plot(list(passes), [cut.expected for cut in cuts], "k.", ms=4, label="expected accepted (of those sent)")
    top.legend(handles=[Patch(fc="none", ec=COLOURS["unreached"], label="offered by the drafter"),
                        Patch(fc=FILLS["rejected"], ec=COLOURS["rejected"], label="sent"),
                        Patch(fc=COLOURS["accepted"], label="accepted"), *top.get_legend_handles_labels()[0]],
               fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    top.set_ylabel("guesses")
    top.xaxis.set_major_locator(MaxNLocator(integer=True))
    judged = {}
    for seen in estimates:
        judged.update({key: n for key, (_, n) in seen.items()})
    for key in sorted(judged, key=lambda k: -judged[k])[:keys_shown]:
        bottom.plot(list(passes), [seen[key][0] if key in seen else None for seen in estimates], lw=1.5,
                    label=" ".join(map(str, key)) + f" ({judged[key]} judged)", gid="estimate-" + "-".join(map(str, key)))
    bottom.set_ylim(0, 1)
    bottom.set_ylabel("P(accepted | parent accepted)")
    bottom.set_xlabel("forward pass (after the prefill)")
    bottom.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False,
                  title="estimate per kind of guess\n(source, evidence)", title_fontsize=8, alignment="left")
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout()
    return fig


# ---- APAR: its threads over the forward passes -------------------------------------------------------

@dataclass
class ThreadRun:
    """One APAR generation and every verdict its threads took (apar.generate_apar's `watch`)."""
    gen: object  # apar.AparGeneration
    verdicts: list  # apar.ThreadPass: each verdict a thread took


def threads_figure(runs: dict[str, ThreadRun], text_of, control, eos_ids, title: str):
    """Per run: a row per generation thread (the root on top, children in the order they were forked),
    a cell per forward pass in which the thread took tokens: plain when it took the model's own one
    token, green when it accepted guesses (the number: tokens taken). A [Fork] the thread wrote is a
    purple mark, a grey line goes from it to the child it started, a black bar is the thread's EOS."""
    heights = [1 + 0.32 * run.gen.threads for run in runs.values()]
    passes = max(run.gen.counts.forward_passes for run in runs.values())
    fig, axes = plt.subplots(len(runs), 1, figsize=(min(4 + 0.13 * passes, 30), sum(heights) + 1.2),
                             gridspec_kw={"height_ratios": heights}, squeeze=False)
    for ax, (name, run) in zip(axes[:, 0], runs.items()):
        written = {}  # thread -> its tokens, for its label
        for number, thread, tokens, accepted, forked in map(astuple, run.verdicts):
            written.setdefault(thread, []).extend(tokens)
            kind = "accepted" if accepted else "bonus"
            ax.add_patch(Rectangle((number - 0.45, thread - 0.32), 0.9, 0.64, fc=FILLS[kind], ec=COLOURS[kind],
                                   lw=0.6, gid=f"pass-{number}-thread-{thread}-{kind}"))
            if accepted:
                ax.text(number, thread, str(len(tokens)), ha="center", va="center", fontsize=6)
            if control.fork in tokens:
                ax.plot(number, thread - 0.32, marker="v", color=COLOURS["soft"], markersize=4)
            for child in forked:
                ax.plot([number, number + 1], [thread, child], color="#999999", lw=0.7, zorder=0)
            if set(tokens) & eos_ids:
                ax.plot([number + 0.45] * 2, [thread - 0.35, thread + 0.35], color="black", lw=2)
        labels = [label(text_of([t for t in written.get(thread, []) if t not in {control.fork, control.child}])
                        .strip(), 28) for thread in range(run.gen.threads)]
        ax.set_yticks(range(run.gen.threads), [f"{thread}: {text}" for thread, text in enumerate(labels)],
                      fontsize=7, family="monospace")
        ax.set_ylim(run.gen.threads - 0.5, -0.7)
        ax.set_xlim(0.3, passes + 0.7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("forward pass", fontsize=8)
        ax.tick_params(axis="x", labelsize=7)
        ax.set_title(f"{name}: {len(run.gen.token_ids)} tokens in {run.gen.counts.forward_passes} forward passes, "
                     f"{run.gen.threads} threads ({run.gen.counts.guesses_accepted} accepted guesses)", fontsize=9, loc="left")
    legend = [Patch(fc=FILLS["bonus"], ec=COLOURS["bonus"], label="the thread took the model's one token"),
              Patch(fc=FILLS["accepted"], ec=COLOURS["accepted"], label="... and accepted guesses (tokens taken)"),
              plt.Line2D([], [], marker="v", color=COLOURS["soft"], lw=0, label="it wrote [Fork]: a child starts"),
              plt.Line2D([], [], color="black", lw=2, label="EOS: the thread ends")]
    fig.suptitle(title, fontsize=10, x=0.01, ha="left")
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.legend(handles=legend, loc="upper right", fontsize=7, ncol=2, frameon=False)
    return fig


def build_parser() -> argparse.ArgumentParser:
    p = OneLineErrorParser(prog="visualize.py", description=__doc__.split("\n\n")[0],
                           epilog="Run `python visualize.py COMMAND --help` for each command's options.",
                           formatter_class=DefaultsHelpFormatter)
    commands = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    step = commands.add_parser(
        "step", formatter_class=DefaultsHelpFormatter,
        help="one forward pass of a method: its tree, attention mask and positions",
        description="Decode a prompt greedily with a method that guesses and draw one forward pass: TREE "
                    "(the candidate tree, the accepted path green, rejected guesses red beside the model's "
                    "choice, unreached grey, the bonus token, PPD's soft tokens dashed), MASK (the attention "
                    "mask over the cache's tail and the pass's inputs, tokens on both axes) and POSITIONS "
                    "(each input row's RoPE position: cache length + depth). Files: OUT/METHOD-tree, "
                    "-mask, -positions, each .png and .svg.")
    step.add_argument("--method", default="ppd", choices=GUESSING_METHODS, help="the method whose pass to draw")
    step.add_argument("--pass", dest="pass_number", type=integer(1, 1 << 20), metavar="N",
                      help="draw the N-th forward pass after the prefill (default: the one that accepted the "
                           "most guesses)")
    step.add_argument("--cache-tail", type=integer(0, 64), default=8, metavar="K",
                      help="MASK shows the last K cached tokens (every input sees all of the cache)")
    answer = commands.add_parser(
        "answer", formatter_class=DefaultsHelpFormatter,
        help="each method's answer, its tokens coloured by who chose them",
        description="Decode a prompt greedily with vanilla and each method and draw the answers token by "
                    "token: accepted guesses green, tokens the model chose itself (the bonus token of each "
                    "pass, or vanilla's) plain, a bar under each pass's tokens. File: OUT/answer-METHODS.")
    answer.add_argument("--methods", nargs="+", default=["anpd"], choices=GUESSING_METHODS,
                        help="methods to draw next to vanilla")
    cost = commands.add_parser(
        "cost", formatter_class=DefaultsHelpFormatter,
        help="what a cost-aware drafter sent each pass, and its acceptance estimates",
        description="Decode a prompt greedily with a method's cost-aware drafter and draw, per forward pass, "
                    "the guesses offered, sent and accepted and the accepted guesses expected of those sent, and "
                    "below, the estimates of the most judged kinds of guess (File: OUT/cost-METHOD).")
    cost.add_argument("--method", default="auto", choices=GUESSING_METHODS, help="the method to draw")
    threads = commands.add_parser(
        "threads", formatter_class=DefaultsHelpFormatter,
        help="APAR's generation threads over the forward passes (and with --apar-guesses, beside it)",
        description="Decode a prompt greedily with APAR (the shipped adapter) and draw a row per generation "
                    "thread and a cell per forward pass it took tokens in: where threads fork, how many step "
                    "together, where they end. With --apar-guesses, APAR with a drafter per thread is drawn "
                    "below it: the same threads in fewer passes, green where a thread accepted guesses. File: "
                    "OUT/threads-apar[-GUESSER].")
    for sub in (step, answer, cost, threads):
        sub.add_argument("--prompt", required=True, help="the prompt")
        sub.add_argument("--max-new-tokens", type=integer(1, 4096), default=64, metavar="N",
                         help="stop after this many new tokens (or at end-of-sequence)")
        add_model_options(sub)
        add_method_options(sub)
    bench = commands.add_parser(
        "bench", formatter_class=DefaultsHelpFormatter, help="the charts of a bench.py results file",
        description="From a results file of bench.py (its --out): `methods` runs give the speedup over "
                    "vanilla per method and category with tau on each bar (OUT/STEM-speedup-DTYPE) and, where the run "
                    "decoded plainly more than one way (--fused or --compile beside model.py's passes, llama.cpp), "
                    "each way's tokens/s (OUT/STEM-vanilla-DTYPE); `latency` runs give L(T)/L(1) against T for ours and transformers' (OUT/STEM-step-latency).")
    bench.add_argument("results", type=Path, metavar="RESULTS.json", help="written by bench.py")
    calibration = commands.add_parser(
        "calibration", formatter_class=DefaultsHelpFormatter,
        help="tau(n), L(n)/L(1) and tau(n)/L(n) from decode.py --calibrate",
        description="For each machine, dtype and model in the calibration file: L(n)/L(1) and, per "
                    "calibrated method, tau(n) and the predicted speedup tau(n) L(1)/L(n), the chosen n "
                    "starred (OUT/calibration-K).")
    calibration.add_argument("file", type=Path, nargs="?", metavar="CALIBRATION.json",
                             help="default: this machine's, in the cache (decode.py --calibrate writes it)")
    threads.set_defaults(max_new_tokens=256)
    for sub, draw in [(step, draw_step), (answer, draw_answers), (cost, draw_cost), (threads, draw_threads),
                      (bench, draw_bench), (calibration, draw_calibration)]:
        sub.set_defaults(draw=draw, command_parser=sub)
        sub.add_argument("--out", type=Path, default=Path("figures"), metavar="DIR", help="folder for the figures")
        sub.add_argument("--formats", nargs="+", choices=["png", "svg"], default=["png", "svg"],
                         help="file formats to save")
    return p


def main(argv=None) -> int:
    """`python visualize.py ...`: every problem that is not a bug is one `error:` line (errors.run_program)."""
    return run_program(lambda: visualize_command(argv))


def visualize_command(argv) -> None:
    args = build_parser().parse_args(argv)
    paths = args.draw(args)
    print("\n".join(str(path) for path in paths))


def decoded(args, method: str, model, tokenizer, ids, on_pass=None) -> Generation:
    """The prompt decoded greedily with `method` (vanilla: no drafter)."""
    drafter = build_drafter(METHODS[method], args, model, tokenizer) if method != "vanilla" else None
    with torch.inference_mode():
        return generate(model, ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                        drafter=drafter, on_pass=on_pass)


def loaded(args, methods: list[str]):
    """The model, tokenizer and prompt ids the options name, after checking them."""
    refuse_idle_options(args, args.command_parser, [], methods)
    prompt = checked(Prompt(args.prompt, "--prompt"))
    model, tokenizer = load(args, METHODS[methods[0]])
    return model, tokenizer, prompt_ids(args, prompt, model, tokenizer)


def short(prompt: str, length: int = 100) -> str:
    return prompt if len(prompt) <= length else prompt[:length - 1] + "…"


def token_texts(tokenizer):
    """ids -> their text, special tokens included: what the figures label tokens with."""
    return functools.partial(tokenizer.decode, skip_special=False)


def draw_step(args) -> list[Path]:
    model, tokenizer, ids = loaded(args, [args.method])
    passes = []
    gen = decoded(args, args.method, model, tokenizer, ids, passes.append)
    number = chosen_pass(passes, args.pass_number)
    step = passes[number - 1]
    cached = (ids + gen.token_ids)[:step.cache_length]

    about = (f"{args.method}, pass {number} of {len(passes)}: {step.tree.draft_size} guesses after "
             f"{step.cache_length} cached tokens, {step.verdict.accepted_guesses} accepted")
    return [*save(tree_figure(step, token_texts(tokenizer), about), args.out, f"{args.method}-tree", args.formats),
            *save(mask_figure(step, cached, token_texts(tokenizer), args.cache_tail, f"Tree attention mask: {about}"),
                  args.out, f"{args.method}-mask", args.formats),
            *save(positions_figure(step, token_texts(tokenizer), f"Positions: {about}"), args.out, f"{args.method}-positions",
                  args.formats)]


def draw_answers(args) -> list[Path]:
    methods = list(dict.fromkeys(args.methods))
    model, tokenizer, ids = loaded(args, methods)
    answers = {name: decoded(args, name, model, tokenizer, ids) for name in ["vanilla", *methods]}

    fig = answer_figure(answers, token_texts(tokenizer), f"Who chose each token, decoding greedily (so every answer is vanilla's)\n"
                                          f"prompt: {visible(short(args.prompt))}")
    return save(fig, args.out, "answer-" + "-".join(methods), args.formats)


def draw_threads(args) -> list[Path]:
    model, tokenizer, ids = loaded(args, ["apar"])
    engine = METHODS["apar"].engine(args, model, tokenizer)
    decoders = {"apar": replace(engine, guesser=None)}
    if engine.guesser is not None:
        decoders[f"apar + {args.apar_guesses}"] = engine
    runs = {}
    for name, decoder in decoders.items():
        verdicts = []
        with torch.inference_mode():
            gen = decoder.generate(ids, max_new_tokens=args.max_new_tokens, eos_ids=tokenizer.eos_ids,
                                   watch=verdicts.append)
        runs[name] = ThreadRun(gen, verdicts)
    fig = threads_figure(runs, token_texts(tokenizer), engine.control, tokenizer.eos_ids,
                         f"APAR's generation threads, greedy\nprompt: {visible(short(args.prompt))}")
    return save(fig, args.out, "threads-" + list(decoders)[-1].replace(" + ", "-"), args.formats)


def read_json(path: Path, what: str, written_by: str):
    if not path.is_file():
        raise UserError(f"{path} does not exist ({written_by} writes it)")
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError):
        raise UserError(f"{path} is not {what} (not valid JSON)") from None


def draw_bench(args) -> list[Path]:
    results = read_json(args.results, "a bench.py results file", "bench.py --out")
    try:
        tables = results["tables"]
        figures = bench_figures(results)
    except (KeyError, TypeError, IndexError, ValueError, ZeroDivisionError, AttributeError):  # a wrong kind of value
        raise UserError(f"{args.results} is not a bench.py results file (or it is damaged)") from None
    if not figures:
        kinds = sorted({t.get("kind", "?") for t in tables})
        raise UserError(f"{args.results} holds nothing to draw ({', '.join(kinds)}): charts come from "
                        "`bench.py methods` and `bench.py latency` runs")
    stem = args.results.stem
    return [path for name, fig in figures.items() for path in save(fig, args.out, f"{stem}-{name}", args.formats)]


def draw_calibration(args) -> list[Path]:
    file = args.file or calibration_file()
    saved = read_json(file, "a calibration file", "decode.py --method M --calibrate")
    usable = {key: methods for key, methods in saved.items() if isinstance(methods, dict) and methods} if (
        isinstance(saved, dict)) else {}
    if not usable:
        raise UserError(f"{file} holds no calibration")
    paths = []
    for number, (key, methods) in enumerate(sorted(usable.items()), 1):
        machine = " · ".join(key.split(" | ")[:3])  # CPU or GPU, device, dtype (not the model's checksum)
        try:
            fig = calibration_figure(machine, methods)
        except (KeyError, TypeError, StopIteration, ZeroDivisionError):
            raise UserError(f"{file} is damaged (its entry for {machine}); calibrate again") from None
        paths += save(fig, args.out, f"calibration-{number}", args.formats)
    return paths


if __name__ == "__main__":
    sys.exit(main())
