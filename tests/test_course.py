"""The course's graders are proven: against the reference every grader passes, against the untouched
starters every grader test fails, and every planted student mistake (course/mistakes.py) fails its
assignment's grader with a message that points at it. The starters are what course/strip.py cuts
from the reference, and its students' copy really has the answers removed."""

import ast
import importlib
import inspect
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ROOT
from preloaded_pytest import PreloadedPytest

COURSE = ROOT / "course"
sys.path.insert(0, str(COURSE))

import dry_run  # noqa: E402
import strip  # noqa: E402
from assignments import ASSIGNMENTS, split_entry  # noqa: E402
from mistakes import MISTAKES  # noqa: E402


def graded(pytest_runs, tmp_path, name, *args, shrunk=False) -> dict[str, str]:
    """Run the graders here with `args`: {test id: its failure message, "" when it passed} (two at once:
    each grader runs torch on one thread, course/conftest.py). Unless `shrunk`, a failing example is
    reported as found (tests/helpers.py's "unshrunk" profile), not shrunk as a student's run shrinks it;
    a thorough run (HYPOTHESIS_PROFILE=thorough) grades with its own profile, shrinking."""
    default_run = os.environ.get("HYPOTHESIS_PROFILE", "ci") == "ci"
    profile = {"HYPOTHESIS_PROFILE": "unshrunk"} if default_run and not shrunk else {}
    report, log = tmp_path / f"{name}.xml", tmp_path / f"{name}.log"
    code = pytest_runs.run(ROOT, [*dry_run.PYTEST_OPTIONS, f"--junitxml={report}", *args], os.environ | profile, log)
    assert report.exists(), f"the grader run {name} ended with {code} and wrote no report: its output is in {log}"
    return dry_run.results_of(report)


def points_at(name: str, results: dict[str, str]) -> bool:
    """Whether a grader failed with a message holding the mistake's fragment."""
    return any(MISTAKES[name].caught_by in message for message in results.values() if message)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every grader run CI needs, two at a time: the reference, the starters, each mistake. Each run is a
    process of its own, forked from one that imported the libraries once (tests/preloaded_pytest.py).
    Shrinking took over half of the runs' time, so failing examples are first left unshrunk; a mistake
    whose unshrunk message does not point at it is graded again shrunk, as its student would see it.
    (Shrinking keeps a failure's assertion, so an unshrunk message that points at a mistake is the
    shrunk one's too.)"""
    tmp, pytest_runs = tmp_path_factory.mktemp("graded"), PreloadedPytest()
    jobs = {"reference": [str(COURSE), "--reference"], "starters": [str(COURSE)]}
    jobs |= {name: [str(COURSE / mistake.assignment), "--mistake", name] for name, mistake in MISTAKES.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        def grade_all(names, suffix="", shrunk=False):
            futures = {name: pool.submit(graded, pytest_runs, tmp, name.replace("/", "-") + suffix, *jobs[name],
                                         shrunk=shrunk) for name in names}
            return {name: future.result() for name, future in futures.items()}

        results = grade_all(jobs)
        return results | grade_all([name for name in MISTAKES if not points_at(name, results[name])], "-shrunk",
                                   shrunk=True)


def test_every_grader_passes_against_the_reference(runs):
    assert runs["reference"] and all(message == "" for message in runs["reference"].values()), runs["reference"]
    assert {test.split(".")[1] for test in runs["reference"]} >= set(ASSIGNMENTS), "every assignment has a grader"


def test_every_grader_test_fails_against_the_starters(runs):
    assert runs["starters"].keys() == runs["reference"].keys()
    assert [test for test, message in runs["starters"].items() if "NotImplementedError" not in message] == []


@pytest.mark.parametrize("name", MISTAKES)
def test_each_mistake_is_caught_with_a_message_that_points_at_it(runs, name):
    failures = [message for message in runs[name].values() if message]
    assert failures, f"{name} passed every grader test"
    assert points_at(name, runs[name]), (name, failures)


def test_each_assignment_has_at_least_two_mistakes():
    for assignment in ASSIGNMENTS:
        assert sum(m.assignment == assignment for m in MISTAKES.values()) >= 2, assignment


@pytest.mark.parametrize("assignment", ASSIGNMENTS)
def test_the_starters_are_cut_from_the_reference(assignment):
    """Same signatures and docstrings as the reference, word for word (course/strip.py writes them)."""
    assert (COURSE / assignment / "starter.py").read_text() == strip.starter(assignment), (
        f"course/{assignment}/starter.py is stale: run python course/strip.py")
    starter = {}
    exec(compile((COURSE / assignment / "starter.py").read_text(), assignment, "exec"), starter)
    for entry in ASSIGNMENTS[assignment]:
        module, qualified = split_entry(entry)
        reference, stub = importlib.import_module(module), starter
        names = qualified.split(".")
        for name in names:
            reference, stub = getattr(reference, name), stub[name] if isinstance(stub, dict) else getattr(stub, name)
        assert inspect.signature(stub) == inspect.signature(reference) and stub.__doc__ == reference.__doc__, entry


def reference_bodies() -> dict[str, str]:
    """Each assignment function's reference body (after its docstring), one stripped line per line."""
    bodies = {}
    for entries in ASSIGNMENTS.values():
        for entry in entries:
            module, qualified = split_entry(entry)
            source, found = strip.definitions(module)
            function = found[qualified]
            lines = source.splitlines()[function.body[0].end_lineno:function.end_lineno]
            bodies[entry] = "\n".join(line.strip() for line in lines if line.strip())
    return bodies


@pytest.mark.parametrize("through", ASSIGNMENTS)
def test_the_students_copy_has_no_answers_it_has_yet_to_give(tmp_path, through):
    """The copy for assignment K holds no reference body of K or a later assignment, anywhere, and no
    planted mistake; the bodies of the assignments before K (released) are in place."""
    copy = tmp_path / "copy"
    subprocess.run([sys.executable, str(COURSE / "strip.py"), "hide", str(copy), "--through", through], check=True,
                   capture_output=True)
    texts = {path: "\n".join(line.strip() for line in path.read_text().splitlines() if line.strip())
             for path in copy.rglob("*") if path.suffix in (".py", ".md")}
    names = list(ASSIGNMENTS)
    unreleased = {entry for assignment in names[names.index(through):] for entry in ASSIGNMENTS[assignment]}
    bodies = reference_bodies()
    shipped = [(entry, str(path.relative_to(copy))) for entry, body in bodies.items() if entry in unreleased
               for path, text in texts.items() if body in text]
    assert shipped == [], "reference bodies in the students' copy"
    missing = [entry for entry, body in bodies.items() if entry not in unreleased
               and not any(body in text for text in texts.values())]
    assert missing == [], "released assignments' bodies must stay in the copy"
    assert "class " not in (copy / "course" / "mistakes.py").read_text(), "planted mistakes shipped"
    shipped_tools = [tool for tool in ["tests/test_course.py", "course/strip.py", "course/dry_run.py",
                                       "course/mutants.py"] if (copy / tool).exists()]
    assert shipped_tools == [], "the instructor's tools shipped"


def test_the_walkthrough_runs_and_shows_each_methods_step(default_model_dir):
    run = subprocess.run([sys.executable, str(COURSE / "walkthrough.py")], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-2000:]
    for method in ["anpd", "lookahead", "speculative", "medusa", "ppd"]:
        assert f"=============== {method}:" in run.stdout
    assert run.stdout.count("5. the cache holds") == 5 and ": False" not in run.stdout  # keep moved the path
    section = {method: run.stdout.split(f"=============== {method}:")[1].split("===============")[0]
               for method in ["lookahead", "speculative"]}
    kept = ast.literal_eval(re.search(r"after keep\(start=\d+, path=(\[[\d, ]+\])\)", section["lookahead"]).group(1))
    assert kept != list(range(len(kept))), f"Lookahead's pass kept {kept}, the tree's first nodes: keep moved nothing"
    assert int(re.search(r"(\d+) accepted \+ the bonus token", section["speculative"]).group(1)) >= 1
    assert "accept with probability min(1, p'(x) / q(x))" in run.stdout and "drawn from p'" in run.stdout
