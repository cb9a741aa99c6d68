"""The signposts are true: README.md's table of the files each method runs, and docs/code-paths.md's
list of the functions, are what a trace of the code finds.

Each method is built as the command line builds it (methods.py) and decodes one prompt on the real
default model, under a profiler that records every function of ours that runs. The size and L(n) are
fixed (the default size, and the L(n) written below), so that the trace does not depend on this
machine's calibration files; the command line also reads those (calibrate.py) before it builds.

    python tests/test_signposts.py --write    # rewrite the table and the list from a fresh trace
"""

import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(ROOT)]

import torch  # noqa: E402

from methods.latency import Latency  # noqa: E402

README, CODE_PATHS = ROOT / "README.md", ROOT / "docs" / "code-paths.md"
BEGIN = "<!-- files per method: traced by tests/test_signposts.py (--write rewrites this table) -->"
END = "<!-- end of the traced table -->"
PROMPT = "Give me three tips for learning a language."  # APAR forks on it
NEW_TOKENS = 48
# L(n) as measured on a 2-core AMD EPYC (float32), in milliseconds but read as seconds: the cost-aware
# cuts decide by the ratios of L(n), and a drafter's own time (which they add, and which varies from
# machine to machine) is then too small to sway them, so the trace is the same on any machine
LATENCY = Latency({1: 22.15, 2: 35.94, 8: 41.3, 16: 53.8, 32: 88.4})
FOLDERS = ("backends", "methods", "training", "programs")  # ours, beside the top level's files
ORDER = ["vanilla", "anpd", "lookahead", "recycling", "speculative", "medusa", "ppd", "eagle", "auto", "apar"]


def traced(run) -> set[tuple[str, str]]:
    """(module, function) of every function of ours that ran during run()."""
    seen = set()

    def profile(frame, event, arg):
        if event == "call":
            path = Path(frame.f_code.co_filename)
            # (not numba's compiler calling an overload's Python function, which it does only where no
            # compiled copy of the kernel is on disk yet: no decoding runs it)
            caller = frame.f_back
            if (path.parent == ROOT or path.parent.parent == ROOT and path.parent.name in FOLDERS) and not (
                    caller and "numba" in Path(caller.f_code.co_filename).parts):
                seen.add((path.relative_to(ROOT).with_suffix("").as_posix(), frame.f_code.co_qualname))
    sys.setprofile(profile)
    try:
        run()
    finally:
        sys.setprofile(None)
    return {(module, name) for module, name in seen if "<" not in name}  # comprehensions and lambdas: their function's


def trace_methods(model_dir: Path) -> dict[str, set[tuple[str, str]]]:
    """Per method, the functions that building it and decoding PROMPT with it ran (the reference
    backend, decode.py's default)."""
    from decode import generate
    from methods.registry import METHODS, apar_engine, build_drafter, default_options
    from checkpoint import load_checkpoint
    from tokenizer import Tokenizer

    tokenizer = Tokenizer(model_dir)
    ids = tokenizer.prompt_ids(PROMPT, raw=False)
    model = load_checkpoint(model_dir, torch.float32)
    found = {}
    with torch.inference_mode():
        for name in ORDER:
            method, options = METHODS[name], default_options()
            if method.engine:  # APAR changes the model it is given: a copy of its own
                apar_model = load_checkpoint(model_dir, torch.float32)
                found[name] = traced(lambda: apar_engine(options, apar_model, tokenizer).generate(
                    ids, max_new_tokens=NEW_TOKENS, eos_ids=tokenizer.eos_ids))
                continue
            inputs = method.size.default + method.size.root if method.size else None
            found[name] = traced(lambda: generate(model, ids, max_new_tokens=NEW_TOKENS, eos_ids=tokenizer.eos_ids,
                                                  drafter=build_drafter(method, options, model, tokenizer,
                                                                        inputs=inputs, latency=LATENCY)))
    return found


def files_table(found: dict[str, set]) -> str:
    """The README's table: per method, the files it runs (beyond vanilla's, after the first row)."""
    vanilla = sorted({module for module, _ in found["vanilla"]})
    rows = [f"| vanilla | {len(vanilla)} | {', '.join(f'`{m}.py`' for m in vanilla)} |"]
    for name in ORDER[1:]:
        modules = {module for module, _ in found[name]}
        more = sorted(modules - set(vanilla))
        fewer = sorted(set(vanilla) - modules)
        text = "vanilla's" + (f" but {', '.join(f'`{m}.py`' for m in fewer)}" if fewer else "")
        text += f", and {', '.join(f'`{m}.py`' for m in more)}" if more else ""
        rows.append(f"| {name} | {len(modules)} | {text} |")
    return "\n".join([BEGIN, "| `--method` | files | which |", "|---|---|---|", *rows, END])


def functions_list(found: dict[str, set]) -> str:
    """docs/code-paths.md: vanilla's functions, then each method's beyond them, by file."""
    def by_file(functions) -> list[str]:
        files = defaultdict(list)
        for module, name in sorted(functions):
            files[module].append(f"`{name}`")
        return [f"- `{module}.py`: {', '.join(names)}" for module, names in files.items()]
    lines = ["# The functions each method runs", "",
             "Traced by `tests/test_signposts.py`, which fails when this file and the code disagree",
             "(`python tests/test_signposts.py --write` rewrites it). Each method was built as `decode.py`",
             f"builds it, at its default size, and decoded {NEW_TOKENS} tokens of",
             f'"{PROMPT}" greedily on the default model.', "",
             "## vanilla: the guess-and-verify loop with an empty drafter", "", *by_file(found["vanilla"])]
    for name in ORDER[1:]:
        own = found[name] - found["vanilla"]
        lines += ["", f"## {name}: beyond vanilla's", "", *by_file(own)]
    return "\n".join(lines) + "\n"


def written_table() -> str:
    text = README.read_text()
    if BEGIN not in text or END not in text:
        return ""
    return text[text.index(BEGIN):text.index(END) + len(END)]


def test_the_files_and_functions_each_method_runs_are_as_written(default_model_dir):
    found = trace_methods(default_model_dir)
    # plain decoding on the default (reference) backend runs the core and nothing else but
    # methods/registry.py, which builds its empty drafter
    assert {module for module, _ in found["vanilla"]} <= {"decode", "model", "kv_cache", "tree", "verify", "sampling",
                                                          "drafters", "methods/registry"}
    assert written_table() == files_table(found), (
        "README.md's files-per-method table is not what a trace finds; run python tests/test_signposts.py --write "
        "and read the diff")
    assert CODE_PATHS.read_text() == functions_list(found), (
        "docs/code-paths.md is not what a trace finds; run python tests/test_signposts.py --write and read the diff")


if __name__ == "__main__":
    from programs.convert import default_model_dir

    if sys.argv[1:] != ["--write"]:
        sys.exit(__doc__)
    found = trace_methods(default_model_dir())
    table, text = files_table(found), README.read_text()
    if not written_table():
        sys.exit(f"README.md has no table between {BEGIN!r} and {END!r}: put both lines where it goes")
    README.write_text(text.replace(written_table(), table))
    CODE_PATHS.write_text(functions_list(found))
    print(table)
