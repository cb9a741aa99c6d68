"""Bad input, from outside: the real programs (decode.py, train_prompt.py, bench.py) run as a user runs
them, in subprocesses, with every class of mistake or broken environment we know of. Each must end with
a non-zero exit, exactly one line on stderr after any progress lines (an `error:` line, saying what is
wrong and what to do), no traceback, and nothing half-written left behind.

The cases run concurrently (each is a fresh Python that imports torch), then each is checked."""

import json
import os
import signal
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from programs import convert
import errors
from programs.cli import main
from helpers import ROOT, tiny_artifacts, tiny_hf_config, write_checkpoint, write_tiny_tokenizer

NOT_UTF8 = b"caf\xe9"


def program(name, *argv):
    return [sys.executable, str(ROOT / name), *map(str, argv)]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    """Folders the cases point at: a tiny checkpoint, broken copies of it, broken artifacts."""
    root = tmp_path_factory.mktemp("world")
    tiny = root / "tiny"
    tiny.mkdir()
    vocab = write_tiny_tokenizer(tiny)
    config = tiny_hf_config(vocab=vocab, eos_token_id=2, max_position_embeddings=64)
    write_checkpoint(tiny, config)
    tiny_artifacts(tiny, root)

    def variant(name, edit_config=None, edit_weights=None, raw_config=None):
        folder = root / name
        folder.mkdir()
        (folder / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
        edited = dict(config)
        if edit_config:
            edit_config(edited)
        (folder / "config.json").write_bytes(raw_config or json.dumps(edited).encode())
        weights = load_file(tiny / "model.safetensors")
        if edit_weights:
            edit_weights(weights)
        save_file(weights, folder / "model.safetensors")

    variant("rope-string", lambda c: c.update(rope_scaling="linear"))
    variant("layers-float", lambda c: c.update(num_hidden_layers=1.5))
    variant("eps-text", lambda c: c.update(rms_norm_eps="x"))
    variant("context-text", lambda c: c.update(max_position_embeddings="big"))
    variant("linear-no-factor", lambda c: c.update(rope_scaling={"rope_type": "linear"}))
    variant("eos-text", lambda c: c.update(eos_token_id="x"))
    variant("config-not-utf8", raw_config=b'{"model_type": "' + NOT_UTF8 + b'"}')
    variant("nan-weights", edit_weights=lambda w: w["model.norm.weight"].fill_(float("nan")))
    variant("no-eos", lambda c: c.update(eos_token_id=None))
    variant("empty-vocabulary")
    write_empty_tokenizer(root / "empty-vocabulary")
    small = root / "small-vocabulary"  # a model of 100 tokens with the 300-token tokenizer
    small.mkdir()
    (small / "tokenizer.json").write_bytes((tiny / "tokenizer.json").read_bytes())
    write_checkpoint(small, tiny_hf_config(vocab=100, eos_token_id=2, max_position_embeddings=64))

    medusa = root / "medusa"
    (root / "truncated.safetensors").write_bytes(medusa.with_suffix(".safetensors").read_bytes()[:100])
    (root / "truncated.json").write_bytes(medusa.with_suffix(".json").read_bytes())
    (root / "badjson.safetensors").write_bytes(medusa.with_suffix(".safetensors").read_bytes())
    (root / "badjson.json").write_text('{"kind": "medusa",')
    (root / "wrongshape.json").write_bytes(medusa.with_suffix(".json").read_bytes())
    save_file({"embeddings": torch.zeros(3, 2, 5)}, root / "wrongshape.safetensors")
    (root / "a-file").write_text("")
    (root / "latin1.jsonl").write_bytes(b'{"prompt": "' + NOT_UTF8 + b'"}\n')
    (root / "latin1.txt").write_bytes(NOT_UTF8)
    long_prompt = json.dumps({"prompt": "the quick brown fox " * 40})
    (root / "long-in-the-middle.jsonl").write_text('{"prompt": "the dog"}\n' + long_prompt + "\n")
    return root


def write_empty_tokenizer(folder):
    from tokenizers import Tokenizer, models

    Tokenizer(models.BPE()).save(str(folder / "tokenizer.json"))


def tiny(world, *argv):
    return program("decode.py", "--model", world / "tiny", "--raw", "--max-new-tokens", 4, *argv)


# (name, command, fragments of the error line, shell redirection of the standard streams)
CASES = {
    # bytes that are not UTF-8
    "prompt argument not UTF-8": (lambda w: tiny(w, "--prompt", os.fsdecode(NOT_UTF8)), ["--prompt", "UTF-8"]),
    "prompt file not UTF-8": (lambda w: tiny(w, "--prompt-file", w / "latin1.jsonl"), ["latin1.jsonl:1", "UTF-8"]),
    "stdin not UTF-8": (lambda w: tiny(w), ["standard input", "UTF-8"], "<latin1.txt"),
    "config.json not UTF-8": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "config-not-utf8"), ["config.json"]),
    # config values of the wrong kind
    "rope_scaling a string": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "rope-string"), ["rope_scaling"]),
    "layers a float": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "layers-float"), ["num_hidden_layers"]),
    "eps a string": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "eps-text"), ["rms_norm_eps"]),
    "context a string": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "context-text"),
                         ["max_position_embeddings"]),
    "linear scaling without factor": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "linear-no-factor"),
                                      ["factor"]),
    "eos a string": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "eos-text"), ["eos_token_id"]),
    # the cache directory
    "cache is a file": (lambda w: program("decode.py", "--prompt", "hi"), ["a-file is a file", "SPECDEC_CACHE"],
                        "", {"SPECDEC_CACHE": "a-file/cache"}),
    # the standard streams
    "stdout closed": (lambda w: tiny(w, "--prompt", "hi"), ["standard output is closed"], ">&-"),
    "stdin closed": (lambda w: tiny(w), ["standard input is closed"], "<&-"),
    # huge integers
    "huge --max-new-tokens": (lambda w: tiny(w, "--prompt", "hi", "--max-new-tokens", 10**30), ["--max-new-tokens"]),
    "huge --seed": (lambda w: tiny(w, "--prompt", "hi", "--temperature", 1, "--seed", 10**30), ["--seed"]),
    "huge --top-k": (lambda w: tiny(w, "--prompt", "hi", "--temperature", 1, "--top-k", 10**30), ["--top-k"]),
    "huge --tree-rows": (lambda w: tiny(w, "--prompt", "hi", "--method", "ppd", "--tree-rows", 100000),
                         ["--tree-rows", "2..256"]),
    "huge bench --prompts": (lambda w: program("bench.py", "--prompts", 10**30), ["--prompts"]),
    "bench --out in a file": (lambda w: program("bench.py", "latency", "--out", w / "tiny" / "config.json" / "r.json"),
                              ["cannot write", "config.json is a file"]),
    # the figures
    "visualize a method that guesses nothing": (lambda w: program("visualize.py", "step", "--method", "vanilla",
                                                                  "--prompt", "hi"), ["--method", "vanilla"]),
    "visualize a missing results file": (lambda w: program("visualize.py", "bench", w / "missing.json"),
                                         ["missing.json does not exist"]),
    "visualize into a file": (lambda w: program("visualize.py", "step", "--method", "anpd", "--model", w / "tiny",
                                                "--raw", "--prompt", "the quick", "--out", w / "tiny" / "config.json"),
                              ["config.json"]),
    # broken artifacts
    "truncated artifact": (lambda w: tiny(w, "--prompt", "hi", "--method", "medusa", "--trained", w / "truncated"),
                           ["truncated.safetensors", "not a readable medusa artifact"]),
    "artifact with broken JSON": (lambda w: tiny(w, "--prompt", "hi", "--method", "medusa", "--trained",
                                                 w / "badjson"), ["badjson.json", "not a readable medusa artifact"]),
    "artifact tensors of the wrong shape": (lambda w: tiny(w, "--prompt", "hi", "--method", "medusa", "--trained",
                                                           w / "wrongshape"), ["wrongshape", "medusa artifact"]),
    # training
    "train with a NaN learning rate": (lambda w: program("train_prompt.py", "ppd", "--lr", "nan"), ["--lr"]),
    # nothing silently wrong
    "a tokenizer with no vocabulary": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "empty-vocabulary"),
                                       ["empty-vocabulary", "vocabulary is empty"]),
    "a tokenizer larger than the model": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "small-vocabulary"),
                                          ["small-vocabulary", "the model only 100"]),
    "no end-of-sequence token": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "no-eos"),
                                 ["no-eos", "end-of-sequence"]),
    "training with no vocabulary": (lambda w: program("train_prompt.py", "medusa", "--model", w / "empty-vocabulary",
                                                      "--out", w / "out"), ["vocabulary is empty"]),
    "NaN weights": (lambda w: tiny(w, "--prompt", "hi", "--model", w / "nan-weights"), ["NaN or inf", "nan-weights"]),
    "--temperature inf": (lambda w: tiny(w, "--prompt", "hi", "--temperature", "inf"), ["temperature"]),
    "--top-p with greedy": (lambda w: tiny(w, "--prompt", "hi", "--top-p", 0.5), ["--top-p", "sampling"]),
    "--draft-layers with --draft-model": (lambda w: tiny(w, "--prompt", "hi", "--method", "speculative",
                                                         "--draft-model", w / "tiny", "--draft-layers", 1),
                                          ["--draft-layers", "--draft-model"]),
    "a prompt too long mid-file": (lambda w: tiny(w, "--prompt-file", w / "long-in-the-middle.jsonl"),
                                   ["long-in-the-middle.jsonl:2", "context"]),
}


@pytest.fixture(scope="module")
def outcomes(world):
    """Every case's (exit status, stderr), the programs run concurrently."""
    running = {}
    for name, (command, _, *shell) in CASES.items():
        redirect, env = shell[0] if shell else "", shell[1] if len(shell) > 1 else {}
        line = " ".join(f"'{part}'" for part in command(world)) + " " + redirect
        running[name] = subprocess.Popen(["sh", "-c", line], cwd=world, stdout=subprocess.DEVNULL,
                                         stderr=subprocess.PIPE, env=os.environ | env)
    return {name: finished(process) for name, process in running.items()}


def finished(process, seconds=120) -> tuple[int, str]:
    """(exit status, stderr); a program still running after `seconds` is killed and fails its case
    (a bad input must be refused at once, not after minutes of work)."""
    try:
        return process.wait(timeout=seconds), process.stderr.read().decode()
    except subprocess.TimeoutExpired:
        process.kill()
        return process.wait(), f"still running after {seconds}s"


def assert_one_error_line(code, err, fragments):
    """A non-zero exit, no traceback, and the last stderr line the only error line (progress lines
    such as "Loaded ..." may come before it)."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code != 0, err
    assert "Traceback" not in err, err
    assert lines and sum("error:" in line for line in lines) == 1 and "error:" in lines[-1], err
    for fragment in fragments:
        assert fragment in lines[-1], lines[-1]


@pytest.mark.parametrize("name", CASES)
def test_a_bad_input_is_one_error_line(outcomes, name):
    assert_one_error_line(*outcomes[name], CASES[name][1])


def test_a_reader_that_goes_away_is_one_line(world):
    """stdout piped into `head`, which exits: the pipe is already closed when the answer is written."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    process = subprocess.run(tiny(world, "--prompt", "hi"), stdout=write_end, stderr=subprocess.PIPE)
    os.close(write_end)
    assert_one_error_line(process.returncode, process.stderr.decode(), ["standard output was closed"])


def test_ctrl_c_while_importing_is_one_line():
    """Once `errors` is imported, an uncaught Ctrl-C is one line (its excepthook), and each program
    imports it before torch, whose import takes seconds."""
    interrupt = "import errors, os, signal; os.kill(os.getpid(), signal.SIGINT); import torch"
    # as from a terminal: a library in this test process may have left SIGINT ignored, which the child
    # would inherit (and Python then never raises KeyboardInterrupt)
    process = subprocess.run([sys.executable, "-c", interrupt], cwd=ROOT, capture_output=True, text=True,
                             preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    assert process.returncode != 0 and process.stderr == "error: interrupted (Ctrl-C)\n", process.stderr
    for name in ("decode.py", "train_prompt.py", "bench.py", "visualize.py"):
        imports = [line.split()[1] for line in (ROOT / name).read_text().splitlines()
                   if line.startswith(("import ", "from "))]
        assert imports.index("errors") < imports.index("torch"), f"{name} imports torch before errors"


def test_ctrl_c_while_decoding_is_one_line(capsys, monkeypatch, world):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr("programs.cli.generate", interrupted)
    assert main(["--model", str(world / "tiny"), "--raw", "--prompt", "hi"]) == errors.INTERRUPTED
    assert capsys.readouterr().err.strip().splitlines()[-1] == "error: interrupted (Ctrl-C)"


def test_an_error_mid_answer_starts_its_own_line(capsys, monkeypatch, world):
    """A stub reached after some of the answer streamed (a students' copy): the answer's line is ended,
    so a terminal shows the error on a line of its own."""
    def streams_then_stops(*args, on_tokens=None, **kwargs):
        on_tokens([5, 6], 0)
        raise NotImplementedError("a10_eagle_trees: implement grow")
    monkeypatch.setattr("programs.cli.generate", streams_then_stops)
    assert main(["--model", str(world / "tiny"), "--raw", "--prompt", "hi"]) == 1
    captured = capsys.readouterr()
    assert captured.out.endswith("\n") and captured.out.strip()
    assert captured.err.strip().splitlines()[-1] == "error: not implemented: a10_eagle_trees: implement grow"


@pytest.mark.parametrize("failure", [KeyboardInterrupt(), OSError(28, "No space left on device")])
def test_a_conversion_that_stops_leaves_no_folder_behind(tmp_path, monkeypatch, failure):
    """Ctrl-C or a full disk in the middle of converting the default model: no half-written folder,
    and the full disk is one line naming the cache and SPECDEC_CACHE."""
    def stop(*args, **kwargs):
        raise failure
    monkeypatch.setattr(convert, "save_file", stop)
    with pytest.raises(type(failure) if isinstance(failure, KeyboardInterrupt) else errors.UserError,
                       match=None if isinstance(failure, KeyboardInterrupt) else "No space left.*SPECDEC_CACHE"):
        convert.convert_gguf(convert.find_default_gguf(), tmp_path / "model")
    assert list(tmp_path.iterdir()) == []


def test_a_damaged_converted_model_is_refused_with_the_folder_to_delete(tmp_path, monkeypatch):
    """The converted default model carries its weights' checksum: a changed byte is caught on load."""
    folder = tmp_path / convert.DEFAULT_MODEL_NAME
    write_checkpoint(folder, tiny_hf_config())
    (folder / "conversion.json").write_text(json.dumps({
        "converter_version": convert.CONVERTER_VERSION,
        "model_sha256": convert.file_sha256(folder / "model.safetensors")}))
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    assert convert.default_model_dir() == folder  # intact: used as it is
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-5] ^= 0xFF  # one byte of a weight
    (folder / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(errors.UserError, match=f"{folder}.*damaged.*delete that folder"):
        convert.default_model_dir()


def test_an_artifact_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
    from methods import artifacts

    def full_disk(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(artifacts, "save_file", full_disk)
    with pytest.raises(OSError):
        artifacts.save(tmp_path / "ppd", {"embeddings": torch.zeros(1, 1, 4)}, {"kind": "ppd"})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("content", ["{not json", "[1, 2]", '{"KEY": {"ppd": {"rows": 100000}}}',
                                     '{"KEY": {"ppd": {"rows": "6"}}}', '{"KEY": []}'])
def test_a_damaged_calibration_file_is_ignored_and_rewritten(tmp_path, monkeypatch, content):
    """A calibration that cannot be read, or holds a size no method can use, is not used: the
    default size is, and --calibrate writes a good file over it."""
    import calibrate
    from helpers import tiny_model

    model = tiny_model()
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path))
    calibrate.calibration_file().write_text(content.replace("KEY", calibrate.machine_key(model)))
    assert calibrate.calibrated_rows(model, "ppd", default=6) == 6
    calibrate.save_rows(model, "ppd", 8, [])
    assert calibrate.calibrated_rows(model, "ppd", default=6) == 8


def test_an_error_that_ctrl_c_caused_is_an_interrupt(capsys):
    """Ctrl-C inside a C extension's import reaches us as the ImportError it caused."""
    def importing():
        try:
            raise KeyboardInterrupt
        except KeyboardInterrupt:
            raise ImportError("initialization of _C raised unreported exception")
    assert errors.run_program(importing) == errors.INTERRUPTED
    assert capsys.readouterr().err == "error: interrupted (Ctrl-C)\n"
    with pytest.raises(ZeroDivisionError):  # a bug keeps its traceback
        errors.run_program(lambda: 1 / 0)


def test_a_function_not_written_yet_is_one_line(capsys):
    """In the course's students' copy, decode.py reaches a starter's stub: one line naming it."""
    def unwritten():
        raise NotImplementedError("a4_greedy_loop: implement generate")
    assert errors.run_program(unwritten) == 1
    assert capsys.readouterr().err == "error: not implemented: a4_greedy_loop: implement generate\n"
