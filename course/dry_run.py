"""The instructor's dry run: hand out every assignment in turn, as a course does, and check each copy.

    python course/dry_run.py [ASSIGNMENT ...]     # default: every assignment

For assignment K it writes the students' copy (`strip.py hide --through K`), pastes the reference
answer into K's starter only (as a student who solved it would hand it in), and checks, in the copy:
1. K's grader passes;
2. the next assignment's grader fails, and only with NotImplementedError of that assignment's own
   functions (so no grader runs a later assignment's code);
3. the walkthrough runs; the cells it cannot run yet name later assignments only;
4. the commands K's handout asks for (`python ...` in backticks, graders aside) run;
5. the copy passes the project's architecture tests.
CI (.ci/run) runs it after the tests.
"""

import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ElementTree
from pathlib import Path

COURSE = Path(__file__).resolve().parent
sys.path[:0] = [str(COURSE.parent), str(COURSE)]

import strip  # noqa: E402
from assignments import ASSIGNMENTS, assignments_asked  # noqa: E402
from programs.convert import default_model_dir  # noqa: E402

HANDOUT_COMMAND = re.compile(r"`(python (?!-m pytest)[^`]+)`")


# How a grader run is started, besides what it grades: quietly, leaving no cache, writing a report.
PYTEST_OPTIONS = ["-q", "-p", "no:cacheprovider"]


def graded(folder: Path, report: Path, *args, env=None) -> dict[str, str]:
    """Run the graders in `folder` with pytest arguments `args`: {test id: its failure message, "" when
    it passed}."""
    subprocess.run([sys.executable, "-m", "pytest", *PYTEST_OPTIONS, f"--junitxml={report}", *args],
                   cwd=folder, capture_output=True, text=True, timeout=900, env=env)
    return results_of(report)


def results_of(report: Path) -> dict[str, str]:
    """A grader run's junit report, read: {test id: its failure message, "" when it passed}."""
    results = {}
    for case in ElementTree.parse(report).getroot().iter("testcase"):
        problem = case.find("failure")
        problem = problem if problem is not None else case.find("error")
        results[f"{case.get('classname')}::{case.get('name')}"] = "" if problem is None else (
            (problem.get("message") or "") + "\n" + (problem.text or ""))
    return results


def handout_commands(assignment: str) -> list[str]:
    """The commands the handout asks a student to run (its graders aside)."""
    return HANDOUT_COMMAND.findall((COURSE / assignment / "handout.md").read_text())


def copy_environment(work: Path) -> dict[str, str]:
    """The copies' environment: their own cache folder (a handout's `--calibrate` must not replace this
    machine's saved L(n)), holding the default model already converted."""
    cache = work / "cache"
    if not cache.exists():
        cache.mkdir()
        (cache / default_model_dir().name).symlink_to(default_model_dir())
    return os.environ | {"SPECDEC_CACHE": str(cache)}


def problems_of(assignment: str, work: Path) -> list[str]:
    """Hand out `assignment`, answer it, and return what is wrong with the copy (nothing: [])."""
    env = copy_environment(work)
    names = list(ASSIGNMENTS)
    following = names[names.index(assignment) + 1:]
    copy = work / assignment
    strip.hide(copy, assignment)
    (copy / "course" / assignment / "starter.py").write_text(strip.starter(assignment, answered=True))
    problems = []

    own = graded(copy, work / f"{assignment}.xml", f"course/{assignment}", env=env)
    problems += [f"{assignment}'s grader, answered: {test} fails: {message.splitlines()[0]}"
                 for test, message in own.items() if message]
    problems += [] if own else [f"{assignment}'s grader ran no test"]

    if following:
        after = graded(copy, work / f"{following[0]}.xml", f"course/{following[0]}", env=env)
        problems += [f"{following[0]}'s grader, unwritten: {test} " + (
            "passes" if not message else f"fails otherwise than with its own NotImplementedError: "
                                         f"{message.splitlines()[0]}")
                     for test, message in after.items() if f"NotImplementedError: {following[0]}:" not in message]

    walk = subprocess.run([sys.executable, "course/walkthrough.py"], cwd=copy, capture_output=True, text=True,
                          timeout=900, env=env)
    problems += [] if walk.returncode == 0 else [f"the walkthrough fails: {walk.stderr.strip().splitlines()[-1]}"]
    problems += [f"the walkthrough's {cell}needs {needed}, which is not a later assignment"
                 for cell, needed in re.findall(r"=============== (\S+: )not run yet, it needs (\w+)", walk.stdout)
                 if needed not in following]

    architecture = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                                   "tests/test_architecture.py"], cwd=copy, capture_output=True, text=True, env=env)
    problems += [] if architecture.returncode == 0 else [
        f"the copy fails the project's architecture tests: {architecture.stdout.strip().splitlines()[-1]}"]

    for command in handout_commands(assignment):
        run = subprocess.run(command.replace("python", f'"{sys.executable}"', 1), shell=True, cwd=copy,
                             capture_output=True, text=True, timeout=900, env=env)
        if run.returncode != 0:
            problems.append(f"the handout's `{command}` fails: {(run.stderr or run.stdout).strip()[-300:]}")
    return problems


def main(arguments: list[str]) -> int:
    chosen = assignments_asked(__doc__.split("\n\n")[0], "which to hand out", arguments)
    failed = 0
    with tempfile.TemporaryDirectory() as work:
        for assignment in chosen:
            print(f"{assignment}: handing it out ...", flush=True)
            started = time.perf_counter()
            problems = problems_of(assignment, Path(work))
            failed += bool(problems)
            print("\n".join(f"  {problem}" for problem in problems) or "  ok", f"({time.perf_counter() - started:.0f} s)",
                  flush=True)
    return failed


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
