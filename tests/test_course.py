"""The course's graders are proven: against the reference every grader passes, against the untouched
starters every grader test fails, and every planted student mistake (course/mistakes.py) fails its
assignment's grader with a message that points at it. The starters are what course/strip.py cuts
from the reference, and its students' copy really has the answers removed."""

import ast
import inspect
import re
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from concurrent.futures import ThreadPoolExecutor

import pytest

from helpers import ROOT

COURSE = ROOT / "course"
sys.path.insert(0, str(COURSE))

import strip  # noqa: E402
from assignments import ASSIGNMENTS  # noqa: E402
from mistakes import MISTAKES  # noqa: E402


def graded(tmp_path, name, *args) -> dict[str, str]:
    """Run the graders with `args`: {test id: its failure message, "" when it passed}."""
    report = tmp_path / f"{name}.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", f"--junitxml={report}", *args],
                   cwd=ROOT, capture_output=True, text=True, timeout=600)
    results = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        results[f"{case.get('classname')}::{case.get('name')}"] = "" if problem is None else (
            (problem.get("message") or "") + "\n" + (problem.text or ""))
    return results


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Every grader run CI needs, two at a time: the reference, the starters, each mistake."""
    tmp = tmp_path_factory.mktemp("graded")
    jobs = {"reference": [str(COURSE), "--reference"], "starters": [str(COURSE)]}
    jobs |= {name: [str(COURSE / mistake.assignment), "--mistake", name] for name, mistake in MISTAKES.items()}
    with ThreadPoolExecutor(max_workers=2) as pool:
        futures = {name: pool.submit(graded, tmp, name.replace("/", "-"), *args) for name, args in jobs.items()}
        return {name: future.result() for name, future in futures.items()}


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
    assert any(MISTAKES[name].caught_by in message for message in failures), (name, failures)


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
        module, *names = entry.split(".")
        reference, stub = __import__(module), starter
        for name in names:
            reference, stub = getattr(reference, name), stub[name] if isinstance(stub, dict) else getattr(stub, name)
        assert inspect.signature(stub) == inspect.signature(reference) and stub.__doc__ == reference.__doc__, entry


def reference_bodies() -> dict[str, str]:
    """Each assignment function's reference body (after its docstring), one stripped line per line."""
    bodies = {}
    for entries in ASSIGNMENTS.values():
        for entry in entries:
            module, qualified = entry.split(".", 1)
            source, found = strip.definitions(module)
            function = found[qualified]
            lines = source.splitlines()[function.body[0].end_lineno:function.end_lineno]
            bodies[entry] = "\n".join(line.strip() for line in lines if line.strip())
    return bodies


def test_the_students_copy_has_no_answers(tmp_path):
    subprocess.run([sys.executable, str(COURSE / "strip.py"), "hide", str(tmp_path / "copy")], check=True,
                   capture_output=True)
    texts = {path: "\n".join(line.strip() for line in path.read_text().splitlines() if line.strip())
             for path in (tmp_path / "copy").rglob("*") if path.suffix in (".py", ".md")}
    shipped = [(entry, str(path.relative_to(tmp_path / "copy"))) for entry, body in reference_bodies().items()
               for path, text in texts.items() if body in text]
    assert shipped == [], "reference bodies in the students' copy"
    assert "class " not in (tmp_path / "copy" / "course" / "mistakes.py").read_text(), "planted mistakes shipped"
    check = ("import tree, verify\n"
             "for call in (lambda: tree.Tree([0], [-1]).positions(0), lambda: verify.residual_after_rejection(1, 0)):\n"
             "    try:\n        call()\n    except NotImplementedError:\n        continue\n"
             "    raise SystemExit('an answer is still there')\n")
    subprocess.run([sys.executable, "-c", check], cwd=tmp_path / "copy", check=True, capture_output=True)


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
