"""Generated bad inputs for every program (decode.py, train_prompt.py, bench.py, visualize.py): a
seeded generator mutates a valid command line with bad option values (read from each program's own
argparse parser, so a new option is covered the day it is added), unknown or incomplete options,
and broken files: prompt files, checkpoint folders, trained parts and results files, cut at a
random byte or edited at a random JSON key. Every case must end in one of two ways:

- refused: a non-zero exit, no traceback, and the last stderr line the only `error:` line;
- (decode.py and visualize.py only, where a mutation may leave a valid command on the tiny model)
  done: exit 0, and no silent empty answer (text on stdout, or a note on stderr saying it is empty).

The default run draws CASES cases; the thorough profile (HYPOTHESIS_PROFILE=thorough) draws
THOROUGH_CASES. The programs run in this process (each case a fresh parser and main), with a
watchdog: a case still running after WATCHDOG_SECONDS fails, since a bad input must be refused at
once, not after minutes of work.

    python tests/test_bad_inputs.py 20      # print the first 20 generated cases
"""

import argparse
import inspect
import json
import os
import random
import signal
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path[:0] = [str(Path(__file__).resolve().parent.parent), str(Path(__file__).resolve().parent)]  # (as a script)

import bench  # noqa: E402
from programs import cli  # noqa: E402
import train_prompt  # noqa: E402
import visualize  # noqa: E402
from helpers import tiny_artifacts, tiny_hf_config, write_checkpoint, write_tiny_tokenizer  # noqa: E402

CASES = 100
THOROUGH_CASES = 600
WATCHDOG_SECONDS = 60
SEED = 20261125

PROGRAMS = {  # name: (parser, main, may a mutated command still be valid and cheap?)
    "decode.py": (cli.build_parser, cli.main, True),
    "train_prompt.py": (train_prompt.build_parser, train_prompt.main, False),
    "bench.py": (bench.build_parser, bench.main, False),
    "visualize.py": (visualize.build_parser, visualize.main, True),
}


@dataclass
class Case:
    program: str
    argv: list[str]
    why: str  # what was made bad


# ---- the world the cases point at ------------------------------------------------------------------

@pytest.fixture(scope="module")
def world(tmp_path_factory):
    root = tmp_path_factory.mktemp("bad-inputs")
    make_world(root)
    return root


def make_world(root: Path) -> None:
    """A tiny checkpoint, its trained parts, a prompt file and a results file: the valid things the
    generator starts from and breaks."""
    tiny = root / "tiny"
    tiny.mkdir()
    vocab = write_tiny_tokenizer(tiny)
    write_checkpoint(tiny, tiny_hf_config(vocab=vocab, eos_token_id=2, max_position_embeddings=64))
    tiny_artifacts(tiny, root)
    (root / "prompts.jsonl").write_text('{"prompt": "the quick"}\n{"prompt": "the lazy dog"}\n')
    (root / "results.json").write_text(json.dumps({"machine": {}, "tables": []}))
    (root / "a-file").write_text("not a folder")
    (root / "a-folder").mkdir()


def broken_copy(rng: random.Random, source: Path, into: Path) -> str:
    """`source` (a file, or a folder of files) copied to `into` with one thing broken; says what."""
    files = sorted(p for p in source.iterdir() if p.is_file()) if source.is_dir() else [source]
    if source.is_dir():
        into.mkdir(parents=True)
        for file in files:
            (into / file.name).write_bytes(file.read_bytes())
        victim = into / rng.choice(files).name
    else:
        into.parent.mkdir(parents=True, exist_ok=True)
        into.write_bytes(source.read_bytes())
        victim = into
    data = victim.read_bytes()
    how = rng.choice(["cut", "removed", "emptied", "json key", "bytes"])
    if how == "json key" and victim.suffix in (".json", ".jsonl"):
        return edit_json(rng, victim) or broken_bytes(rng, victim, data)
    if how == "removed" and source.is_dir():
        victim.unlink()
        return f"{victim.name} removed"
    if how == "emptied":
        victim.write_bytes(b"")
        return f"{victim.name} emptied"
    if how == "cut" and len(data) > 1:
        at = rng.randrange(1, len(data))
        victim.write_bytes(data[:at])
        return f"{victim.name} cut at byte {at} of {len(data)}"
    return broken_bytes(rng, victim, data)


def broken_bytes(rng: random.Random, victim: Path, data: bytes) -> str:
    at = rng.randrange(len(data) + 1)
    junk = bytes(rng.randrange(256) for _ in range(rng.randint(1, 8)))
    victim.write_bytes(data[:at] + junk + data[at:])
    return f"{victim.name}: {junk!r} inserted at byte {at}"


WRONG_VALUES = [None, -1, 0, 10**30, 1.5, float("nan"), "x", "", [], {}, [1, "a"], True]


def edit_json(rng: random.Random, victim: Path) -> str | None:
    """One key of a JSON object (or of a JSON line's) deleted or given a value of a wrong kind."""
    lines = victim.read_text(encoding="utf-8").splitlines() if victim.suffix == ".jsonl" else None
    try:
        obj = json.loads(rng.choice(lines) if lines else victim.read_text(encoding="utf-8"))
    except (ValueError, IndexError):
        return None
    if not isinstance(obj, dict) or not obj:
        return None
    key = rng.choice(sorted(obj))
    if rng.random() < 0.3:
        del obj[key]
        change = f"{key} deleted"
    else:
        obj[key] = rng.choice(WRONG_VALUES)
        change = f"{key} = {json.dumps(obj[key])}"
    text = json.dumps(obj)
    victim.write_text(text + "\n" if lines else text, encoding="utf-8")
    return f"{victim.name}: {change}"


# ---- bad option values, read from the parsers ------------------------------------------------------

def options(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    return [a for a in parser._actions if a.option_strings and not isinstance(a, argparse._HelpAction)]


def subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def kind_of(action: argparse.Action) -> str:
    if action.nargs == 0:
        return "flag"
    if action.choices:
        return "choice"
    if action.type is Path:
        return "path"
    if action.type in (int, float):
        return action.type.__name__
    convert = inspect.getclosurevars(action.type).nonlocals.get("convert") if inspect.isfunction(action.type) else None
    return {int: "int", float: "float"}.get(convert, "text")


def bad_values(action: argparse.Action, world: Path) -> list[str]:
    """Values that no option of this kind may accept."""
    name = action.dest
    return {
        "int": ["abc", "1.5", "", "1" + "0" * 30, "-" + "9" * 30, "0x1f"],
        "float": ["abc", "nan", "-inf", "", "1e999", "1,5"],
        "choice": ["bogus", "", "VANILLA"],
        "path": ([str(world / "a-file" / "out")] if name in ("out", "adapters") else
                 [str(world / "missing"), str(world / "a-file") if name in ("model", "draft_model", "llama_cpp")
                  else str(world / "a-folder")]),
        "text": {"device": ["tpu", "cuda:99", "cpu:x", ""]}.get(name, []),
        "flag": [],
    }[kind_of(action)]


# ---- the cases -------------------------------------------------------------------------------------

def base_argv(program: str, rng: random.Random, world: Path) -> list[str]:
    """A valid command on the tiny model (cheap), or for bench.py a valid start of one."""
    tiny = str(world / "tiny")
    if program == "decode.py":
        method = rng.choice(["vanilla", "anpd", "lookahead", "speculative", "auto"])
        return ["--model", tiny, "--raw", "--max-new-tokens", "4", "--method", method, "--prompt", "the quick"]
    if program == "visualize.py":
        return ["step", "--method", "anpd", "--model", tiny, "--raw", "--prompt", "the quick brown",
                "--max-new-tokens", "6", "--out", str(world / "figures")]
    if program == "train_prompt.py":
        command = rng.choice(["ppd", "medusa", "apar", "data"])
        return [command, "--model", tiny] + ([] if command == "data" else ["--out", str(world / "trained" / command)])
    return [rng.choice(["methods", "acceptance", "speculative", "learned", "latency", "apar"])]


def generate_cases(count: int, world: Path, seed: int = SEED) -> list[Case]:
    """The first `count` cases; case i is the same whatever the count (its own seeded generator)."""
    return [one_case(random.Random(f"{seed}-{number}"), world, number) for number in range(count)]


def one_case(rng: random.Random, world: Path, number: int) -> Case:
    program = rng.choice(sorted(PROGRAMS))
    argv = base_argv(program, rng, world)
    parser = PROGRAMS[program][0]()
    sub = subparsers(parser).get(argv[0]) if subparsers(parser) else None
    actions = options(sub or parser)
    broken = world / "broken" / str(number)
    kind = rng.choice(["value", "value", "value", "syntax", "file"])
    if kind == "file" and program == "decode.py":
        return decode_with_a_broken_file(rng, world, broken, argv)
    if kind == "file" and program == "visualize.py":
        why = broken_copy(rng, world / "results.json", broken / "results.json")
        return Case(program, ["bench", str(broken / "results.json"), "--out", str(broken / "figures")], why)
    if kind == "syntax":
        return Case(program, *syntax_error(rng, argv, actions))
    candidates = [(a, v) for a in actions for v in bad_values(a, world)]
    action, value = rng.choice(candidates)
    flag = rng.choice(action.option_strings)
    values = [value] if action.nargs in (None, "?") else [value, value] if action.nargs == "+" else [value]
    return Case(program, argv + [flag, *values], f"{flag} {value!r}")


def syntax_error(rng: random.Random, argv: list[str], actions) -> tuple[list[str], str]:
    how = rng.choice(["unknown option", "missing value", "flag with a value", "stray word"])
    if how == "missing value":
        takes = [a for a in actions if a.nargs in (None, "+") and a.option_strings]
        if takes:
            flag = rng.choice(rng.choice(takes).option_strings)
            return argv + [flag], f"{flag} without its value"
    if how == "flag with a value":
        flags = [a for a in actions if a.nargs == 0]
        if flags:
            flag = rng.choice(rng.choice(flags).option_strings)
            return argv + [f"{flag}=yes"], f"{flag}=yes"
    if how == "stray word":
        return argv + ["stray"], "a stray word"
    return argv + ["--no-such-option"], "an unknown option"


def decode_with_a_broken_file(rng: random.Random, world: Path, broken: Path, argv: list[str]) -> Case:
    what = rng.choice(["prompt file", "checkpoint", "medusa", "ppd"])
    if what == "prompt file":
        why = broken_copy(rng, world / "prompts.jsonl", broken / "prompts.jsonl")
        argv = argv[:-2] + ["--prompt-file", str(broken / "prompts.jsonl")]
    elif what == "checkpoint":
        why = broken_copy(rng, world / "tiny", broken / "tiny")
        argv = argv + ["--model", str(broken / "tiny")]
    else:
        broken.mkdir(parents=True)
        for suffix in (".safetensors", ".json"):  # the part's two files, one of them then broken
            (broken / f"{what}{suffix}").write_bytes((world / f"{what}{suffix}").read_bytes())
        suffix = rng.choice([".safetensors", ".json"])
        why = broken_copy(rng, world / f"{what}{suffix}", broken / f"{what}{suffix}")
        argv = argv + ["--method", what, "--trained", str(broken / what)]
    return Case("decode.py", argv, why)


# ---- running them ----------------------------------------------------------------------------------

class StillRunning(Exception):
    pass


def run_case(case: Case, capsys) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of the program's main on the case's argv, in this process."""
    def watchdog(*_):
        raise StillRunning(f"still running after {WATCHDOG_SECONDS}s")
    previous = signal.signal(signal.SIGALRM, watchdog)
    signal.alarm(WATCHDOG_SECONDS)
    try:
        code = PROGRAMS[case.program][1](case.argv)
    except SystemExit as exit:  # argparse's refusal
        code = exit.code if isinstance(exit.code, int) else 1
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    out, err = capsys.readouterr()
    return code, out, err


def check(case: Case, code: int, out: str, err: str) -> None:
    lines = [line for line in err.splitlines() if line.strip()]
    err = f"{case.program} {' '.join(case.argv)}    # {case.why}\n{err}"  # (what a failure shows)
    assert "Traceback" not in err, err
    if code != 0:
        assert lines and sum("error:" in line for line in lines) == 1 and "error:" in lines[-1], err
        return
    assert PROGRAMS[case.program][2], f"{case.program} accepted a bad input ({case.why}) and ran: {err[-500:]}"
    assert "error:" not in err, err
    if case.program == "decode.py":
        assert out.strip() or "note: the answer is empty" in err, ("a silent empty answer", err)


def case_count() -> int:
    return THOROUGH_CASES if os.environ.get("HYPOTHESIS_PROFILE") == "thorough" else CASES


@pytest.fixture(scope="module")
def cases(world):
    return generate_cases(case_count(), world)


@pytest.mark.parametrize("number", range(case_count()))
def test_a_generated_bad_input_is_refused_in_one_line_or_answered(number, cases, capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    case = cases[number]
    print(f"{case.program} {' '.join(case.argv)}    # {case.why}", file=sys.__stderr__)  # (shown if it hangs)
    code, out, err = run_case(case, capsys)
    check(case, code, out, err)


def test_the_generator_covers_every_program_and_kind_of_break(cases):
    programs = {case.program for case in cases}
    assert programs == set(PROGRAMS)
    whys = " ".join(case.why for case in cases)
    for kind in ["cut at byte", "inserted at byte", "an unknown option", "'abc'"]:
        assert kind in whys, kind


if __name__ == "__main__":
    import tempfile

    with tempfile.TemporaryDirectory() as folder:
        make_world(Path(folder))
        for case in generate_cases(int(sys.argv[1]) if len(sys.argv) > 1 else 20, Path(folder)):
            print(f"{case.program} {' '.join(case.argv)}    # {case.why}")
