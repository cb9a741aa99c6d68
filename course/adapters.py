"""The one door between the graders and the code they grade (as CS336's tests/adapters.py).

A grader asks `implementation("a3_tree_mask", "Tree")` for what it tests. That is yours by default:
the name in the assignment's starter.py. With `--reference` it is the project's own code, and with
`--mistake NAME` the project's code with one planted student mistake (mistakes.py).
"""

import importlib
import importlib.util
from pathlib import Path

import pytest

from assignments import ASSIGNMENTS, graded_modules, graded_names, split_entry
from mistakes import MISTAKES

COURSE = Path(__file__).resolve().parent
chosen = {"reference": False, "mistake": None}


def select(reference: bool, mistake: str | None) -> None:
    if mistake is not None and mistake not in MISTAKES:
        raise pytest.UsageError(f"--mistake {mistake!r} is not one of: {', '.join(MISTAKES)}")
    chosen.update(reference=reference, mistake=mistake)


def reference(assignment: str, name: str):
    return getattr(importlib.import_module(graded_modules(assignment)[name]), name)


def starter(assignment: str):
    spec = importlib.util.spec_from_file_location(f"{assignment}_starter", COURSE / assignment / "starter.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def implementation(assignment: str, name: str):
    """What the graders of `assignment` test under `name` (a function or a class)."""
    if name not in graded_names(assignment):
        raise KeyError(f"{assignment} grades {graded_names(assignment)}, not {name!r}")
    mistake = MISTAKES.get(chosen["mistake"])
    if mistake is not None and (mistake.assignment, mistake.name) == (assignment, name):
        return mistake.implementation
    if chosen["reference"] or mistake is not None:
        return reference(assignment, name)
    return getattr(starter(assignment), name)


def install(monkeypatch, assignment: str, name: str, module) -> None:
    """Put the implementation under test in place of the reference inside `module` for one test, so the
    project's own code (the decoding loop, the drafters) runs with it. For a class, its graded methods
    replace the reference class's."""
    graded = implementation(assignment, name)
    original = getattr(module, name)
    if isinstance(original, type):
        for _, qualified in map(split_entry, ASSIGNMENTS[assignment]):
            owner, _, method = qualified.partition(".")
            if method and owner == name:
                monkeypatch.setattr(original, method, getattr(graded, method))
    else:
        monkeypatch.setattr(module, name, graded)
