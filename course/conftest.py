"""The graders' switches, as `python -m pytest course [options]` takes them:

    (none)            grade your code: each assignment's starter.py
    --reference       grade the project's own code (every grader passes)
    --mistake NAME    grade the reference with one planted mistake (course/mistakes.py; CI proves that
                      each grader catches each one)
"""

import sys
from pathlib import Path

COURSE = Path(__file__).resolve().parent
sys.path[:0] = [str(COURSE.parent), str(COURSE.parent / "tests"), str(COURSE)]  # the project, its test helpers

import adapters  # noqa: E402
import torch  # noqa: E402
from hypothesis.internal.conjecture import engine  # noqa: E402

# A failing grader answers within a minute, even on a busy 2-core machine: hypothesis stops shrinking
# its counterexample after 15 s (its default is 300 s; hypothesis is pinned, so this constant is there).
engine.MAX_SHRINKING_SECONDS = 15

# The graders' models are tiny: a second thread buys nothing, and on a busy 2-core machine torch's
# threads wait for each other (a grader that takes 1 s alone took 90 s beside two others).
torch.set_num_threads(1)


def pytest_addoption(parser):
    group = parser.getgroup("course")
    group.addoption("--reference", action="store_true", help="grade the project's reference code")
    group.addoption("--mistake", metavar="NAME", help="grade the reference with one planted mistake (mistakes.py)")


def pytest_configure(config):
    adapters.select(config.getoption("--reference"), config.getoption("--mistake"))
