"""The command line (cli.py, run as `python decode.py`): JSON output, prompt files, streaming, every
method greedy and sampling, --calibrate, and clear one-line errors (never a traceback) for every kind
of bad input."""

import gc
import json
import subprocess
import sys

import pytest
import torch

from programs.cli import main, say_if_empty, summary_line
from helpers import ROOT, tiny_artifacts, write_checkpoint
from tokenizer import Tokenizer


def run_cli(capsys, *argv):
    try:
        code = main(list(argv))
    except SystemExit as exit:
        code = exit.code
    out, err = capsys.readouterr()
    return code, out, err


def assert_one_line_error(code, err, *fragments):
    """A non-zero exit, no traceback, and exactly one error line, the last thing printed (a progress
    line such as "Loaded ..." may come before it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if "error:" in line]
    assert code != 0
    assert "Traceback" not in err
    assert len(errors) == 1 and lines[-1] == errors[0], err
    for fragment in fragments:
        assert fragment in errors[0]


# ---- the command line ------------------------------------------------------------------------------

def test_json_output_has_the_statistics(capsys, tiny_folder):
    code, out, err = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt", "the quick fox",
                             "--max-new-tokens", "5", "--json")
    assert code == 0, err
    record = json.loads(out)
    for key in ("method", "prompt_tokens", "new_tokens", "forward_passes", "tokens_per_pass",
                "decode_seconds", "tokens_per_second", "text", "token_ids"):
        assert key in record
    assert record["method"] == "vanilla" and record["new_tokens"] == len(record["token_ids"]) <= 5


def test_prompt_file_runs_every_prompt(capsys, tiny_folder, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the dog"}\n\n{"prompt": "over the"}\n')
    code, out, _ = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt-file", str(prompts),
                           "--max-new-tokens", "3", "--json")
    assert code == 0 and len(out.splitlines()) == 2


def test_streamed_answers_of_a_prompt_file_are_separated(capsys, tiny_folder, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "the dog"}\n\n{"prompt": "over the"}\n')
    code, out, _ = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt-file", str(prompts),
                           "--max-new-tokens", "3")
    headers = [line for line in out.splitlines() if line.startswith("--- ")]
    assert code == 0 and headers == [f"--- {prompts}:1 ---", f"--- {prompts}:3 ---"]


def test_streams_text_and_prints_a_summary(capsys, tiny_folder):
    code, out, err = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt", "the",
                             "--max-new-tokens", "4", "--temperature", "0.8", "--seed", "1")
    assert code == 0 and "tokens/pass" in err


def test_what_is_loaded_is_kept_out_of_the_collectors_walks(capsys, tiny_folder):
    """methods.freeze_loaded: once the model is loaded, every object alive is in the collector's permanent
    generation, so that a full collection (0.45 s in the default model's process on 2 cores, in whichever
    pass it comes) does not walk them again."""
    gc.unfreeze()  # (an earlier test's load froze its own)
    code, _, err = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt", "the", "--max-new-tokens", "2")
    assert code == 0, err
    assert gc.get_freeze_count() > 10_000


def test_the_summary_says_why_a_guesser_sent_nothing():
    """A guessing method whose every guess cost-aware drafting cut reads like vanilla: the summary
    says why, and how to send them anyway; not when it sent some, nor with --fixed-size."""
    stats = dict(method="speculative", new_tokens=9, stop_reason="eos", forward_passes=10, tokens_per_pass=0.9,
                 draft_tokens_accepted=0, draft_tokens_proposed=0, draft_seconds=0.0, forward_seconds=0.1,
                 tokens_per_second=90.0, decode_seconds=0.1, cost_aware=True)
    assert "--fixed-size" in summary_line(stats)
    assert "--fixed-size" not in summary_line(stats | dict(cost_aware=False))
    assert "--fixed-size" not in summary_line(stats | dict(draft_tokens_proposed=3))


def broken_copy(tiny_folder, tmp_path, edit_config=None, edit_weights=None):
    from safetensors.torch import load_file, save_file

    folder = tmp_path / "broken"
    folder.mkdir()
    (folder / "tokenizer.json").write_bytes((tiny_folder / "tokenizer.json").read_bytes())
    config = json.loads((tiny_folder / "config.json").read_text())
    weights = load_file(tiny_folder / "model.safetensors")
    if edit_config:
        edit_config(config)
    if edit_weights:
        edit_weights(weights)
    (folder / "config.json").write_text(json.dumps(config))
    save_file(weights, folder / "model.safetensors")
    return folder


@pytest.mark.parametrize("argv, fragments", [
    (["--max-new-tokens", "0"], ["--max-new-tokens"]),
    (["--max-new-tokens", "-3"], ["--max-new-tokens"]),
    (["--method", "warp-drive"], ["--method", "warp-drive"]),
    (["--dtype", "int3"], ["--dtype"]),
    (["--device", "tpu"], ["tpu"]),
    (["--top-p", "1.5"], ["top-p"]),
    (["--temperature", "-1"], ["temperature"]),
    (["--prompt", "   "], ["empty"]),
    (["--method", "anpd", "--ngram-k", "0"], ["--ngram-k", "1..128"]),
    (["--method", "anpd", "--ngram-n", "1"], ["--ngram-n", "2..32"]),
    (["--method", "lookahead", "--decoding-length", "0"], ["--decoding-length", "1..256"]),
    (["--method", "lookahead", "--branch-length", "100"], ["--branch-length", "1..64"]),
    (["--method", "lookahead", "--lookahead-mode", "diagonal"], ["--lookahead-mode"]),
    (["--top-p", "0"], ["top-p"]),
    (["--method", "speculative", "--draft-layers", "1", "--gamma", "0"], ["gamma", "1..64"]),
    (["--method", "speculative", "--draft-layers", "2"], ["between 1 and 1"]),  # the model has 2
    (["--method", "speculative", "--draft-layers", "0"], ["--draft-layers", "1.."]),
    (["--method", "anpd", "--draft-layers", "1"], ["--draft-layers", "--method speculative"]),
    (["--method", "speculative", "--ngram-k", "3"], ["--ngram-k", "--method anpd"]),
    (["--method", "anpd", "--acceptance", "typical"], ["--temperature"]),
    (["--acceptance", "typical", "--temperature", "1"], ["vanilla"]),
    (["--method", "anpd", "--temperature", "1", "--acceptance", "typical", "--typical-epsilon", "0"],
     ["epsilon"]),
    (["--method", "speculative", "--draft-model", "/nonexistent/draft"], ["does not exist"]),
    (["--method", "anpd", "--prompt", ""], ["empty"]),
    (["--method", "ppd", "--tree-rows", "1"], ["--tree-rows", "2..256"]),
    (["--method", "medusa", "--static-tree"], ["--static-tree", "--method ppd"]),
    (["--method", "anpd", "--tree-rows", "8"], ["--tree-rows", "--method recycling, medusa, ppd and eagle"]),
    (["--method", "ppd", "--trained", "/nonexistent/ppd"], ["no ppd artifact", "train_prompt.py ppd"]),
    (["--method", "medusa"], ["no medusa artifact at", "medusa-tiny", "train_prompt.py medusa"]),
    (["--method", "ppd", "--trained", str(ROOT / "trained" / "ppd-SmolLM2-135M-Instruct")],
     ["hidden_size 576 there, 32 here", "train_prompt.py ppd"]),  # the shipped one: SmolLM2's
    (["--calibrate"], ["--calibrate", "anpd, lookahead"]),
    (["--show-tree"], ["--show-tree", "a method that guesses"]),  # vanilla has no tree to draw
    (["--method", "anpd", "--show-tree", "2", "--json"], ["--show-tree", "not --json"]),
    (["--method", "anpd", "--show-tree", "0"], ["--show-tree", "1.."]),
    (["--method", "anpd", "--calibrate"], ["--calibrate", "no --prompt"]),
])
def test_bad_options_are_one_line_errors(capsys, tiny_folder, argv, fragments):
    base = ["--model", str(tiny_folder), "--raw"] + ([] if "--prompt" in argv else ["--prompt", "hi"])
    assert_one_line_error(*run_cli(capsys, *base, *argv)[::2], *fragments)


def test_a_draft_with_another_vocabulary_or_tokenizer_is_refused(capsys, tiny_folder, tmp_path):
    base = ["--model", str(tiny_folder), "--raw", "--prompt", "hi", "--method", "speculative"]
    config = json.loads((tiny_folder / "config.json").read_text())
    bigger = write_checkpoint(tmp_path / "bigger", {**config, "vocab_size": config["vocab_size"] + 8})
    (bigger / "tokenizer.json").write_bytes((tiny_folder / "tokenizer.json").read_bytes())
    assert_one_line_error(*run_cli(capsys, *base, "--draft-model", str(bigger))[::2], "vocabulary")

    other = write_checkpoint(tmp_path / "other", config, seed=5)
    tokenizer = json.loads((tiny_folder / "tokenizer.json").read_text())
    vocab = tokenizer["model"]["vocab"]
    a, b = list(vocab)[40:42]
    vocab[a], vocab[b] = vocab[b], vocab[a]  # same size, but two ids mean other text
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert_one_line_error(*run_cli(capsys, *base, "--draft-model", str(other))[::2], "another tokenizer")

    (other / "tokenizer.json").write_bytes((tiny_folder / "tokenizer.json").read_bytes())
    code, _, err = run_cli(capsys, *base, "--draft-model", str(other), "--max-new-tokens", "5")
    assert code == 0, err


def test_sampling_runs_for_every_method(capsys, tiny_folder):
    for method, options in [("anpd", []), ("lookahead", []), ("speculative", ["--draft-layers", "1"])]:
        for acceptance in ["exact", "typical"]:
            code, out, err = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt", "the dog",
                                     "--method", method, *options, "--temperature", "0.7", "--top-p", "0.9",
                                     "--acceptance", acceptance, "--max-new-tokens", "12", "--json",
                                     "--seed", "3")
            assert code == 0, err
            record = json.loads(out)
            assert record["acceptance"] == acceptance and record["new_tokens"] > 0


def test_show_accepts_marks_the_accepted_guesses(capsys, default_model_dir):
    argv = ["--max-new-tokens", "40", "--prompt", "Repeat this line twice: the cat sat on the mat."]
    # --fixed-size: the marks do not depend on how the tree was cut, and cost-aware drafting would first
    # measure this machine's L(n) (20-50 s)
    code, out, err = run_cli(capsys, "--method", "anpd", "--fixed-size", "--show-accepts", *argv)
    assert code == 0
    accepted = int(err.split("per pass (")[1].split(" of ")[0])
    assert accepted > 0 and "⟦" in out and out.count("⟦") == out.count("⟧")
    code, vanilla_out, _ = run_cli(capsys, *argv)
    assert out.replace("⟦", "").replace("⟧", "") == vanilla_out  # marks added, nothing else changed


def test_cuda_without_a_gpu_is_a_clear_error(capsys, tiny_folder):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--device", "cuda",
                                   "--prompt", "hi")[::2], "CUDA")


def test_cuda_graphs_off_a_gpu_or_with_apar_is_a_clear_error(capsys, tiny_folder):
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--backend", "cuda-graphs", "--prompt",
                                   "hi")[::2], "add --device cuda")
    if torch.cuda.is_available():
        assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--backend", "cuda-graphs", "--device", "cuda",
                                       "--method", "apar", "--prompt", "hi")[::2], "its own engine")


def test_compile_with_apar_is_a_clear_error(capsys, tiny_folder):
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--backend", "compiled", "--method", "apar",
                                   "--prompt", "hi")[::2], "its own engine")


@pytest.mark.parametrize("options, says", [
    (["--dtype", "float64"], "float32 or bfloat16"),
    (["--device", "cuda"], "for a CPU" if torch.cuda.is_available() else "CUDA is not available"),
    (["--method", "apar"], "its own engine")])
def test_fused_where_it_cannot_run_is_a_clear_error(capsys, tiny_folder, options, says):
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--backend", "fused", *options, "--prompt",
                                   "hi")[::2],
                          says)


def test_fused_decodes_the_tiny_model_as_vanilla(capsys, tiny_folder):
    plain, fused = (json.loads(run_cli(capsys, "--model", str(tiny_folder), "--raw", "--method", "anpd", "--fixed-size",
                                       *extra, "--prompt", "the quick brown", "--max-new-tokens", "20", "--json")[1])
                    for extra in ([], ["--backend", "fused"]))
    assert fused["token_ids"] == plain["token_ids"] and len(plain["token_ids"]) == 20


def test_missing_model_directory(capsys, tmp_path):
    assert_one_line_error(*run_cli(capsys, "--model", str(tmp_path / "nope"), "--prompt", "hi")[::2],
                          "does not exist")


def test_config_missing_a_field(capsys, tiny_folder, tmp_path):
    folder = broken_copy(tiny_folder, tmp_path, edit_config=lambda c: c.pop("hidden_size"))
    assert_one_line_error(*run_cli(capsys, "--model", str(folder), "--prompt", "hi")[::2], "hidden_size")


def test_weight_of_the_wrong_shape(capsys, tiny_folder, tmp_path):
    def shrink(weights):
        name = "model.layers.0.mlp.up_proj.weight"
        weights[name] = weights[name][:-1].contiguous()
    folder = broken_copy(tiny_folder, tmp_path, edit_weights=shrink)
    assert_one_line_error(*run_cli(capsys, "--model", str(folder), "--prompt", "hi")[::2], "up_proj", "shape")


def test_pickle_checkpoints_are_refused(capsys, tiny_folder, tmp_path):
    folder = tmp_path / "pickled"
    folder.mkdir()
    (folder / "config.json").write_text((tiny_folder / "config.json").read_text())
    (folder / "pytorch_model.bin").write_bytes(b"not even opened")
    assert_one_line_error(*run_cli(capsys, "--model", str(folder), "--prompt", "hi")[::2], "pickle")


def test_prompt_longer_than_the_context(capsys, tiny_folder):
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--raw",
                                   "--prompt", "the quick brown fox " * 40)[::2], "context")


def test_bad_prompt_files(capsys, tiny_folder, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "ok"}\n{"text": "no prompt key"}\n')
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--prompt-file", str(bad))[::2], ":2")
    assert_one_line_error(*run_cli(capsys, "--model", str(tiny_folder), "--prompt-file",
                                   str(tmp_path / "missing.jsonl"))[::2], "does not exist")


def test_the_real_entry_point_prints_no_traceback(tmp_path):
    result = subprocess.run([sys.executable, str(ROOT / "decode.py"), "--model", str(tmp_path / "nope"),
                             "--prompt", "hi"], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().startswith("error:") and "Traceback" not in result.stderr


def test_default_model_answers_coherently(capsys):
    code, out, err = run_cli(capsys, "--prompt", "What is the capital of France?", "--max-new-tokens", "20",
                             "--json")
    assert code == 0, err
    assert "Paris" in json.loads(out)["text"]


def test_learned_methods_run_greedy_and_sampling(capsys, tiny_folder, tmp_path):
    tiny_artifacts(tiny_folder, tmp_path)
    base = ["--model", str(tiny_folder), "--raw", "--prompt", "the dog", "--max-new-tokens", "12", "--json"]
    code, out, err = run_cli(capsys, *base)
    vanilla = json.loads(out)["token_ids"]
    for method, extra in [("medusa", []), ("ppd", []), ("ppd", ["--static-tree", "--tree-rows", "12"])]:
        trained = ["--method", method, "--trained", str(tmp_path / method), *extra]
        code, out, err = run_cli(capsys, *base, *trained)
        assert code == 0, err
        assert json.loads(out)["token_ids"] == vanilla
        for acceptance in ["exact", "typical"]:
            code, out, err = run_cli(capsys, *base, *trained, "--temperature", "0.7", "--acceptance", acceptance,
                                     "--seed", "1")
            assert code == 0, err
            assert json.loads(out)["acceptance"] == acceptance
    code, _, err = run_cli(capsys, *base, "--method", "ppd", "--trained", str(tmp_path / "ppd"), "--static-tree",
                           "--tree-rows", "4")
    assert_one_line_error(code, err, "--tree-rows 4", "at least 7")


def test_calibrate_saves_this_machines_tree_size(capsys, tiny_folder, tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    tiny_artifacts(tiny_folder, tmp_path)
    for method, trained in [("ppd", ["--trained", str(tmp_path / "ppd")]), ("anpd", [])]:
        code, out, err = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--method", method, *trained,
                                 "--calibrate")
        assert code == 0, err
        table = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
        assert len(table) >= 5
        ratios = {int(line.split("|")[1]): float(line.split("|")[5].strip().rstrip("x")) for line in table}
        chosen = int(err.split("best for")[1].split(" inputs per pass")[0].split()[-1])
        assert ratios[chosen] == max(ratios.values())  # (the table rounds: equal-looking rows can tie)
        saved = json.loads((tmp_path / "cache" / "calibration.json").read_text())
        assert [entry[method]["rows"] for entry in saved.values()] == [chosen]
        code, out, err = run_cli(capsys, "--model", str(tiny_folder), "--raw", "--prompt", "hi", "--method", method,
                                 *trained, "--max-new-tokens", "4")
        assert code == 0 and f"{chosen} inputs per pass, as --calibrate chose" in err


def test_an_empty_answer_is_said(capsys, tiny_folder):
    tokenizer = Tokenizer(tiny_folder)
    say_if_empty(tokenizer, [2])  # the end-of-sequence token first
    assert capsys.readouterr().err == "note: the answer is empty: the model ended it at once\n"
    say_if_empty(tokenizer, tokenizer.encode("the fox"))
    assert capsys.readouterr().err == ""
