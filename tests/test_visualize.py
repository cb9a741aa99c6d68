"""visualize.py and bench.py --plot: every figure is drawn from a real run of a tiny model (or the default
model's step latency), saved as a valid PNG and SVG, and shows what the run did: the SVG's ids of the
accepted nodes are the verifier's path, the coloured tokens are the accepted guesses, each bar is the
speedup in the results file, and the star is the calibrated size."""

import json
from dataclasses import astuple
import xml.etree.ElementTree as ElementTree

import pytest
import torch
from PIL import Image

import bench
from methods import registry as methods
import visualize
from helpers import tiny_artifacts
from methods.latency import Latency
from decode import generate
from drafters import DraftModelDrafter, NGramDrafter, TrieDrafter, first_layers
from methods.medusa import load_drafter as load_medusa
from checkpoint import load_checkpoint
from methods.ppd import load_drafter as load_ppd
from tokenizer import Tokenizer
from verify import verify_greedy

PROMPT = "the quick brown fox jumps over the lazy dog the quick"


def assert_valid_png(path):
    with Image.open(path) as image:
        assert image.format == "PNG" and image.width > 100 and image.height > 100
        image.verify()


def svg_ids(path) -> list[str]:
    root = ElementTree.parse(path).getroot()
    assert root.tag.endswith("svg")
    return [element.get("id") for element in root.iter() if element.get("id")]


@pytest.fixture(scope="module")
def tiny(tiny_folder, tmp_path_factory):
    trained = tmp_path_factory.mktemp("trained")
    tiny_artifacts(tiny_folder, trained)
    model = load_checkpoint(tiny_folder, torch.float32)
    tokenizer = Tokenizer(tiny_folder)
    drafters = {"anpd": NGramDrafter(), "lookahead": TrieDrafter(), "speculative": DraftModelDrafter(first_layers(model, 1)),
                "medusa": load_medusa(model, trained / "medusa", 8), "ppd": load_ppd(model, trained / "ppd", 10)}
    return model, tokenizer, drafters, trained


def recorded(model, tokenizer, drafter):
    ids = tokenizer.encode(PROMPT)
    passes = []
    with torch.inference_mode():
        gen = generate(model, ids, max_new_tokens=24, eos_ids=set(), drafter=drafter, on_pass=passes.append)
    return ids, gen, passes


@pytest.mark.parametrize("method", ["anpd", "lookahead", "speculative", "medusa", "ppd"])
def test_the_tree_mask_and_positions_show_the_verifiers_verdict(tiny, tmp_path, method):
    model, tokenizer, drafters, _ = tiny
    ids, gen, passes = recorded(model, tokenizer, drafters[method])
    assert [t for step in passes for t in step.emitted] == gen.token_ids[1:]  # the prefill chose the first
    emitted = 1
    for step in passes:  # the cache holds the prompt and every token but the root, the last one chosen
        assert step.cache_length == len(ids) + emitted - 1
        emitted += len(step.emitted)
    number = visualize.chosen_pass(passes, None)
    step = passes[number - 1]
    logits = torch.nn.functional.one_hot(torch.tensor(step.choices), model.config.vocab_size).float()
    assert verify_greedy(step.tree, logits).path == step.verdict.path  # the recorded choices give the verdict

    def text_of(token_ids):
        return tokenizer.decode(token_ids)

    cached = (ids + gen.token_ids)[:step.cache_length]
    figures = {"tree": visualize.tree_figure(step, text_of, "tree"),
               "mask": visualize.mask_figure(step, cached, text_of, 8, "mask"),
               "positions": visualize.positions_figure(step, text_of, "positions")}
    drawn_mask = torch.as_tensor(figures["mask"].axes[0].images[0].get_array())  # 0 hidden, 1 cache, 2 ancestor
    shown = min(8, step.cache_length)
    mask = step.tree.input_mask(step.cache_length)[:, step.cache_length - shown:]
    assert torch.equal(drawn_mask > 0, mask) and (drawn_mask[:, :shown] == 1).all()
    assert torch.equal(drawn_mask[:, shown:] == 2, step.tree.input_mask(0))
    ids_in = {}
    for name, fig in figures.items():
        png, svg = visualize.save(fig, tmp_path, name, ["png", "svg"])
        assert_valid_png(png)
        ids_in[name] = svg_ids(svg)
    drawn = {int(i.split("-")[1]): i.split("-")[2] for i in ids_in["tree"] if i.startswith("node-")}
    assert sorted(drawn) == list(range(len(step.tree)))
    assert sorted(n for n, kind in drawn.items() if kind in ("accepted", "root")) == step.verdict.path
    assert ("bonus" in ids_in["tree"]) == (len(step.emitted) > step.verdict.accepted_guesses)  # the bonus reached the answer
    assert sum(i.startswith("soft-") for i in ids_in["tree"]) == sum(bool(step.tree.extra_rows(node)) for node in range(len(step.tree)))
    assert ids_in["mask"].count("row-accepted") == len(step.verdict.path)
    positions = [i for i in ids_in["positions"] if i.startswith("position-")]
    assert positions == [f"position-{row}-{p}" for row, p in enumerate(step.tree.input_positions(step.cache_length).tolist())]


def test_the_answer_figure_colours_exactly_the_accepted_guesses(tiny, tmp_path):
    model, tokenizer, drafters, _ = tiny
    answers = {name: recorded(model, tokenizer, drafters[name])[1] for name in ["anpd", "lookahead"]}
    png, svg = visualize.save(visualize.answer_figure(answers, tokenizer.decode, "answers"), tmp_path, "answer",
                              ["png", "svg"])
    assert_valid_png(png)
    tokens = [i for i in svg_ids(svg) if i.startswith("token-")]
    expected = [f"token-{i}-{'guess' if guessed else 'model'}" for gen in answers.values()
                for i, guessed in enumerate(gen.from_draft)]
    assert tokens == expected and any(gen.from_draft for gen in answers.values())


def test_the_cost_figure_draws_every_pass_of_the_cost_aware_drafter(tiny_folder, tmp_path, capsys, monkeypatch):
    """One offered / sent / accepted bar per pass after the prefill, and an estimate line per kind. (Passes
    that cost the same whatever their size: every guess is sent, so every kind is judged, whatever this
    machine's L(n) is.)"""
    monkeypatch.setattr(methods, "machine_latency", lambda model: Latency.flat())
    base = ["--model", str(tiny_folder), "--raw", "--prompt", PROMPT, "--max-new-tokens", "24", "--out", str(tmp_path)]
    assert visualize.main(["cost", "--method", "anpd", *base, "--formats", "svg"]) == 0
    ids = svg_ids(capsys.readouterr().out.split()[0])
    passes = {int(i.split("-")[1]) for i in ids if i.startswith("pass-")}
    assert passes == set(range(1, max(passes) + 1))
    assert all(f"pass-{p}-{kind}" in ids for p in passes for kind in ("offered", "sent", "accepted"))
    assert any(i.startswith("estimate-anpd-") for i in ids)


def test_passes_of_an_answer_end_at_each_token_the_model_chose():
    assert visualize.pass_spans([False, True, True, False, False, True]) == [(0, 1), (1, 4), (4, 5), (5, 6)]


def test_the_command_line_saves_every_figure(tiny_folder, tmp_path, capsys):
    base = ["--model", str(tiny_folder), "--raw", "--prompt", PROMPT, "--max-new-tokens", "16", "--out", str(tmp_path)]
    assert visualize.main(["step", "--method", "lookahead", *base]) == 0
    assert visualize.main(["answer", "--methods", "anpd", "lookahead", *base, "--formats", "svg"]) == 0
    printed = capsys.readouterr().out.split()
    assert sorted(p.rsplit("/", 1)[1] for p in printed) == sorted(
        [f"lookahead-{name}.{fmt}" for name in ("tree", "mask", "positions") for fmt in ("png", "svg")]
        + ["answer-anpd-lookahead.svg"])
    for path in printed:
        assert_valid_png(path) if path.endswith(".png") else svg_ids(path)


@pytest.mark.parametrize("argv, fragment", [
    (["step", "--method", "anpd", "--pass", "999"], "the answer took only"),
    (["step", "--method", "anpd", "--tree-rows", "8"], "--tree-rows applies to --method recycling, medusa, ppd and eagle only"),
    (["answer", "--methods", "anpd", "--gamma", "2"], "--gamma applies to --method speculative only"),
    (["cost", "--method", "anpd", "--fixed-size"], "there is no cut to draw"),
])
def test_bad_requests_are_one_line_errors(tiny_folder, tmp_path, capsys, argv, fragment):
    code = visualize.main([*argv, "--model", str(tiny_folder), "--raw", "--prompt", PROMPT, "--max-new-tokens", "4",
                           "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert code != 0 and "Traceback" not in err and fragment in err.splitlines()[-1]


def bar_heights(svg) -> dict[str, float]:
    """The height of each bar (an element whose id starts with "bar-") in a chart saved as SVG."""
    heights = {}
    for group in ElementTree.parse(svg).getroot().iter():
        if (group.get("id") or "").startswith("bar-"):
            path = next(e for e in group.iter() if e.tag.endswith("path"))
            ys = [float(v) for v in path.get("d").replace("M", " ").replace("L", " ").replace("z", " ").split()[1::2]]
            heights[group.get("id")] = max(ys) - min(ys)
    return heights


def test_bench_results_are_drawn_as_they_were_measured(tmp_path, capsys):
    report = bench.Report("methods", {"cpu": "a test CPU", "cores": 2, "threads": 2, "device": "cpu", "torch": "x"})
    columns = [bench.Column("method"), bench.Column("tau", fmt="{:.2f}"), bench.Column("tokens_per_second"),
               bench.Column("speedup", fmt="{:.2f}x"), bench.Column("same_as_vanilla")]
    for category, anpd in [("chat", 0.9), ("code", 1.7)]:
        report.table(category, columns, [["vanilla", 1.0, 30.0, 1.0, "2/2"], ["anpd", 1.5, 30 * anpd, anpd, "2/2"]],
                     kind="methods", category=category, dtype="float32", prompts=2, new_tokens=64, temperature=0)
    assert "| anpd | 1.50 | 51.0 | 1.70x | 2/2 |" in capsys.readouterr().out
    report.save(tmp_path / "results.json")
    assert visualize.main(["bench", str(tmp_path / "results.json"), "--out", str(tmp_path)]) == 0
    svg = tmp_path / "results-speedup-float32.svg"
    assert capsys.readouterr().out.split() == [str(tmp_path / "results-speedup-float32.png"), str(svg)]
    heights = bar_heights(svg)
    assert set(heights) == {"bar-anpd-chat", "bar-anpd-code"}
    assert heights["bar-anpd-code"] / heights["bar-anpd-chat"] == pytest.approx(1.7 / 0.9, rel=1e-3)


def test_a_run_that_decoded_plainly_several_ways_draws_each_ways_tokens_per_second(tmp_path, capsys):
    report = bench.Report("methods", {"cpu": "a test CPU", "cores": 2, "device": "cpu", "fused": True})
    columns = [bench.Column("method"), bench.Column("tau", fmt="{:.2f}"), bench.Column("decode_tokens_per_second"),
               bench.Column("decode_speedup", fmt="{:.2f}x")]
    for category, eager in [("chat", 16.0), ("code", 12.0)]:
        report.table(category, columns, [["vanilla", 1.0, 24.0, 1.0], ["anpd", 1.3, 30.0, 1.25],
                                         ["vanilla-again", 1.0, 23.0, 0.96], [bench.EAGER, 1.0, eager, eager / 24],
                                         ["llama.cpp vanilla", 1.0, 20.0, 1.0]],
                     kind="methods", category=category, dtype="float32", prompts=2, new_tokens=64, temperature=0)
    report.save(tmp_path / "results.json")
    assert visualize.main(["bench", str(tmp_path / "results.json"), "--out", str(tmp_path), "--formats", "svg"]) == 0
    assert capsys.readouterr().out.split()[-1] == str(tmp_path / "results-vanilla-float32.svg")
    heights = bar_heights(tmp_path / "results-vanilla-float32.svg")
    assert set(heights) == {f"bar-{name}-{category}" for name in ("vanilla", bench.EAGER, "llama.cpp vanilla")
                            for category in ("chat", "code")}  # not vanilla timed again, not the methods
    assert heights[f"bar-{bench.EAGER}-code"] / heights["bar-vanilla-code"] == pytest.approx(12 / 24, rel=1e-3)


def test_bench_latency_writes_results_and_draws_them(tmp_path, default_model_dir, capsys, monkeypatch):
    # a small run (its full sizes take minutes): fewer rows of kernels, steps and cached lengths
    monkeypatch.setattr(bench, "KERNEL_ROWS", [1, 8])
    monkeypatch.setattr(bench, "STEP_SIZES", [1, 8])
    monkeypatch.setattr(bench, "CACHED", [16, 64])
    out = tmp_path / "latency.json"
    assert bench.main(["latency", "--skip-transformers", "--rounds", "1", "--reps", "1", "--new-tokens", "2",
                       "--out", str(out), "--plot"]) == 0
    results = json.loads(out.read_text())
    table = next(t for t in results["tables"] if t["kind"] == "step_latency")
    assert [row[:2] for row in table["rows"]] == [["ours", 16], ["ours", 64]]
    assert all(value > 0 for row in table["rows"] for value in row[2:])
    assert results["machine"]["cores"] and results["machine"]["cpu"]
    assert_valid_png(tmp_path / "latency-step-latency.png")
    svg_ids(tmp_path / "latency-step-latency.svg")


def test_the_calibration_figure_stars_the_chosen_size(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(visualize, "calibration_file", lambda: tmp_path / "calibration.json")
    table = [{"rows": n, "latency_ms": 10 + n, "tau": 1 + n / 10, "predicted_speedup": (1 + n / 10) * 11 / (10 + n)}
             for n in (2, 4, 8)]
    (tmp_path / "calibration.json").write_text(json.dumps(
        {"a CPU x2 | cpu | float32 | model abc": {"ppd": {"rows": 4, "table": table}}}))
    assert visualize.main(["calibration", "--out", str(tmp_path)]) == 0
    svg = capsys.readouterr().out.split()[1]
    assert "chosen-ppd-4" in svg_ids(svg)


@pytest.mark.parametrize("content, fragment", [
    (None, "does not exist"), ("{not json", "not valid JSON"), ('{"tables": [{"kind": "methods"}]}', "damaged"),
    ('{"tables": [{"kind": "apar", "rows": []}]}', "holds nothing to draw"),
])
def test_a_bad_results_file_is_a_one_line_error(tmp_path, capsys, content, fragment):
    path = tmp_path / "results.json"
    if content is not None:
        path.write_text(content)
    assert visualize.main(["bench", str(path), "--out", str(tmp_path)]) != 0
    err = capsys.readouterr().err
    assert "Traceback" not in err and fragment in err.splitlines()[-1]


def test_the_threads_figure_has_a_cell_per_verdict_green_where_guesses_were_accepted(tmp_path):
    from methods.apar import generate_apar
    from test_apar import CONTROL, EOS, forking_model

    verdicts = []
    gen = generate_apar(forking_model(3), [7, 8, 9], CONTROL, max_new_tokens=200, eos_ids={EOS}, max_guesses=8,
                        guesser=lambda: NGramDrafter(3, 4), watch=verdicts.append)
    fig = visualize.threads_figure({"apar + anpd": visualize.ThreadRun(gen, verdicts)},
                                   lambda ids: " ".join(map(str, ids)), CONTROL, {EOS}, "threads")
    png, svg = visualize.save(fig, tmp_path, "threads", ["png", "svg"])
    assert_valid_png(png)
    cells = [i for i in svg_ids(svg) if i.startswith("pass-")]
    assert cells == [f"pass-{n}-thread-{t}-{'accepted' if accepted else 'bonus'}" for n, t, _, accepted, _ in map(astuple, verdicts)]
    assert gen.threads > 3 and sum(v.accepted for v in verdicts) == gen.counts.guesses_accepted > 0
    assert sorted(child for v in verdicts for child in v.forked) == list(range(1, gen.threads))


def test_the_threads_command_draws_apar_beside_apar_with_guesses(default_model_dir, tmp_path, capsys):
    assert visualize.main(["threads", "--apar-guesses", "anpd", "--prompt", "Give me three tips for sleeping well.",
                           "--max-new-tokens", "24", "--out", str(tmp_path)]) == 0
    png, svg = capsys.readouterr().out.split()
    assert png.endswith("threads-apar-anpd.png")
    assert_valid_png(png)
    assert any(i.startswith("pass-1-thread-0") for i in svg_ids(svg))
